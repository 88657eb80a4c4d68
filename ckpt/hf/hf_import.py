"""Import a Hugging Face ``transformers`` model directory as a logical checkpoint (the mirror of
:mod:`ckpt.hf.hf_export`).

``import_hf(HF_DIR, OUT)`` reads ``config.json`` (as JSON first: its ``model_type`` must be
importable and it, and ``tokenizer_config.json``, must have no ``auto_map``; then
``transformers.AutoConfig``, local files only, ``trust_remote_code=False``)
and the safetensors weights (``model.safetensors``, or the shards a
``model.safetensors.index.json`` names) and writes ``OUT/iter_0000000`` plus
``latest_checkpointed_iteration.txt``: a torch_dist checkpoint in the logical format
(``docs/checkpoint-format.md``) that loads at any layout, with the common state of a
gtp-recipes checkpoint (iteration 0, a tp1 ``layout`` record, a ``logical-v1`` sharding
record (stored as ``gtp_layout``), the real ``vocab_size``, no optimizer state) and, in
``train_state["config"]``, the run config the model implies: a ``model`` group in the field names :mod:`ckpt.hf.hf_export` reads
(megatron ``TransformerConfig`` / ``GPTModel`` names) and a ``data`` group with ``vocab_size``,
``eod_id`` and ``tokenizer`` (the HF dir when it holds a ``tokenizer.json``).

No model is built. Each checkpoint tensor chunk is produced when the writer asks for it
(:mod:`ckpt.format.dcp_writer`: the source tensors of one layer, read and mapped), and freed
when the next is asked for, so the peak is about the largest chunk (a vocabulary tensor, or
one layer's tensor of one key), whatever the number of layers. Per-layer tensors are stored as megatron stores them, stacked along a
leading layer axis (``[num_layers, ...]``), one chunk per layer.

The mappings (inverse of :mod:`ckpt.hf.hf_export`, same megatron names) are the model families'
(:mod:`ckpt.families`): an importable ``model_type``'s family gives the ``model`` fields and a
table of its weight names (:mod:`ckpt.hf.mapping`), from which the weight plan and the sizes to
check are derived (gtp-recipes: ``recipes/families/gpt/hf_import.py`` and ``hf_table.py`` for
``GPT2LMHeadModel`` and ``LlamaForCausalLM``, ``recipes/families/moe/hf_import.py`` and
``hf_table.py`` for ``MixtralForCausalLM`` and ``Qwen3MoeForCausalLM``,
``recipes/families/hybrid/hf_qwen3_next.py`` for ``Qwen3NextForCausalLM``). Weights the
transformers class ignores on load (a Hub checkpoint's multi-token prediction layers) are left
out (``HFImport.left_out``, ``left_out_names``; the named ones counted under ``left_out`` in
the import record).

Every file read must lie inside ``HF_DIR`` (symlinks resolved) and every size of
``config.json`` is checked against the safetensors headers before anything is planned
(:mod:`ckpt.hf.hf_weights`). Everything that cannot be mapped exactly is refused with
:class:`HFImportError` naming the config field, the tensor or the index entry.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from ckpt import families
from ckpt.format import dcp_writer
from ckpt.hf import mapping
from ckpt.hf.hf_weights import HFImportError, Weights, check_sizes, confined
from ckpt.format.records import (GTP_FORMAT_LOGICAL, IMPORTED_KEY, SHARDING_RECORD_KEY, TRACKER,
                         megatron_core_version)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


JSON_LIMIT = 16 << 20  # bytes of config.json / tokenizer_config.json read at most


def _json(path: Path, what: str) -> dict:
    """``path`` parsed as a JSON object (at most :data:`JSON_LIMIT` bytes).

    Raises:
        HFImportError: too large, not JSON, or not an object (names the file).
    """
    with open(path, "rb") as f:
        text = f.read(JSON_LIMIT + 1)
    if len(text) > JSON_LIMIT:
        raise HFImportError(f"{path}: over {JSON_LIMIT} bytes, no {what}")
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise HFImportError(f"{path} is not a {what} (not JSON: {exc})") from None
    if not isinstance(value, dict):
        raise HFImportError(f"{path} is not a {what} (a JSON {type(value).__name__}, not an "
                            f"object)")
    return value


def check_no_remote_code(path, what: str = "") -> None:
    """Refuse a tokenizer dir (or a ``tokenizer.json``'s dir) whose ``tokenizer_config.json``
    has an ``auto_map``: ``transformers`` would offer to run the dir's own Python code for it
    (``trust_remote_code``), and no tokenizer this project reads needs any.

    Raises:
        HFImportError: naming the file and its ``auto_map``, after ``what`` (the setting the
            path came from) when given.
    """
    path = Path(path)
    directory = path if path.is_dir() else path.parent
    file = directory / "tokenizer_config.json"
    if not file.is_file():
        return
    auto_map = _json(file, "tokenizer config").get("auto_map")
    if auto_map is not None:
        raise HFImportError(
            f"{what + ': ' if what else ''}{file}: auto_map={auto_map!r:.200} names a tokenizer "
            f"class in the dir's own Python code, which is never run (trust_remote_code=False); "
            f"use a tokenizer the tokenizers library reads from tokenizer.json alone")


def check_config_json(hf_dir) -> str:
    """``config.json``'s ``model_type``, read as JSON and checked before ``transformers`` reads
    anything: one of :func:`ckpt.families.importable`, and no ``auto_map`` (a model or config
    class in the dir's own Python code, which ``transformers`` would offer to run); the dir's
    ``tokenizer_config.json`` must have no ``auto_map`` either (:func:`check_no_remote_code`).

    Raises:
        HFImportError: no config.json, or a refusal naming the value and the importable types.
    """
    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise HFImportError(f"{hf_dir} holds no config.json: not a Hugging Face model directory "
                            f"(only local directories work offline)")
    config = _json(confined(hf_dir, "config.json", "the config file"),
                   "Hugging Face model config")
    kind = config.get("model_type")
    supported = " or ".join(families.importable())
    if kind not in families.importable():
        what = ("is not a Hugging Face model config (no model_type)" if kind is None else
                f"has model_type={kind!r:.100}, which is not importable")
        raise HFImportError(
            f"{hf_dir / 'config.json'} {what}; give a Hugging Face model dir (config.json with "
            f"model_type {supported}, and its safetensors)")
    if "auto_map" in config:
        raise HFImportError(
            f"{hf_dir / 'config.json'}: auto_map={config['auto_map']!r:.200} names classes in the "
            f"dir's own Python code, which is never run (trust_remote_code=False); importable are "
            f"the transformers models of model_type {supported}")
    check_no_remote_code(hf_dir)
    return kind


def read_config(hf_dir) -> tuple[str, object]:
    """``(model_type, transformers config)`` of ``hf_dir`` (local files only, no code of the
    dir run: :func:`check_config_json` first, then ``trust_remote_code=False``).

    Raises:
        HFImportError: no config.json, one transformers cannot read, a model type other than
            those importable, or an ``auto_map`` (:func:`check_config_json`).
    """
    from transformers import AutoConfig

    hf_dir = Path(hf_dir)
    check_config_json(hf_dir)
    try:
        config = AutoConfig.from_pretrained(str(hf_dir), local_files_only=True,
                                            trust_remote_code=False)
    except (ValueError, OSError) as exc:  # transformers: "Unrecognized model in ...", bad JSON
        kind = "no model_type" if "model_type" in str(exc) else str(exc).split("\n")[0]
        raise HFImportError(
            f"{hf_dir / 'config.json'} is not a Hugging Face model config ({kind}); give a "
            f"Hugging Face model dir (config.json with model_type "
            f"{' or '.join(families.importable())}, and its safetensors)") from None
    families.for_model_type(config.model_type)  # refused unless a family imports it
    return config.model_type, config


def implied_model(hf_dir) -> dict:
    """The ``model`` config fields of ``hf_dir``'s model (names of ``recipes``' model group and
    :mod:`ckpt.hf.hf_export`), without reading weights.

    Raises:
        HFImportError: naming the config field that cannot be mapped.
    """
    kind, config = read_config(hf_dir)
    return {"name": f"hf_{kind}", **families.for_model_type(kind).imports.fields(config)}


def token_ids(config) -> dict:
    """``{"bos_token_id", "eos_token_id", "pad_token_id"}`` of a transformers config, as it gives
    them (int, None, or for some models a list of eos ids)."""
    return {name: getattr(config, name, None)
            for name in ("bos_token_id", "eos_token_id", "pad_token_id")}


# ------------------------------------------------------------------------------------------
# safetensors
# ------------------------------------------------------------------------------------------
def _prefix(arch: families.HFImport, names) -> str:
    """The HF tensor names' prefix (``"model."``, ``"transformer."``, or none)."""
    return next((p for p in arch.prefixes if any(n.startswith(p) for n in names)),
                arch.prefixes[0])


def _plan(arch: families.HFImport, m: dict, weights: Weights) -> dict:
    """``{megatron key: (HF names per layer or [names], per_layer, fn)}`` and every HF tensor
    accounted for (an unmapped one is refused, naming it)."""
    names = weights.names()
    plan = mapping.plan(arch.table(m), m, _prefix(arch, names))
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
                   if not n.endswith(arch.buffers)
                   and not (n == "lm_head.weight" and m["share_embeddings_and_output_weights"]))
    if extra:
        raise HFImportError(f"tensor {extra[0]!r} has no megatron counterpart ({len(extra)} "
                            f"unmapped: {extra[:5]})")
    return out


# ------------------------------------------------------------------------------------------
# writing: torch DCP, one chunk resolved at a time (ckpt.format.dcp_writer)
# ------------------------------------------------------------------------------------------
def _write_dcp(path: Path, plan: dict, weights: Weights, common: dict) -> int:
    """Write the checkpoint files into ``path``; returns the number of bytes of tensor data."""
    import torch

    chunks, total = [], 0
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

            chunks.append((key, offset, sizes, global_size, dtype, make))
            total += first.numel() * first.element_size()
    dcp_writer.write(path, chunks, common, label="import", errors=(HFImportError,))
    return total


def _common(kind: str, model: dict, config, hf_dir: Path, vocab: int, left_out: list) -> dict:
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
        SHARDING_RECORD_KEY: {"gtp_format": GTP_FORMAT_LOGICAL, "tp": 1, "gtp_remat_size": 1,
                       "pad_for_alignment": 0, "megatron_core": megatron_core_version(),
                       "tensors": {}},
        "vocab_size": vocab,
        "opt_param_scheduler": {},
        "train_state": {"consumed_samples": 0, "config": {"model": model, "data": data}},
        IMPORTED_KEY: {"source": str(hf_dir.resolve()), "model_type": kind,
                       "architectures": list(getattr(config, "architectures", None) or []),
                       **ids, **({"left_out": {"tensors": len(left_out), "first": left_out[:8]}}
                                 if left_out else {})},
    }


def _leave_out_extra_layers(arch: families.HFImport, m: dict, config, weights: Weights) -> None:
    """Drop the tensors of the layers after the decoder's that ``arch.left_out`` names (e.g.
    DeepSeek-V3's multi-token prediction layer 61, which transformers ignores on load)."""
    extra = arch.left_out(config) if arch.left_out is not None else 0
    if not extra:
        return
    first = m["num_layers"]
    layer = re.compile(re.escape(_prefix(arch, weights.names())) + arch.layer)
    weights.leave_out([n for n in weights.names() if (hit := layer.match(n))
                       and first <= int(hit.group(1)) < first + extra])


def _leave_out_named(arch: families.HFImport, weights: Weights) -> list:
    """Drop (and return, sorted) the tensors ``arch.left_out_names`` names (e.g. Qwen3-Next's
    ``mtp.*``, which transformers ignores on load)."""
    names = sorted(arch.left_out_names(weights.names())) if arch.left_out_names else []
    weights.leave_out(names)
    return names


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
    arch = families.for_model_type(kind).imports
    model = {"name": f"hf_{kind}", **arch.fields(config)}
    weights = Weights(hf_dir)  # every file inside hf_dir
    _leave_out_extra_layers(arch, model, config, weights)
    left_out = _leave_out_named(arch, weights)
    # Every size of config.json against the tensors' shapes, before anything is planned; the
    # embedding's rows among them, so config.json's vocab_size is the embedding's.
    check_sizes(arch, model, config.vocab_size, weights, _prefix(arch, weights.names()))
    plan = _plan(arch, model, weights)
    vocab = int(config.vocab_size)
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
        _write_dcp(staged, plan, weights, _common(kind, model, config, hf_dir, vocab, left_out))
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    if final.exists():
        shutil.rmtree(final)
    os.replace(staged, final)
    (out_root / TRACKER).write_text("0\n")
    return final
