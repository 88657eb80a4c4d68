"""Export a checkpoint to a Hugging Face ``transformers`` model directory (config.json + safetensors).

Reads only the checkpoint: its logical model tensors (:func:`ckpt.stock.iter_logical`, one at a
time and no optimizer state, so any saving layout, in the logical or GTP's stock padded format,
gives the same full tensors) and the run config that gtp-recipes records in its common state
(``train_state["config"]``). The transformers model is built on the meta device and given the
mapped tensors (no second copy of the weights), so the peak is about the model's weights, not
the checkpoint. No process group is needed beyond the 1-process one the read starts.

The mappings are the model families' (:mod:`ckpt.families`): the family that claims the recorded
``model`` config picks the transformers class and builds its config and tensors (gtp-recipes:
``recipes/families/gpt/hf_export.py`` for ``GPT2LMHeadModel`` and ``LlamaForCausalLM``,
``recipes/families/moe/formats.py`` for ``MixtralForCausalLM`` and ``Qwen3MoeForCausalLM``,
``recipes/families/hybrid/formats.py`` for ``NemotronHForCausalLM`` and ``Qwen3NextForCausalLM``).
The padded vocabulary rows (``make_vocab_size_divisible_by``) are not exported.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ckpt import families, stock
from ckpt.families import ExportError  # noqa: F401 - raised here; callers catch it from here
from gtp.progress import progress
from ckpt.format.records import imported_from, saved_layout, unbounded_size
from ckpt.hf.tokens import eod_of_tokenizer
from ckpt.verify import stored_shapes

# The byte tokenizer of recipes (256 byte values + <eod>) when the run recorded no vocab size.
BYTE_VOCAB_SIZE = 257
BYTE_EOD_ID = 256


def _vocab(common: dict, data: dict) -> tuple[int, int | None]:
    """(unpadded vocab size, eod id) of the run's tokenizer: ``data.eod_id`` when set, else 256
    for the byte tokenizer, else the end-of-document token of a ``tokenizer.json``
    (:func:`ckpt.hf.tokens.eod_of_tokenizer`)."""
    vocab = common.get("vocab_size") or data.get("vocab_size")
    eod = data.get("eod_id")
    tokenizer = data.get("tokenizer") or "byte"
    if tokenizer == "byte":
        vocab = vocab or BYTE_VOCAB_SIZE
        eod = BYTE_EOD_ID if eod is None else eod
    elif eod is None and tokenizer_file(tokenizer) is not None:
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
    ``tokenizer_config.json`` / ``special_tokens_map.json`` / ``chat_template.jinja``; a chat
    run's ``data.chat_template`` file as ``chat_template.jinja``, the template it trained
    with); without a tokenizer_config.json
    one naming ``PreTrainedTokenizerFast`` and the bos/eos/pad tokens is written, so
    ``AutoTokenizer`` loads the dir. The byte tokenizer gets an equivalent one
    (:func:`_write_byte_tokenizer`). Returns the names written."""
    if (data.get("tokenizer") or "byte") == "byte":
        return _write_byte_tokenizer(out, ids)
    src = tokenizer_file(data.get("tokenizer"))
    if src is None:
        return []
    written = []
    template = data.get("chat_template")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "chat_template.jinja"):
        f = src if name == "tokenizer.json" else src.parent / name
        if name == "chat_template.jinja" and template:  # the one trained with, or none
            f = Path(template)
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


def chat_template_not_found(data: dict) -> str | None:
    """The run's ``data.chat_template`` when it names no file from here (a relative path is read
    from the directory ``gtp export`` runs in; the file may be gone): the export then holds no
    ``chat_template.jinja`` and :func:`ckpt.cli.cmd_export` says so. None otherwise."""
    template = data.get("chat_template")
    return str(template) if template and not Path(template).is_file() else None


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as a printable character (``tokenizers``'
    ``ByteLevel`` pre-tokenizer maps text's UTF-8 bytes to these)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = chr(256 + extra), extra + 1
    return chars


def _write_byte_tokenizer(out: Path, ids: dict) -> list[str]:
    """A ``tokenizer.json`` that is recipes' byte tokenizer (id = UTF-8 byte, ``<eod>`` = 256:
    a byte-level BPE with no merges; the text ``<eod>`` stays bytes, ``split_special_tokens``)
    and its ``tokenizer_config.json``, so ``AutoTokenizer`` encodes and decodes as training
    did."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab={c: b for b, c in _byte_chars().items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<eod>", special=True, normalized=False)])
    tok.save(str(out / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "split_special_tokens": True}
    for field in ("bos", "eos", "pad"):
        if ids.get(f"{field}_token_id") == BYTE_EOD_ID:
            cfg[f"{field}_token"] = "<eod>"
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    return ["tokenizer.json", "tokenizer_config.json"]


def _token_ids(common: dict, eod) -> dict:
    """bos/eos/pad ids: those of the HF model a checkpoint was imported from
    (:mod:`ckpt.hf.hf_import`) or its run was started from (``checkpoint.pretrained``), else the
    run's end of document for all three."""
    imported = imported_from(common) or {}
    if imported:
        return {k: imported.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return {"bos_token_id": eod, "eos_token_id": eod, "pad_token_id": eod}


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


class _ReadKeys(dict):
    """The checkpoint's model tensors, remembering which keys a family's build read."""

    def __init__(self, tensors: dict):
        super().__init__(tensors)
        self.read: set = set()

    def __getitem__(self, key):
        value = super().__getitem__(key)
        self.read.add(key)
        return value

    def get(self, key, default=None):
        return self[key] if key in self else default


# megatron's multi-token prediction layers (``mtp.layers.N.*``): left out of an export.
MTP_PREFIX = "mtp."
MTP_NOT_EXPORTED = ("multi-token prediction layers (model.mtp_num_layers): transformers' "
                    "causal-LM classes have no place for them; the exported model predicts the "
                    "next token only")


def build_state(arch, tensors: dict, model_cfg: dict, vocab: int, ids: dict, where) -> tuple:
    """(transformers config, state dict) of ``arch`` (a :class:`ckpt.families.HFArchitecture`)
    from a checkpoint's full logical model tensors, checking that its build read every one.

    Args:
        tensors: {megatron key: full logical tensor}, MTP layers left out; model_cfg: the
            recorded ``model`` config dict; vocab: the unpadded vocabulary size; ids: the
            bos/eos/pad token ids; where: the checkpoint, for messages.

    Raises:
        ExportError: a tensor the architecture needs is missing, or a tensor was not read (the
            recorded config does not describe it, so the export would drop it), both named.
    """
    tensors = _ReadKeys(tensors)
    try:
        config, state = arch.build(tensors, model_cfg, vocab, ids)
    except KeyError as exc:
        raise ExportError(f"{where} lacks tensor {exc} needed for {arch.hf_class}") from exc
    unused = sorted(set(tensors) - tensors.read)
    if unused:
        raise ExportError(f"{where} holds {len(unused)} model tensors that the recorded run "
                          f"config's {arch.hf_class} has no place for: {unused[:6]}"
                          f"{' ...' if len(unused) > 6 else ''}; the run config recorded in the "
                          f"checkpoint does not describe its weights (e.g. a shorter layer "
                          f"pattern or fewer layers than were saved)")
    return config, state


def export(ckpt: str | os.PathLike, out_dir: str | os.PathLike, layout=None,
           force: bool = False) -> Path:
    """Write ``ckpt`` (a checkpoint root or ``iter_*`` dir of gtp-recipes, any layout) as a
    transformers model directory ``out_dir`` (``config.json``, ``model.safetensors``,
    ``generation_config.json``, and ``gtp_recipes_export.json`` naming the source checkpoint,
    iteration and class), in the checkpoint's dtype (fp32 for fp32 runs). Multi-token
    prediction layers are left out and named under ``not_exported`` there; the architecture's
    notes (:attr:`ckpt.families.HFArchitecture.notes`) are recorded under ``notes``.

    Returns:
        ``out_dir`` as a Path.

    ``out_dir`` must be new or empty unless ``force`` (:func:`check_out_dir`).

    Raises:
        ExportError: ``out_dir`` not empty, no recorded run config, unknown vocabulary size, an
            architecture with no exact transformers equivalent (or not in the installed
            transformers), a tensor missing, or a model tensor the recorded config has no place
            for (named).
        ckpt.stock.StockCheckpointError: as :func:`ckpt.stock.read_logical`.
    """
    import torch
    import transformers
    from megatron.core import dist_checkpointing

    from ckpt.format import safe_metadata

    check_out_dir(out_dir, force)  # before anything is read
    # The recorded model first: a model no family exports is refused with its reason before
    # its tensors are read (a vision model's tensors are not the text layouts the reader infers).
    path = stock.resolve_iter_dir(ckpt)
    common = dist_checkpointing.load_common_state_dict(str(path))
    train_state = common.get("train_state") or {}
    run_config = train_state.get("config")
    if not run_config or "model" not in run_config:
        raise ExportError(f"{path} records no run config (train_state['config']): it "
                          f"was not written by gtp-recipes")
    # Every size it records within the stored shapes, before a size builds anything: a crafted
    # vocab_size=10**9 made transformers allocate 288 GB (issue 59 item 3).
    unbounded = unbounded_size(common, stored_shapes(safe_metadata.read_metadata(path)))
    if unbounded:
        raise ExportError(f"{path}: {unbounded}; export another checkpoint")
    model_cfg, data_cfg = run_config["model"], run_config.get("data") or {}
    arch = families.for_export(model_cfg)
    hf_cls = getattr(transformers, arch.hf_class, None)
    if hf_cls is None:
        raise ExportError(f"transformers {transformers.__version__} has no {arch.hf_class}: "
                          f"install a transformers that has it (tested: 5.25)")
    # The model tensors only (no optimizer state), read one at a time; MTP layers not read.
    analysis = stock.analyze(path, layout)
    keys = [k for k in analysis.tensors if not k.startswith("optimizer")]
    mtp = sorted(k for k in keys if k.startswith(MTP_PREFIX))
    model_keys = dict(stock.iter_logical(path, analysis=analysis,
                                         keys=[k for k in keys if not k.startswith(MTP_PREFIX)]))
    vocab, eod = _vocab(common, data_cfg)
    config, state = build_state(arch, model_keys, model_cfg, vocab, _token_ids(common, eod),
                                path)
    del model_keys  # what the state does not hold (views, or the parts of a split) goes now
    # Untied: built on the meta device and given the state's tensors (assign), no second copy of
    # the weights. Tied: an initialised model loads a copy, as classes tie (or, NemotronH, keep
    # two) at construction. In the checkpoint's dtype: load_state_dict would cast bf16 to fp32.
    assign = not config.tie_word_embeddings
    with torch.device("meta" if assign else "cpu"):
        model = hf_cls(config).to(state[arch.embedding].dtype)
    seen = set()
    for k in progress(list(state), "export", total=len(state), unit="tensor"):
        t = state[k].contiguous()  # in place, one at a time: a view's base goes with its last view
        storage = t.untyped_storage()
        if assign and (storage.nbytes() != t.nbytes or storage.data_ptr() in seen):
            t = t.clone()  # each weight its own storage, as an initialised model's parameters
        seen.add(t.untyped_storage().data_ptr())
        state[k] = t
    if config.tie_word_embeddings:  # the output layer is the embedding (one tensor in the file)
        state["lm_head.weight"] = state[arch.embedding]
    missing = sorted(set(model.state_dict()) - set(state) - {"lm_head.weight"})
    if missing:  # e.g. transformers < 5 keeps MoE experts per expert, not fused
        raise ExportError(f"transformers {transformers.__version__}'s {arch.hf_class} has "
                          f"weights this export does not write: {missing[:4]} (MoE export "
                          f"needs transformers >= 5, fused experts)")
    model.load_state_dict(state, strict=True, assign=assign)
    if config.tie_word_embeddings:
        model.tie_weights()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer_files = _copy_tokenizer(data_cfg, out, _token_ids(common, eod))
    (out / "gtp_recipes_export.json").write_text(json.dumps({
        "source": str(path), "iteration": common.get("iteration"),
        "architecture": arch.hf_class, "vocab_size": vocab,
        "saved_layout": saved_layout(common), "tokenizer_files": tokenizer_files,
        "chat_template_not_found": chat_template_not_found(data_cfg),
        "not_exported": {"weights": mtp, "why": MTP_NOT_EXPORTED} if mtp else None,
        "notes": (arch.notes(model_cfg) if arch.notes else None) or None,
    }, indent=1, default=str))
    return out
