"""Optimizer checkpoints across optimizer kinds: megatron's plain (non-distributed) optimizer and
its ``DistributedOptimizer`` in the ``fully_reshardable`` format read each other's files.

Both write the Adam moments as model-space tensors under the same keys
(``optimizer.state.exp_avg.<model key>``, ``optimizer.state.exp_avg_sq.<model key>``), so every
layout change (TP, PP, DP, GTP) is megatron's ordinary resharding. They differ in:

* the fp32 main params: ``optimizer.state.param.<key>`` (distributed, always written) vs
  ``optimizer.state.fp32_param.<key>`` (plain, bf16 runs only; fp32 runs have none: the main
  param is the model weight);
* the non-tensor part: the distributed optimizer keeps the hyper-parameters and ``step`` under
  ``optimizer.param_groups`` (``step`` in each group) next to ``param_state`` /
  ``param_state_sharding_type``; the plain one keeps ``param_groups`` and
  ``state.common_step`` (wrapped in ``optimizer`` for bf16, with ``fp32_from_fp16_params``).

:func:`prepare_request` renames or drops the main-param requests the file cannot answer (before
the load) and :func:`finish_load` rebuilds the non-tensor part in the form the running optimizer's
``load_state_dict`` takes (after it). Same kind: both do nothing. An MoE model's chain of a
dense and an expert optimizer (megatron's ``ChainedOptimizer``; keys without its
``chained_<i>.`` prefix) resumes a chain of another length, kind or precision entry by running
entry (:func:`_rechain`); so does Muon's chain (Muon, expert Muon, Adam where the experts are
split; Muon and Adam with ``chained_<i>.`` keys where not: :func:`match_chain_prefixes`).
Which optimizer runs and which wrote the file: :mod:`ckpt.adapt.optim_kinds`.
"""

from __future__ import annotations

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

from ckpt.adapt.optim_kinds import (
    DISTRIBUTED, PLAIN, OptimizerCheckpointError, chain_of, entry_kind, is_chain, is_muon,
    is_muon_group, kind_of, leaves, without_chain_prefix)

def _single(optimizer):
    chained = chain_of(optimizer)
    if len(chained) != 1:
        raise OptimizerCheckpointError(
            f"changing optimizer kind needs one megatron optimizer per rank, found {len(chained)}")
    return chained[0]


def chain_length(common_optimizer) -> int:
    """How many megatron optimizers wrote ``common_optimizer`` (a ``ChainedOptimizer`` of more
    than one keeps one entry per optimizer under keys 0, 1, ...)."""
    node = common_optimizer
    if isinstance(node, dict) and node and all(isinstance(k, int) for k in node):
        return len(node)
    return 1


def _rechain(optimizer, loaded: dict, common: dict, dropped) -> dict | list:
    """The state dict for a running chain that differs from the file's (:func:`_regroup`) in
    length, kind (plain / distributed) or precision: an MoE model has a dense and an expert
    optimizer where its experts are split (expert parallel size > 1, expert tensor parallel
    size != tensor parallel size, expert GTP: megatron's ``get_megatron_optimizer`` gives
    params with ``allreduce = False`` their own), one otherwise.

    The moments (and a distributed optimizer's main params) are model-space tensors under each
    param's own key (the request put them in the running chain's places, whichever entry of
    the file wrote them); each running optimizer gets them in its own structure
    (:func:`_rebuilt`), the hyper-parameters of each param group from the file's group with the
    same identity (``param_group_identifier_keys``; a group of the other side's expert
    optimizer differs only in ``is_expert_parallel``) and the step from the file (the same in
    every part: ``ChainedOptimizer._synchronize_steps``; the plain optimizer's
    ``state.common_step``, the distributed one's ``step`` of each param group). Muon's entries
    (an optimizer per expert kind and one Adam where experts are split, a Muon and an Adam
    where not) hold no step: Muon's update has none.

    Args:
        dropped: :func:`prepare_request`'s result (``{index: dropped}`` for a running chain).

    Raises:
        OptimizerCheckpointError: the file's parts hold different steps, none, or no param
            group matching a running one.
    """
    chain = chain_of(optimizer)
    parts = [common[k] for k in sorted(common)] if is_chain(common) else [common]
    groups, steps = [], set()
    for part in parts:
        if entry_kind(part) == DISTRIBUTED:
            part_groups = part["optimizer"]["param_groups"]
            steps |= {float(g["step"]) for g in part_groups if g.get("step") is not None}
        else:
            node = _plain_node(part)
            part_groups, step = node["param_groups"], node.get("state", {}).get("common_step")
            if step is not None or not all(map(is_muon_group, part_groups)):
                steps.add(None if step is None else float(step))
        groups += part_groups
    if len(steps) != 1 or None in steps:
        raise OptimizerCheckpointError(f"the checkpoint's optimizer parts hold steps {steps}")
    step = steps.pop()
    nodes = [loaded[i] for i in range(len(chain))] if len(chain) > 1 else [loaded]
    drops = dropped if isinstance(dropped, dict) else {0: dropped}
    # Muon keeps no step (its groups and Adam's differ in megatron's identity key "optimizer").
    out = [_rebuilt(opt, node, groups, None if is_muon(opt) else step, drops.get(i) or [])
           for i, (opt, node) in enumerate(zip(chain, nodes))]
    return out if len(chain) > 1 else out[0]


def _rebuilt(opt, node: dict, groups: list, step: float, dropped: list) -> dict:
    """One running megatron optimizer's state dict from its loaded request ``node``, the file's
    param ``groups`` (any chain entry) and ``step``: the distributed optimizer's
    ``{optimizer: {param_groups}, param_state, param_state_sharding_type}``, the plain fp32
    one's ``{state, param_groups}``, the plain bf16 one's ``{optimizer: {state, param_groups},
    fp32_from_fp16_params}``. ``step`` None: Muon's, which keeps none. ``dropped``: as
    :func:`prepare_one`."""
    own = opt.optimizer.state_dict()["param_groups"]
    hyper = _hyper(groups, own, ignore=("is_expert_parallel",))
    if kind_of(opt) == DISTRIBUTED:
        param_state = dict(node["param_state"])
        if dropped:
            params = _params_in_fully_reshardable_order(opt)
            for i in dropped:
                param_state[i] = {**param_state[i], "param": params[i].detach()}
        return {"optimizer": {"param_groups": [g | {"step": step} for g in hyper]},
                "param_state": param_state, "param_state_sharding_type": "fully_reshardable"}
    bf16 = "fp32_from_fp16_params" in node
    moments = node["optimizer"]["state"] if bf16 else node["state"]
    inner = {"state": {k: v for k, v in moments.items() if k != "common_step"},
             "param_groups": hyper}
    if step is not None:
        inner["state"]["common_step"] = torch.tensor(step)
    if bf16:
        return {"fp32_from_fp16_params": node["fp32_from_fp16_params"], "optimizer": inner}
    return inner


def match_chain_prefixes(opt_request: dict, stored_keys) -> None:
    """Point each request the file holds only under another chain prefix at the file's key.

    megatron's ``ChainedOptimizer`` prefixes each entry's keys with ``chained_<i>.`` unless told
    not to (``ckpt.io.state.optimizer_metadata`` does so where experts are split):
    a Muon chain (Muon for the 2-D weights, Adam for the rest) writes ``chained_0.`` /
    ``chained_1.`` keys where the experts are not split and bare keys where they are. Each
    param's tensors have one name either way (the part after the prefix), so the request is
    renamed in place (``opt_request`` modified).

    Raises:
        OptimizerCheckpointError: a name the file holds under more than one prefix.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    by_name: dict = {}
    for key in stored_keys:
        by_name.setdefault(without_chain_prefix(key), []).append(key)
    for entry in nested_values(opt_request):
        key = getattr(entry, "key", None)
        if not isinstance(key, str) or key in stored_keys:
            continue
        found = by_name.get(without_chain_prefix(key), [])
        if len(found) > 1:
            raise OptimizerCheckpointError(f"the checkpoint holds {key!r} as {sorted(found)}")
        if found:
            entry.key = found[0]


def prepare_for_load(optimizer) -> None:
    """Give a distributed optimizer that never stepped its Adam state and ``step`` (megatron's
    ``DistributedOptimizer.state_dict`` needs one ``step``; the load overwrites all of it)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in leaves(optimizer):
        if not isinstance(opt, DistributedOptimizer):
            continue  # megatron's Float16/FP32 optimizers initialize their state at the request
        opt.init_state_fn(opt.optimizer, opt.config)
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                opt.optimizer.state[p].setdefault("step", torch.tensor(0.0))


def _main_param_entries(opt_request, mine: str):
    """``[(container, key, entry)]`` of the main-param requests in an optimizer sharded state
    dict of kind ``mine``."""
    out = []
    if mine == DISTRIBUTED:
        for state in (opt_request.get("param_state") or {}).values():
            if "param" in state:
                out.append((state, "param", state["param"]))
    else:
        for group in opt_request.get("fp32_from_fp16_params") or []:
            for i, entry in enumerate(group):
                out.append((group, i, entry))
    return out


def _chain_pairs(optimizer, opt_request: dict, common: dict):
    """``[(index, optimizer, request entry, common entry)]`` of a chain on both sides.

    Raises:
        OptimizerCheckpointError: the checkpoint's chain has other entries than this one.
    """
    chained = list(getattr(optimizer, "chained_optimizers", []))
    if not is_chain(common) or sorted(common) != sorted(opt_request) or len(chained) != len(
            opt_request):
        raise OptimizerCheckpointError(
            f"the checkpoint's optimizer holds entries {sorted(common) if is_chain(common) else 1}"
            f", this optimizer chains {len(chained)}: they cannot be matched")
    return [(i, chained[i], opt_request[i], common[i]) for i in sorted(opt_request)]


def prepare_request(opt_request: dict, stored_keys, mine: str, saved: str, optimizer=None,
                    common: dict | None = None):
    """:func:`prepare_one` for each entry of a chained optimizer (``optimizer`` given and the
    request a chain; then each entry's own kinds, and ``{index: dropped}`` returned), else for
    the one optimizer."""
    if optimizer is not None and common is not None and _regroup(optimizer, common):
        # Keys carry no chain prefix (or match_chain_prefixes found them): each running entry's
        # requests, whichever entry wrote them. The groups come from the file's entry of the
        # same identity (_rechain), not the one at the same index.
        chain = chain_of(optimizer)
        for node in (opt_request.values() if is_chain(opt_request) else [opt_request]):
            for part in (node, node.get("optimizer", {})):
                part.pop("param_groups", None)
        if not is_chain(opt_request):
            return prepare_one(opt_request, stored_keys, kind_of(chain[0]), saved)
        return {i: prepare_one(opt_request[i], stored_keys, kind_of(opt), saved)
                for i, opt in enumerate(chain)}
    if mine == saved or optimizer is None or not is_chain(opt_request):
        return prepare_one(opt_request, stored_keys, mine, saved)
    return {i: prepare_one(request, stored_keys, kind_of(opt), entry_kind(node))
            for i, opt, request, node in _chain_pairs(optimizer, opt_request, common)}


def _is_bf16(opt) -> bool:
    """Whether a (not chained) megatron optimizer keeps fp32 main params of bf16 weights."""
    return kind_of(opt) == PLAIN and hasattr(opt, "fp32_from_float16_groups")


def _regroup(optimizer, common: dict) -> bool:
    """Whether :func:`_rechain` rebuilds the state: a chain on either side (an MoE model's
    dense and expert optimizer) whose file entries differ from the running ones in number, or
    in kind or (plain optimizer) precision with each side's entries all of one kind. The same
    structure loads as it is; a chain mixing kinds (Muon's layer-wise one, whose Muon and Adam
    param groups may share an identity) is matched entry by entry."""
    chain = chain_of(optimizer)
    parts = [common[k] for k in sorted(common)] if is_chain(common) else [common]
    if len(chain) == 1 and len(parts) == 1 or len({kind_of(o) for o in chain}) != 1:
        return False
    if len(parts) != len(chain):
        return True
    return len({entry_kind(p) for p in parts}) == 1 and any(
        kind_of(opt) != entry_kind(part)
        or kind_of(opt) == PLAIN and _is_bf16(opt) != ("param_groups" not in part)
        for opt, part in zip(chain, parts))


def prepare_one(opt_request: dict, stored_keys, mine: str, saved: str) -> list:
    """Point the main-param requests of ``opt_request`` at what a ``saved``-kind file holds.

    ``optimizer.state.param.K`` <-> ``optimizer.state.fp32_param.K``; a distributed optimizer's
    main param that the file does not hold (a plain fp32 run) is dropped from the request and
    taken from the loaded model weight by :func:`finish_load`.

    Args:
        opt_request: the running optimizer's sharded state dict (modified in place).
        stored_keys: the checkpoint's tensor keys.
        mine, saved: the running and the saving optimizer kind.

    Returns:
        The indices of ``param_state`` whose main param was dropped.
    """
    if mine == saved:
        return []
    src, dst = (("optimizer.state.param.", "optimizer.state.fp32_param.") if mine == DISTRIBUTED
                else ("optimizer.state.fp32_param.", "optimizer.state.param."))
    dropped = []
    stored_keys = set(stored_keys)
    # A factory's key is stored as its parts' keys, <key>.<part> (megatron's
    # _split_tensor_factory: Mamba's conv1d x/B/C, in_proj's z/x/B/C/dt without GTP).
    parts = {k.rpartition(".")[0] for k in stored_keys}

    def held(entry_, key_):
        return key_ in stored_keys or isinstance(entry_, ShardedTensorFactory) and key_ in parts

    for container, key, entry in _main_param_entries(opt_request, mine):
        if held(entry, entry.key):
            continue  # a chain's entry of the file's kind (Muon's layer-wise chain)
        prefix, found, name = entry.key.partition(src)  # prefix: a chain's "chained_<i>."
        if not found or prefix.count(".") > 1:
            continue
        new = prefix + dst + name
        if held(entry, new):
            entry.key = new
        elif mine == DISTRIBUTED:
            del container[key]
        else:
            raise OptimizerCheckpointError(
                f"the checkpoint holds no fp32 main param for {name!r} "
                f"(neither {entry.key!r} nor {new!r})")
    if mine == DISTRIBUTED:
        dropped = [i for i, state in opt_request["param_state"].items() if "param" not in state]
    return dropped


def _groups_by_identity(groups: list, ignore: tuple = ()) -> dict:
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    keys = [k for k in param_group_identifier_keys if k not in ignore]

    def ident(group):
        return tuple(group.get(k, group.get(f"pre_{k}")) for k in keys)

    return {ident(g): g for g in groups}, ident


def _hyper(groups: list, own_groups: list, ignore: tuple = ()) -> list:
    """The file's param groups (hyper-parameters) in the running optimizer's group order, each
    with this optimizer's own ``params`` (and its own values of the identity keys ``ignore``d
    in matching)."""
    by_id, ident = _groups_by_identity(groups, ignore)
    out = []
    for own in own_groups:
        saved = by_id.get(ident(own))
        if saved is None:
            raise OptimizerCheckpointError(
                f"no param group of the checkpoint matches this optimizer's group "
                f"{ident(own)} (lr/weight-decay settings differ)")
        out.append({k: v for k, v in saved.items() if k not in ("params", "step", *ignore)}
                   | {"params": own["params"]} | {k: own.get(k, False) for k in ignore})
    return out


def _plain_node(common: dict) -> dict:
    """The plain optimizer's ``{param_groups, state}`` in its common state: at the top for fp32
    runs, under ``optimizer`` for bf16 ones (megatron's ``Float16OptimizerWithFloat16Params``)."""
    return common if "param_groups" in common else common["optimizer"]


def finish_load(optimizer, loaded: dict, common: dict, mine: str, saved: str, dropped) -> dict:
    """:func:`finish_one` for each entry of a chained optimizer (``dropped`` a dict, from
    :func:`prepare_request` of a chain), else for the one optimizer."""
    if _regroup(optimizer, common):
        return _rechain(optimizer, loaded, common, dropped)
    if not isinstance(dropped, dict):
        return _own_state_of_empty(optimizer, finish_one(optimizer, loaded, common, mine, saved,
                                                         dropped))
    return _own_state_of_empty(optimizer, {
        i: finish_one(opt, entry, node, kind_of(opt), entry_kind(node), dropped[i])
        for i, opt, entry, node in _chain_pairs(optimizer, loaded, common)})


def _own_state_of_empty(optimizer, state):
    """``state`` with each chain entry whose optimizer holds no params given that optimizer's
    own state dict: megatron builds the expert optimizer on a pipeline stage without MoE layers
    too, and a Muon entry with no tensors loads as its ``param_groups`` alone (no ``state``),
    which its ``load_state_dict`` cannot take. Nothing of it is restored: it has no params."""
    chain = chain_of(optimizer)
    if len(chain) == 1 or not isinstance(state, dict) or not is_chain(state):
        return state
    for i, opt in enumerate(chain):
        if not any(g["params"] for g in opt.optimizer.param_groups):
            state[i] = opt.state_dict()
    return state


def finish_one(optimizer, loaded: dict, common: dict, mine: str, saved: str,
               dropped: list) -> dict:
    """The state dict the running optimizer's ``load_state_dict`` takes.

    Same kind and precision: ``loaded`` as it is. A plain optimizer resumed from another kind
    or another precision (fp32 ``{state, param_groups}`` vs bf16 ``{optimizer: {state,
    param_groups}, fp32_from_fp16_params}``) gets the file's hyper-parameters and step with the
    loaded moments in its own structure.

    Args:
        optimizer: the running megatron optimizer (its model weights already loaded).
        loaded: ``dist_checkpointing.load``'s ``optimizer`` entry (the request's tensors merged
            into the file's common optimizer state).
        common: the checkpoint's common ``optimizer`` entry.
        mine, saved, dropped: as :func:`prepare_request`.

    Raises:
        OptimizerCheckpointError: the file's param groups or step cannot be matched.
    """
    if chain_length(common) != len(chain_of(optimizer)):
        return _rechain(optimizer, loaded, common, dropped)
    bf16_now = "fp32_from_fp16_params" in loaded
    if mine == saved and (mine == DISTRIBUTED or bf16_now == ("param_groups" not in common)):
        return loaded
    if mine == saved and common and all(isinstance(k, int) for k in common):
        return loaded  # megatron's ChainedOptimizer (Muon + Adam): the same chain on both sides
    opt = _single(optimizer)
    own = opt.optimizer.state_dict()["param_groups"]
    if mine == PLAIN:
        if saved == DISTRIBUTED:
            groups = common["optimizer"]["param_groups"]
            steps = {g["step"] for g in groups if "step" in g}
            if len(steps) != 1:
                raise OptimizerCheckpointError(f"the checkpoint's param groups hold steps {steps}")
            step = torch.tensor(float(steps.pop()))
        else:
            node = _plain_node(common)
            groups, step = node["param_groups"], node.get("state", {}).get("common_step")
            if step is None:
                raise OptimizerCheckpointError("the checkpoint's optimizer state has no common_step")
        moments = loaded["optimizer"]["state"] if bf16_now else loaded["state"]
        inner = {"state": {k: v for k, v in moments.items() if k != "common_step"},
                 "param_groups": _hyper(groups, own)}
        inner["state"]["common_step"] = step
        if bf16_now:
            return {k: v for k, v in loaded.items() if k not in ("state", "param_groups")} | {
                "optimizer": inner}
        return inner
    # mine == DISTRIBUTED, file: plain optimizer
    node = _plain_node(common)
    groups, state = node["param_groups"], node.get("state", {})
    step = state.get("common_step")
    if step is None:
        raise OptimizerCheckpointError("the checkpoint's optimizer state has no common_step")
    hyper = [g | {"step": float(step)} for g in _hyper(groups, own)]
    param_state = dict(loaded["param_state"])
    if dropped:
        params = _params_in_fully_reshardable_order(opt)
        for i in dropped:
            param_state[i] = {**param_state[i], "param": params[i].detach()}
    return {"optimizer": {"param_groups": hyper}, "param_state": param_state,
            "param_state_sharding_type": "fully_reshardable"}


def with_sharding_type(state, sharding_type: str):
    """``state`` (what :func:`finish_load` returned: one optimizer's state dict, or a chain's
    as a dict or list of them) with every distributed optimizer's ``param_state_sharding_type``
    set to the format its ``param_state`` was requested in (``sharding_type``), whichever
    format wrote the file: megatron's ``load_state_dict`` reads ``param_state`` by that type, and
    both formats hold the same keys."""
    parts = state.values() if is_chain(state) else state if isinstance(state, list) else [state]
    for part in parts:
        if isinstance(part, dict) and "param_state_sharding_type" in part:
            part["param_state_sharding_type"] = sharding_type
    return state


def _params_in_fully_reshardable_order(opt) -> list:
    """The model params in the order of megatron's ``sharded_param_state_fully_reshardable``
    (``param_state`` indices): buffer by buffer, ``param_index_map`` order."""
    return [p for i in range(len(opt.gbuf_ranges)) for p in opt.buffers[i].param_index_map]
