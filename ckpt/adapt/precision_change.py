"""A resume that changes ``precision.params_dtype``: every weight and fp32 main param comes from
the checkpoint's fp32 copy, never from a bf16-rounded one.

What a checkpoint holds (``ckpt.adapt.optim_checkpoint`` describes the keys):

* bf16 runs: bf16 model weights ``K`` and fp32 main params (``optimizer.state.fp32_param.K``
  from the plain optimizer, ``optimizer.state.param.K`` from the distributed one);
* fp32 runs: fp32 model weights ``K``; the distributed optimizer also writes
  ``optimizer.state.param.K`` (the same values), the plain one writes no main param.

So:

* **bf16 -> fp32**: the model weights are read from the stored fp32 main params. The plain
  optimizer's request for ``K`` is pointed at the main-param key. The distributed optimizer
  already requests the main params; its fp32 main params are views of the model weights' own
  data-parallel shard, so after its load the weights are gathered from those shards over the
  data-parallel group (megatron's ``start_param_sync``) and no bf16-rounded row is left.
* **fp32 -> bf16**: the fp32 main params are read from the stored fp32 weights (or the stored
  main params), and the bf16 weights are the main params rounded to nearest (what megatron's
  ``_copy_main_params_to_model_params`` would give). A request may name a stored tensor once
  only (megatron's sharding validation), so where the main param is read from ``K`` the model's
  own request for ``K`` is dropped and filled from the loaded main param after the load.

Same precision: nothing changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ckpt.adapt.optim_kinds import DISTRIBUTED, PLAIN

_MAIN_PREFIXES = ("optimizer.state.fp32_param.", "optimizer.state.param.")


@dataclass
class Plan:
    """What :func:`prepare` changed in a load request, for :func:`finish`."""

    saved_bf16: bool
    now_bf16: bool
    # (path of the dropped model request, path of the main-param request that fills it)
    derived: list = field(default_factory=list)
    sync_params: bool = False


def is_bf16(model_chunks) -> bool:
    """True when the model's weights are bf16 (megatron's Float16Module)."""
    return any(p.dtype == torch.bfloat16 for c in model_chunks for p in c.parameters())


def saved_is_bf16(saved_config: dict | None, stored_keys) -> bool:
    """Whether the checkpoint was written by a bf16 run: its run config's
    ``precision.params_dtype``, else (an older checkpoint) whether it holds plain-optimizer fp32
    main params."""
    dtype = ((saved_config or {}).get("precision") or {}).get("params_dtype")
    if dtype is not None:
        return dtype == "bf16"
    return any(k.startswith(_MAIN_PREFIXES[0]) for k in stored_keys)


def describe(saved_dtype: str, now_dtype: str) -> str:
    """The resume table's effect line of a ``precision.params_dtype`` change."""
    if saved_dtype == "bf16" and now_dtype == "fp32":
        return "weights taken from the checkpoint's fp32 main params"
    if saved_dtype == "fp32" and now_dtype == "bf16":
        return "fp32 main params taken from the checkpoint's fp32 weights; bf16 weights rounded from them"
    return "used from now on"


def _walk(node, path=()):
    """``(path, entry)`` of every sharded entry (anything with a ``key``) under ``node``."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, path + (i,))
    elif hasattr(node, "key") and hasattr(node, "data"):
        yield path, node


def _ident(name: str, entry) -> tuple:
    """What ties an optimizer request to its model request: the model key and the entry's
    place (megatron stacks layers under one key, told apart by offset; a GTP factory by its
    live param, which megatron's ``replace`` carries into the optimizer's copies)."""
    live = getattr(entry, "live_param", None)
    if live is not None:
        return name, id(live)
    if not hasattr(entry, "global_offset") and hasattr(entry, "build"):
        # megatron's SwiGLU factory (an expert's fc1 of every layer and expert under one key):
        # the offsets of the pieces it builds.
        return name, tuple(tuple(piece.global_offset) for _, piece in _walk(entry.build()))
    return name, tuple(getattr(entry, "global_offset", None) or ())


def _get(node, path):
    for part in path:
        node = node[part]
    return node


def _pop(node, path):
    parent = _get(node, path[:-1])
    return parent.pop(path[-1])


def _main_requests(opt_request: dict, mine: str):
    """``(path, entry)`` of the main-param requests, paths relative to ``opt_request``; of each
    entry of megatron's ``ChainedOptimizer`` request (keyed 0, 1...: an MoE model's dense and
    expert optimizer), each entry's kind told by its structure."""
    if opt_request and all(isinstance(k, int) for k in opt_request):
        return [((i, *path), entry) for i, sub in sorted(opt_request.items())
                for path, entry in _main_requests(
                    sub, DISTRIBUTED if "param_state" in sub else PLAIN)]
    if mine == DISTRIBUTED:
        return [(("param_state", i, "param"), state["param"])
                for i, state in (opt_request.get("param_state") or {}).items() if "param" in state]
    return [(("fp32_from_fp16_params", g, j), entry)
            for g, group in enumerate(opt_request.get("fp32_from_fp16_params") or [])
            for j, entry in enumerate(group)]


def prepare(state: dict, stored_keys, mine: str, saved_bf16: bool, now_bf16: bool) -> Plan:
    """Point ``state``'s requests (``{"model": ..., "optimizer": ...}``, modified in place) at
    the checkpoint's fp32 copies. Runs before ``optim_checkpoint.prepare_request``.

    Args:
        state: the load request (model and optimizer sharded state dicts).
        stored_keys: the checkpoint's tensor keys.
        mine: the running optimizer's kind (``optim_kinds.kind_of``).
        saved_bf16, now_bf16: the checkpoint's and this run's weight dtype.
    """
    plan = Plan(saved_bf16, now_bf16)
    if saved_bf16 == now_bf16:
        return plan
    stored = set(stored_keys)
    model = {_ident(entry.key, entry): path for path, entry in _walk(state["model"])}
    if saved_bf16:  # -> fp32
        if mine == DISTRIBUTED:
            plan.sync_params = True
            return plan
        for path, entry in _walk(state["model"]):
            for prefix in _MAIN_PREFIXES:
                if prefix + entry.key in stored:
                    entry.key = prefix + entry.key
                    break
        return plan
    # fp32 -> bf16
    for path, entry in _main_requests(state["optimizer"], mine):
        name = next((entry.key[len(p):] for p in _MAIN_PREFIXES if entry.key.startswith(p)), None)
        if name is None or any(p + name in stored for p in _MAIN_PREFIXES):
            continue  # the stored main param answers it (optim_checkpoint renames the prefix)
        ident = _ident(name, entry)
        if name in stored and ident in model:
            entry.key = name
            _pop(state["model"], model[ident])
            plan.derived.append((model[ident], path))
    return plan


def finish(plan: Plan, loaded: dict) -> None:
    """Fill the dropped model entries of ``loaded`` (``dist_checkpointing.load``'s result) from
    their loaded main params (rounded to the model dtype by the model's ``load_state_dict``)."""
    for model_path, main_path in plan.derived:
        parent = _get(loaded["model"], model_path[:-1])
        parent[model_path[-1]] = _get(loaded["optimizer"], main_path).detach().clone()


def after_optimizer_load(plan: Plan, optimizer, model_chunks) -> None:
    """bf16 -> fp32 with the distributed optimizer: copy each rank's loaded fp32 main-param
    shard into its weights and gather the weights over the data-parallel group (megatron's
    ``DistributedOptimizer._copy_main_params_to_model_params`` and DDP's
    ``start_param_sync``, as after an optimizer step)."""
    if plan.sync_params:
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            opt._copy_main_params_to_model_params()
        for chunk in model_chunks:
            chunk.start_param_sync(force_sync=True)
