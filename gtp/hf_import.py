"""Import a Hugging Face ``transformers`` model directory as a logical checkpoint (the mirror of
:mod:`gtp.hf_export`).

``import_hf(HF_DIR, OUT)`` reads ``config.json`` (``transformers.AutoConfig``, local files only)
and the safetensors weights (``model.safetensors``, or the shards a
``model.safetensors.index.json`` names) and writes ``OUT/iter_0000000`` plus
``latest_checkpointed_iteration.txt``: a torch_dist checkpoint in the logical format
(``docs/checkpoint-format.md``) that loads at any layout, with the common state of a
gtp-recipes checkpoint (iteration 0, a tp1 ``layout`` record, a ``logical-v1`` ``gtp_layout``
record, the real ``vocab_size``, no optimizer state) and, in ``train_state["config"]``, the run
config the model implies: a ``model`` group in the field names :mod:`gtp.hf_export` reads
(megatron ``TransformerConfig`` / ``GPTModel`` names) and a ``data`` group with ``vocab_size``,
``eod_id`` and ``tokenizer`` (the HF dir when it holds a ``tokenizer.json``).

No model is built. Each checkpoint tensor chunk is produced when the writer asks for it
(a torch DCP ``SavePlanner`` whose ``resolve_data`` reads the source tensors of one layer and
maps them). torch's ``FileSystemWriter`` keeps the last chunk of each key until its file is
written, so the peak is about the vocabulary tensors plus one layer's tensors per key, whatever
the number of layers. Per-layer tensors are stored as megatron stores them, stacked along a
leading layer axis (``[num_layers, ...]``), one chunk per layer.

Mappings (inverse of :mod:`gtp.hf_export`, same megatron names):

* ``GPT2LMHeadModel`` -> GPT (LayerNorm, linear biases, GeLU, learned absolute positions).
  GPT-2's ``Conv1D`` weights are ``[in, out]``: transposed. ``c_attn``'s ``[q | k | v]`` columns
  become megatron's fused per-head QKV rows. Only ``activation_function="gelu"`` (the exact erf
  GeLU megatron's MLP computes) is accepted: the published GPT-2's ``gelu_new`` (tanh
  approximation) is refused.
* ``LlamaForCausalLM`` -> Llama family (RMSNorm, no bias, SwiGLU, RoPE, GQA). ``q/k/v_proj``
  become megatron's per-query-group fused rows (``SelfAttention.get_query_key_value_tensors``:
  per group its queries, its key, its value), ``[gate_proj; up_proj]`` is the gated fc1. RoPE
  scaling ``rope_type="llama3"`` maps to ``rope_scaling``/``rope_scaling_factor``; megatron-core
  0.19.2's ``RotaryEmbedding._apply_scaling`` fixes ``low_freq_factor=1``,
  ``high_freq_factor=4`` and ``original_max_position_embeddings=8192``, so other values are
  refused.

Every file read must lie inside ``HF_DIR`` (symlinks resolved) and every size of
``config.json`` is checked against the safetensors headers before anything is planned
(:mod:`gtp.hf_weights`). Everything that cannot be mapped exactly is refused with
:class:`HFImportError` naming the config field, the tensor or the index entry.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

from gtp.hf_weights import HFImportError, Weights, check_sizes, confined
from gtp.records import GTP_FORMAT_LOGICAL, METADATA_KEY, TRACKER, megatron_core_version

# Common-state key: what the checkpoint was imported from.
IMPORTED_KEY = "hf_imported_from"
# megatron-core 0.19.2 RotaryEmbedding._apply_scaling's fixed Llama-3 parameters.
MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}
# HF buffers that are not weights (older checkpoints saved them).
_BUFFERS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")




# ------------------------------------------------------------------------------------------
# config.json -> model fields
# ------------------------------------------------------------------------------------------
def _refuse(field: str, value, valid: str) -> HFImportError:
    return HFImportError(f"config.json {field}={value!r}: {valid}")


def _rope(config) -> dict:
    """``{"rope_type", "rope_theta", ...}`` of a transformers config (v5 ``rope_parameters``, or
    v4 ``rope_theta`` / ``rope_scaling``)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        out = dict(params)
    else:
        out = dict(getattr(config, "rope_scaling", None) or {})
        out.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    out.setdefault("rope_type", out.pop("type", "default"))
    return out


def _llama_fields(c) -> dict:
    heads, hidden = c.num_attention_heads, c.hidden_size
    if c.hidden_act != "silu":
        raise _refuse("hidden_act", c.hidden_act, "the Llama family is imported with 'silu' "
                                                  "(SwiGLU) only")
    for name in ("attention_bias", "mlp_bias"):
        if getattr(c, name, False):
            raise _refuse(name, True, "megatron's Llama-family model here has no linear biases "
                                      "(model.add_bias_linear=false)")
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    if head_dim * heads != hidden:
        raise _refuse("head_dim", head_dim, f"only hidden_size / num_attention_heads = "
                                            f"{hidden // heads} (model has no kv_channels field)")
    rope = _rope(c)
    theta = float(rope.get("rope_theta", 10000.0))
    if theta != int(theta):
        raise _refuse("rope_theta", theta, "model.rotary_base is an integer")
    fields = {"rope_scaling": False, "rope_scaling_factor": 8.0}
    kind = rope.get("rope_type", "default")
    if kind == "llama3":
        for key, want in MEGATRON_LLAMA3_ROPE.items():
            if float(rope.get(key, want)) != want:
                raise _refuse(f"rope_parameters.{key}", rope.get(key),
                              f"megatron-core's Llama-3 RoPE scaling fixes it to {want}")
        fields = {"rope_scaling": True, "rope_scaling_factor": float(rope["factor"])}
    elif kind != "default":
        raise _refuse("rope_parameters.rope_type", kind, "valid are 'default' and 'llama3'")
    if float(getattr(c, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        raise _refuse("partial_rotary_factor", c.partial_rotary_factor, "only 1.0")
    groups = getattr(c, "num_key_value_heads", None) or heads
    return {
        "num_layers": c.num_hidden_layers, "hidden_size": hidden, "num_attention_heads": heads,
        "num_query_groups": groups, "ffn_hidden_size": c.intermediate_size,
        "seq_length": c.max_position_embeddings, "swiglu": True, "normalization": "RMSNorm",
        "layernorm_epsilon": float(c.rms_norm_eps), "add_bias_linear": False,
        "position_embedding_type": "rope", "rotary_base": int(theta), "rotary_percent": 1.0,
        **fields,
        "share_embeddings_and_output_weights": bool(c.tie_word_embeddings),
    }


def _gpt2_fields(c) -> dict:
    if c.activation_function != "gelu":
        raise _refuse("activation_function", c.activation_function,
                      "megatron's GPT MLP computes the exact erf GeLU (F.gelu), imported from "
                      "'gelu' only; GPT-2's 'gelu_new' is the tanh approximation")
    for name, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                       ("add_cross_attention", False)):
        if bool(getattr(c, name, want)) != want:
            raise _refuse(name, getattr(c, name), f"only {want} (megatron's attention scales by "
                                                  f"1/sqrt(head_dim))")
    return {
        "num_layers": c.n_layer, "hidden_size": c.n_embd, "num_attention_heads": c.n_head,
        "num_query_groups": None, "ffn_hidden_size": c.n_inner or 4 * c.n_embd,
        "seq_length": c.n_positions, "swiglu": False, "normalization": "LayerNorm",
        "layernorm_epsilon": float(c.layer_norm_epsilon), "add_bias_linear": True,
        "position_embedding_type": "learned_absolute",
        "share_embeddings_and_output_weights": bool(c.tie_word_embeddings),
    }


_FIELDS = {"llama": _llama_fields, "gpt2": _gpt2_fields}


def read_config(hf_dir) -> tuple[str, object]:
    """``(model_type, transformers config)`` of ``hf_dir`` (local files only).

    Raises:
        HFImportError: no config.json, one transformers cannot read (no ``model_type``), or a
            model type other than those importable.
    """
    from transformers import AutoConfig

    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise HFImportError(f"{hf_dir} holds no config.json: not a Hugging Face model directory "
                            f"(only local directories work offline)")
    confined(hf_dir, "config.json", "the config file")
    try:
        config = AutoConfig.from_pretrained(str(hf_dir), local_files_only=True)
    except (ValueError, OSError) as exc:  # transformers: "Unrecognized model in ...", bad JSON
        kind = "no model_type" if "model_type" in str(exc) else str(exc).split("\n")[0]
        raise HFImportError(
            f"{hf_dir / 'config.json'} is not a Hugging Face model config ({kind}); give a "
            f"Hugging Face model dir (config.json with model_type "
            f"{' or '.join(sorted(_FIELDS))}, and its safetensors)") from None
    if config.model_type not in _FIELDS:
        raise _refuse("model_type", config.model_type, f"importable are {sorted(_FIELDS)}")
    return config.model_type, config


def implied_model(hf_dir) -> dict:
    """The ``model`` config fields of ``hf_dir``'s model (names of ``recipes``' model group and
    :mod:`gtp.hf_export`), without reading weights.

    Raises:
        HFImportError: naming the config field that cannot be mapped.
    """
    kind, config = read_config(hf_dir)
    return {"name": f"hf_{kind}", **_FIELDS[kind](config)}


def token_ids(config) -> dict:
    """``{"bos_token_id", "eos_token_id", "pad_token_id"}`` of a transformers config, as it gives
    them (int, None, or for some models a list of eos ids)."""
    return {name: getattr(config, name, None)
            for name in ("bos_token_id", "eos_token_id", "pad_token_id")}


# ------------------------------------------------------------------------------------------
# safetensors
# ------------------------------------------------------------------------------------------
def _fuse_qkv(q, k, v, groups: int):
    """HF's q ``[heads*d, ...]``, k, v ``[groups*d, ...]`` -> megatron's fused rows
    ``[groups * (heads/groups + 2) * d, ...]`` (per group: its queries, its key, its value)."""
    import torch

    rest = q.shape[1:]
    q = q.reshape(groups, -1, *rest)
    k = k.reshape(groups, -1, *rest)
    v = v.reshape(groups, -1, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


# An entry: (megatron key, HF names it is made of, per layer?, fn(list of tensors) -> tensor).
def _gpt2_plan(m: dict, prefix: str) -> list:
    heads, h = m["num_attention_heads"], m["hidden_size"]

    def qkv(t):
        w = t[0].t() if t[0].dim() == 2 else t[0]  # Conv1D [in, 3h] -> [3h, in]
        q, k, v = w.split(h, dim=0)
        return _fuse_qkv(q, k, v, heads)

    T = lambda t: t[0].t()  # noqa: E731 - Conv1D weight [in, out] -> Linear [out, in]
    I = lambda t: t[0]  # noqa: E731
    p, L = prefix, "decoder.layers."
    plan = [
        ("embedding.word_embeddings.weight", [p + "wte.weight"], False, I),
        ("embedding.position_embeddings.weight", [p + "wpe.weight"], False, I),
        ("decoder.final_layernorm.weight", [p + "ln_f.weight"], False, I),
        ("decoder.final_layernorm.bias", [p + "ln_f.bias"], False, I),
    ]
    h_ = p + "h.{i}."
    plan += [
        (L + "self_attention.linear_qkv.layer_norm_weight", [h_ + "ln_1.weight"], True, I),
        (L + "self_attention.linear_qkv.layer_norm_bias", [h_ + "ln_1.bias"], True, I),
        (L + "self_attention.linear_qkv.weight", [h_ + "attn.c_attn.weight"], True, qkv),
        (L + "self_attention.linear_qkv.bias", [h_ + "attn.c_attn.bias"], True, qkv),
        (L + "self_attention.linear_proj.weight", [h_ + "attn.c_proj.weight"], True, T),
        (L + "self_attention.linear_proj.bias", [h_ + "attn.c_proj.bias"], True, I),
        (L + "mlp.linear_fc1.layer_norm_weight", [h_ + "ln_2.weight"], True, I),
        (L + "mlp.linear_fc1.layer_norm_bias", [h_ + "ln_2.bias"], True, I),
        (L + "mlp.linear_fc1.weight", [h_ + "mlp.c_fc.weight"], True, T),
        (L + "mlp.linear_fc1.bias", [h_ + "mlp.c_fc.bias"], True, I),
        (L + "mlp.linear_fc2.weight", [h_ + "mlp.c_proj.weight"], True, T),
        (L + "mlp.linear_fc2.bias", [h_ + "mlp.c_proj.bias"], True, I),
    ]
    return plan


def _llama_plan(m: dict, prefix: str) -> list:
    import torch

    groups = m["num_query_groups"]
    I = lambda t: t[0]  # noqa: E731
    L, h_ = "decoder.layers.", prefix + "layers.{i}."
    a = h_ + "self_attn."
    return [
        ("embedding.word_embeddings.weight", [prefix + "embed_tokens.weight"], False, I),
        ("decoder.final_layernorm.weight", [prefix + "norm.weight"], False, I),
        (L + "self_attention.linear_qkv.layer_norm_weight", [h_ + "input_layernorm.weight"],
         True, I),
        (L + "self_attention.linear_qkv.weight",
         [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"], True,
         lambda t: _fuse_qkv(*t, groups)),
        (L + "self_attention.linear_proj.weight", [a + "o_proj.weight"], True, I),
        (L + "mlp.linear_fc1.layer_norm_weight", [h_ + "post_attention_layernorm.weight"],
         True, I),
        (L + "mlp.linear_fc1.weight", [h_ + "mlp.gate_proj.weight", h_ + "mlp.up_proj.weight"],
         True, lambda t: torch.cat(t, dim=0)),
        (L + "mlp.linear_fc2.weight", [h_ + "mlp.down_proj.weight"], True, I),
    ]


_PLANS = {"gpt2": (_gpt2_plan, "transformer."), "llama": (_llama_plan, "model.")}


def _prefix(kind: str, names) -> str:
    """The HF tensor names' prefix (``"model."``, ``"transformer."``, or none)."""
    prefix = _PLANS[kind][1]
    if kind == "gpt2" and not any(n.startswith(prefix) for n in names):
        prefix = ""  # a GPT2Model saved on its own (no "transformer." prefix)
    return prefix


def _plan(kind: str, m: dict, weights: Weights) -> dict:
    """``{megatron key: (HF names per layer or [names], per_layer, fn)}`` and every HF tensor
    accounted for (an unmapped one is refused, naming it)."""
    names = weights.names()
    plan = _PLANS[kind][0](m, _prefix(kind, names))
    if not m["share_embeddings_and_output_weights"]:
        plan.append(("output_layer.weight", ["lm_head.weight"], False, lambda t: t[0]))
    out, used = {}, set()
    for key, sources, per_layer, fn in plan:
        if per_layer:
            srcs = [[s.format(i=i) for s in sources] for i in range(m["num_layers"])]
        else:
            srcs = [sources]
        for group in srcs:
            for s in group:
                if s not in names:
                    raise HFImportError(f"the weights lack tensor {s!r} (needed for megatron's "
                                        f"{key})")
            used.update(group)
        out[key] = (srcs, per_layer, fn)
    extra = sorted(n for n in names - used
                   if not n.endswith(_BUFFERS)
                   and not (n == "lm_head.weight" and m["share_embeddings_and_output_weights"]))
    if extra:
        raise HFImportError(f"tensor {extra[0]!r} has no megatron counterpart ({len(extra)} "
                            f"unmapped: {extra[:5]})")
    return out


# ------------------------------------------------------------------------------------------
# writing: torch DCP, one chunk resolved at a time
# ------------------------------------------------------------------------------------------
def _planner_class():
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import SavePlan

    class _LazyPlanner(DefaultSavePlanner):
        """Plans the given write items; ``resolve_data`` makes each chunk when it is written."""

        def __init__(self, items, producers):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self._items, self._producers = items, producers

        def create_local_plan(self):
            self.plan = SavePlan(self._items)
            return self.plan

        def resolve_data(self, write_item):
            return self._producers[(write_item.index.fqn, tuple(write_item.index.offset or ()))]()

    return _LazyPlanner


def _tensor_item(fqn: str, offset: tuple, sizes: tuple, global_size: tuple, dtype):
    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata, MetadataIndex, TensorProperties)
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    return WriteItem(
        index=MetadataIndex(fqn, torch.Size(offset)), type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(offset), sizes=torch.Size(sizes)),
            properties=TensorProperties(dtype=dtype), size=torch.Size(global_size)))


def _write_dcp(path: Path, plan: dict, weights: Weights, common: dict) -> int:
    """Write the checkpoint files into ``path``; returns the number of bytes of tensor data."""
    import io

    import torch
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    items, producers, total = [], {}, 0
    for key, (srcs, per_layer, fn) in plan.items():
        # The shape and dtype of one produced chunk, from the first source's metadata only.
        first = fn([torch.empty(weights.meta(s)[0], dtype=weights.meta(s)[1], device="meta")
                    for s in srcs[0]])
        shape, dtype = tuple(first.shape), first.dtype
        for i, group in enumerate(srcs):
            for s in group:
                if weights.meta(s)[1] != dtype:
                    raise HFImportError(f"tensor {s!r} is {weights.meta(s)[1]}, the other "
                                        f"tensors of {key} {dtype}: mixed dtypes are not imported")
            if per_layer:
                offset, sizes = (i,) + (0,) * len(shape), (1,) + shape
                global_size = (len(srcs),) + shape
            else:
                offset, sizes, global_size = (0,) * len(shape), shape, shape

            def make(group=group, sizes=sizes, key=key, fn=fn):
                t = fn([weights.get(s) for s in group])
                if tuple(t.shape) != tuple(sizes[-len(t.shape):]):
                    raise HFImportError(f"{key}: tensor {group} maps to shape "
                                        f"{tuple(t.shape)}, expected {sizes}")
                return t.reshape(sizes).contiguous()

            items.append(_tensor_item(key, offset, sizes, global_size, dtype))
            producers[(key, offset)] = make
            total += first.numel() * first.element_size()
    blob = io.BytesIO()
    torch.save([common], blob)
    # megatron's current torch_dist format: the common state is the ShardedObject "common_state".
    common_fqn = "common_state/shard_0_1"
    items.append(WriteItem(index=MetadataIndex(common_fqn), type=WriteItemType.BYTE_IO))
    producers[(common_fqn, ())] = lambda: io.BytesIO(blob.getvalue())
    planner = _planner_class()(items, _Progress(producers, len(items)))
    writer = dcp.FileSystemWriter(str(path), single_file_per_rank=True, thread_count=1,
                                  sync_files=True)
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.save({}, storage_writer=writer, planner=planner, no_dist=True)
    except CheckpointException as exc:  # a producer's error, wrapped by DCP: raise it as is
        for failure in getattr(exc, "failures", {}).values():
            cause = getattr(failure, "exc", failure)
            if isinstance(cause, HFImportError):
                raise cause from None
        raise
    save_config(CheckpointingConfig("torch_dist", 1), str(path))
    return total


class _Progress(dict):
    """The producers, reporting progress as chunks are made (``gtp.progress``)."""

    def __init__(self, producers: dict, total: int):
        super().__init__(producers)
        from gtp.progress import progress

        self._bar = iter(progress(range(total), "import", total=total, unit="chunk"))

    def __getitem__(self, key) -> Callable:
        next(self._bar, None)
        return super().__getitem__(key)


def _common(kind: str, model: dict, config, hf_dir: Path, vocab: int) -> dict:
    ids = token_ids(config)
    eos = ids["eos_token_id"]
    eod = eos[0] if isinstance(eos, (list, tuple)) else eos
    data = {"vocab_size": vocab, "eod_id": eod}
    if (hf_dir / "tokenizer.json").is_file():
        data["tokenizer"] = str(hf_dir.resolve())
    return {
        "iteration": 0,
        "layout": {"world_size": 1, "tensor_model_parallel_size": 1,
                   "pipeline_model_parallel_size": 1, "gtp_remat_size": 1,
                   "data_parallel_size": 1, "virtual_pipeline_model_parallel_size": None,
                   "use_distributed_optimizer": False, "distrib_optim_sharding_type": None,
                   "megatron_core": megatron_core_version()},
        METADATA_KEY: {"gtp_format": GTP_FORMAT_LOGICAL, "tp": 1, "gtp_remat_size": 1,
                       "pad_for_alignment": 0, "megatron_core": megatron_core_version(),
                       "tensors": {}},
        "vocab_size": vocab,
        "opt_param_scheduler": {},
        "train_state": {"consumed_samples": 0, "config": {"model": model, "data": data}},
        IMPORTED_KEY: {"source": str(hf_dir.resolve()), "model_type": kind,
                       "architectures": list(getattr(config, "architectures", None) or []),
                       **ids},
    }


def import_hf(hf_dir, out_root) -> Path:
    """Write the HF model directory ``hf_dir`` as the logical checkpoint ``out_root``
    (``iter_0000000`` + tracker); see the module doc for what it holds.

    The iter dir is written beside (a hidden staging dir) and renamed into place when complete;
    an existing ``out_root`` checkpoint is refused rather than replaced.

    Returns:
        The iter dir.

    Raises:
        HFImportError: a config field or tensor that cannot be mapped (named), missing files, or
            an ``out_root`` that already holds a checkpoint.
    """
    hf_dir, out_root = Path(hf_dir), Path(out_root)
    kind, config = read_config(hf_dir)
    model = {"name": f"hf_{kind}", **_FIELDS[kind](config)}
    weights = Weights(hf_dir)  # every file inside hf_dir
    # Every size of config.json against the tensors' shapes, before anything is planned.
    check_sizes(kind, model, config.vocab_size, weights, _prefix(kind, weights.names()))
    plan = _plan(kind, model, weights)
    vocab = int(weights.meta(plan["embedding.word_embeddings.weight"][0][0][0])[0][0])
    if vocab != int(config.vocab_size):
        raise HFImportError(f"config.json vocab_size={config.vocab_size} but the embedding has "
                            f"{vocab} rows")
    if (out_root / TRACKER).exists():
        raise HFImportError(f"{out_root} already holds a checkpoint ({TRACKER}): import into a "
                            f"new dir")
    out_root.mkdir(parents=True, exist_ok=True)
    final = out_root / "iter_0000000"
    staged = out_root / ".iter_0000000.staging"
    if staged.exists():
        shutil.rmtree(staged)
    staged.mkdir()
    try:
        _write_dcp(staged, plan, weights, _common(kind, model, config, hf_dir, vocab))
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    if final.exists():
        shutil.rmtree(final)
    os.replace(staged, final)
    (out_root / TRACKER).write_text("0\n")
    return final
