"""Export a checkpoint to a Hugging Face ``transformers`` model directory (config.json + safetensors).

Reads only the checkpoint: its logical tensors (:func:`gtp.legacy.read_logical`, so any saving
layout, GTP's legacy padded one included, gives the same full tensors) and the run config that
gtp-recipes records in its common state (``train_state["config"]``). No model is built and no
process group is needed beyond the 1-process one the read starts.

Mappings (megatron-core's GPTModel with the local layer spec; the per-layer tensors are stacked
along dim 0 in the checkpoint, ``[num_layers, ...]``):

* **GPT** (LayerNorm, linear biases, GeLU MLP, learned absolute positions) -> ``GPT2LMHeadModel``
  with ``activation_function="gelu"`` (megatron's ``F.gelu`` is the exact erf GeLU, not GPT-2's
  tanh ``gelu_new``), ``n_inner = ffn_hidden_size``, ``layer_norm_epsilon`` 1e-5 (megatron's
  ``layernorm_epsilon``), ``tie_word_embeddings`` as ``share_embeddings_and_output_weights``.
  GPT-2's Conv1D weights are the transposed megatron weights.
* **Llama family** (RMSNorm, no linear bias, SwiGLU, RoPE) -> ``LlamaForCausalLM``, from the
  model config fields ``normalization``, ``add_bias_linear``, ``num_query_groups``,
  ``kv_channels``, ``rotary_base`` and ``layernorm_epsilon`` when the run recorded them.
* **MoE** (``num_moe_experts`` set) -> ``MixtralForCausalLM``, or ``Qwen3MoeForCausalLM`` with
  ``qk_layernorm``: :mod:`gtp.hf_export_moe` (class choice, routing, refusals).

The fused QKV weight is megatron's per-query-group layout (``SelfAttention.get_query_key_value_tensors``):
rows ``[groups, (heads_per_group + 2) * head_dim]`` with each group's queries, then its key, then
its value. SwiGLU's fc1 rows are gate then up (megatron's ``gated_linear_unit``). The padded
vocabulary rows (``make_vocab_size_divisible_by``) are not exported.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

from gtp import hf_export_llama, hf_export_moe
from gtp.hf_export_llama import ExportError, split_qkv
from gtp.records import saved_layout

# The byte tokenizer of recipes (256 byte values + <eod>) when the run recorded no vocab size.
BYTE_VOCAB_SIZE = 257
BYTE_EOD_ID = 256


def _vocab(common: dict, data: dict) -> tuple[int, int | None]:
    """(unpadded vocab size, eod id) of the run's tokenizer: ``data.eod_id`` when set, else 256
    for the byte tokenizer, else the end-of-document token of a ``tokenizer.json``
    (:func:`gtp.tokens.eod_of_tokenizer`)."""
    vocab = common.get("vocab_size") or data.get("vocab_size")
    eod = data.get("eod_id")
    tokenizer = data.get("tokenizer") or "byte"
    if tokenizer == "byte":
        vocab = vocab or BYTE_VOCAB_SIZE
        eod = BYTE_EOD_ID if eod is None else eod
    elif eod is None and tokenizer_file(tokenizer) is not None:
        from gtp.tokens import eod_of_tokenizer

        eod = eod_of_tokenizer(tokenizer_file(tokenizer))
    if vocab is None:
        raise ExportError("the checkpoint records no vocabulary size (common 'vocab_size' "
                          "or config data.vocab_size): cannot tell padding rows from tokens")
    return int(vocab), None if eod is None else int(eod)


def tokenizer_file(name) -> Path | None:
    """The ``tokenizer.json`` that ``data.tokenizer`` names (the file, or a dir holding one),
    or None (a named tokenizer, or a path that is gone)."""
    if not name or name in ("byte", "external"):
        return None
    path = Path(name)
    path = path / "tokenizer.json" if path.is_dir() else path
    return path if path.is_file() else None


def _copy_tokenizer(data: dict, out: Path, ids: dict) -> list[str]:
    """Copy the run's tokenizer files beside the model (``tokenizer.json`` and, from its dir,
    ``tokenizer_config.json`` / ``special_tokens_map.json``); without a tokenizer_config.json
    one naming ``PreTrainedTokenizerFast`` and the bos/eos/pad tokens is written, so
    ``AutoTokenizer`` loads the dir. Returns the names written ([] for the byte tokenizer)."""
    import shutil

    src = tokenizer_file(data.get("tokenizer"))
    if src is None:
        return []
    written = []
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        f = src if name == "tokenizer.json" else src.parent / name
        if f.is_file():
            shutil.copyfile(f, out / name)
            written.append(name)
    if "tokenizer_config.json" not in written:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(src))
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast"}
        for field in ("bos", "eos", "pad"):
            i = ids.get(f"{field}_token_id")
            if i is not None and tok.id_to_token(int(i)) is not None:
                cfg[f"{field}_token"] = tok.id_to_token(int(i))
        (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
        written.append("tokenizer_config.json")
    return written


def _token_ids(common: dict, eod) -> dict:
    """bos/eos/pad ids: those of the HF model a checkpoint was imported from
    (:mod:`gtp.hf_import`), else the run's end of document for all three."""
    imported = common.get("hf_imported_from") or {}
    if imported:
        return {k: imported.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return {"bos_token_id": eod, "eos_token_id": eod, "pad_token_id": eod}


def architecture(model: dict) -> str:
    """``"gpt2"``, ``"llama"``, or for an MoE model (``num_moe_experts`` set) ``"mixtral"`` or
    ``"qwen3_moe"`` (:func:`gtp.hf_export_moe.moe_architecture`), for a recorded ``model``
    config dict.

    Raises:
        ExportError: a combination no transformers class computes exactly (named).
    """
    if model.get("num_moe_experts"):
        return hf_export_moe.moe_architecture(model)
    if model.get("qk_layernorm"):
        raise ExportError("model.qk_layernorm=True: GPT2LMHeadModel and LlamaForCausalLM have no "
                          "per-head query/key norm (exportable dense models: qk_layernorm=False)")
    norm = model.get("normalization", "LayerNorm")
    bias = model.get("add_bias_linear", True)
    pos = model.get("position_embedding_type", "learned_absolute")
    swiglu = bool(model.get("swiglu", False))
    if norm == "LayerNorm" and bias and pos == "learned_absolute" and not swiglu:
        groups = model.get("num_query_groups")
        if groups not in (None, model["num_attention_heads"]):
            raise ExportError(f"model.num_query_groups={groups}: GPT2LMHeadModel has no grouped "
                              f"query attention")
        return "gpt2"
    if norm == "RMSNorm" and not bias and pos == "rope" and swiglu:
        if float(model.get("rotary_percent", 1.0)) != 1.0:
            raise ExportError(
                f"model.rotary_percent={model.get('rotary_percent', 1.0)}: only RoPE over the "
                f"whole head (rotary_percent=1.0) is exported")
        return "llama"
    raise ExportError(
        f"no transformers class computes this model exactly: normalization={norm!r}, "
        f"add_bias_linear={bias}, position_embedding_type={pos!r}, swiglu={swiglu}; exportable "
        f"are GPT (LayerNorm, bias, learned_absolute, GeLU) -> GPT2LMHeadModel and Llama "
        f"(RMSNorm, no bias, rope, SwiGLU) -> LlamaForCausalLM")


def _gpt2(t: dict, m: dict, vocab: int, ids: dict) -> tuple[Any, dict]:
    from transformers import GPT2Config

    h, heads, layers = m["hidden_size"], m["num_attention_heads"], m["num_layers"]
    shared = bool(m.get("share_embeddings_and_output_weights", False))
    config = GPT2Config(
        vocab_size=vocab, n_positions=m["seq_length"], n_embd=h, n_layer=layers, n_head=heads,
        n_inner=m["ffn_hidden_size"], activation_function="gelu",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        layer_norm_epsilon=m.get("layernorm_epsilon", 1e-5), tie_word_embeddings=shared,
        architectures=["GPT2LMHeadModel"], **ids,
    )
    d = h // heads
    L = "decoder.layers."
    sd = {
        "transformer.wte.weight": t["embedding.word_embeddings.weight"][:vocab],
        "transformer.wpe.weight": t["embedding.position_embeddings.weight"],
        "transformer.ln_f.weight": t["decoder.final_layernorm.weight"],
        "transformer.ln_f.bias": t["decoder.final_layernorm.bias"],
    }
    if not shared:
        sd["lm_head.weight"] = t["output_layer.weight"][:vocab]
    for i in range(layers):
        p = f"transformer.h.{i}."
        qkv_w = _cat(split_qkv(t[L + "self_attention.linear_qkv.weight"][i], heads, heads, d))
        qkv_b = _cat(split_qkv(t[L + "self_attention.linear_qkv.bias"][i], heads, heads, d))
        sd.update({
            p + "ln_1.weight": t[L + "self_attention.linear_qkv.layer_norm_weight"][i],
            p + "ln_1.bias": t[L + "self_attention.linear_qkv.layer_norm_bias"][i],
            p + "attn.c_attn.weight": qkv_w.t(),
            p + "attn.c_attn.bias": qkv_b,
            p + "attn.c_proj.weight": t[L + "self_attention.linear_proj.weight"][i].t(),
            p + "attn.c_proj.bias": t[L + "self_attention.linear_proj.bias"][i],
            p + "ln_2.weight": t[L + "mlp.linear_fc1.layer_norm_weight"][i],
            p + "ln_2.bias": t[L + "mlp.linear_fc1.layer_norm_bias"][i],
            p + "mlp.c_fc.weight": t[L + "mlp.linear_fc1.weight"][i].t(),
            p + "mlp.c_fc.bias": t[L + "mlp.linear_fc1.bias"][i],
            p + "mlp.c_proj.weight": t[L + "mlp.linear_fc2.weight"][i].t(),
            p + "mlp.c_proj.bias": t[L + "mlp.linear_fc2.bias"][i],
        })
    return config, sd


def _cat(parts):
    """Rows of ``parts`` one after another (dim 0)."""
    import torch

    return torch.cat(parts, dim=0)


def _moe(arch: str) -> Callable:
    def build(t: dict, m: dict, vocab: int, ids: dict):
        return hf_export_moe.build(arch, t, m, vocab, ids)
    return build


_BUILDERS: dict[str, Callable] = {"gpt2": _gpt2, "llama": hf_export_llama.build,
                                  "mixtral": _moe("mixtral"),
                                  "qwen3_moe": _moe("qwen3_moe")}
_CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
            "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
_EMBEDDING = {"gpt2": "transformer.wte.weight", "llama": "model.embed_tokens.weight",
              "mixtral": "model.embed_tokens.weight", "qwen3_moe": "model.embed_tokens.weight"}


# Weight files of a model dir: with --force, those of the model there go (transformers would
# read a stale shard or index beside the new config).
_WEIGHTS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin",
            "pytorch_model*.bin.index.json")


def check_out_dir(out_dir: str | os.PathLike, force: bool = False) -> None:
    """Refuse an ``out_dir`` that holds anything, naming what (``gtp import`` refuses a non-empty
    dir too); with ``force``, remove the weight files of the model there.

    Raises:
        ExportError: a file, or a non-empty dir without ``force``.
    """
    out = Path(out_dir)
    if not out.exists():
        return
    if not out.is_dir():
        raise ExportError(f"{out} is a file, not a directory: export into a new or empty dir")
    held = sorted(p.name for p in out.iterdir())
    if held and not force:
        raise ExportError(f"{out} is not empty: it holds {_describe(out, held)}; export into a "
                          f"new or empty dir, or pass --force to overwrite it")
    for pattern in _WEIGHTS if held else ():
        for path in out.glob(pattern):
            path.unlink()


def _describe(out: Path, held: list) -> str:
    """What a dir holds: the model its config.json names (and the export that wrote it), then
    the first names."""
    names = ", ".join(held[:6]) + (f" and {len(held) - 6} more" if len(held) > 6 else "")
    try:
        config = json.loads((out / "config.json").read_text())
        model = f"a Hugging Face model ({', '.join(config.get('architectures') or []) or '?'}"
        source = json.loads((out / "gtp_recipes_export.json").read_text()) \
            if (out / "gtp_recipes_export.json").is_file() else None
        if source:
            model += f", exported from {source.get('source')}"
        return f"{model}): {names}"
    except (OSError, ValueError, AttributeError):
        return names


def export(ckpt: str | os.PathLike, out_dir: str | os.PathLike, layout=None,
           force: bool = False) -> Path:
    """Write ``ckpt`` (a checkpoint root or ``iter_*`` dir of gtp-recipes, any layout) as a
    transformers model directory ``out_dir`` (``config.json``, ``model.safetensors``,
    ``generation_config.json``, and ``gtp_recipes_export.json`` naming the source checkpoint,
    iteration and class), in the checkpoint's dtype (fp32 for fp32 runs).

    Returns:
        ``out_dir`` as a Path.

    ``out_dir`` must be new or empty unless ``force`` (:func:`check_out_dir`).

    Raises:
        ExportError: ``out_dir`` not empty, no recorded run config, unknown vocabulary size, an
            architecture with no exact transformers equivalent, or a tensor missing (named).
        gtp.legacy.LegacyCheckpointError: as :func:`gtp.legacy.read_logical`.
    """
    import torch
    import transformers
    from megatron.core import dist_checkpointing

    from gtp import legacy
    from gtp.progress import progress

    check_out_dir(out_dir, force)  # before anything is read
    analysis, tensors = legacy.read_logical(ckpt, layout)
    common = dist_checkpointing.load_common_state_dict(str(analysis.path))
    train_state = common.get("train_state") or {}
    run_config = train_state.get("config")
    if not run_config or "model" not in run_config:
        raise ExportError(f"{analysis.path} records no run config (train_state['config']): it "
                          f"was not written by gtp-recipes")
    model_cfg, data_cfg = run_config["model"], run_config.get("data") or {}
    arch = architecture(model_cfg)
    vocab, eod = _vocab(common, data_cfg)
    model_keys = {k: v for k, v in tensors.items() if not k.startswith("optimizer")
                  and isinstance(v, torch.Tensor)}
    try:
        config, state = _BUILDERS[arch](model_keys, model_cfg, vocab, _token_ids(common, eod))
    except KeyError as exc:
        raise ExportError(f"{analysis.path} lacks tensor {exc} needed for {_CLASSES[arch]}") from exc
    hf_cls = getattr(transformers, _CLASSES[arch])
    # In the checkpoint's dtype: load_state_dict would cast a bf16 run's weights to fp32.
    model = hf_cls(config).to(state[_EMBEDDING[arch]].dtype)
    state = {k: v.contiguous()
             for k, v in progress(state.items(), "export", total=len(state), unit="tensor")}
    if config.tie_word_embeddings:  # the output layer is the embedding (one tensor in the file)
        state["lm_head.weight"] = state[_EMBEDDING[arch]]
    missing = sorted(set(model.state_dict()) - set(state) - {"lm_head.weight"})
    if missing:  # e.g. transformers < 5 keeps MoE experts per expert, not fused
        raise ExportError(f"transformers {transformers.__version__}'s {_CLASSES[arch]} has "
                          f"weights this export does not write: {missing[:4]} (MoE export "
                          f"needs transformers >= 5, fused experts)")
    model.load_state_dict(state, strict=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer_files = _copy_tokenizer(data_cfg, out, _token_ids(common, eod))
    (out / "gtp_recipes_export.json").write_text(json.dumps({
        "source": str(analysis.path), "iteration": common.get("iteration"),
        "architecture": _CLASSES[arch], "vocab_size": vocab,
        "saved_layout": saved_layout(common), "tokenizer_files": tokenizer_files,
    }, indent=1, default=str))
    return out
