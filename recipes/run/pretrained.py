"""Start a run from pretrained weights: ``checkpoint.pretrained=PATH``.

PATH is a Hugging Face model directory (``config.json`` + safetensors; imported once, before
launch, into ``<output_dir>/pretrained`` with :func:`ckpt.hf.hf_import.import_hf`) or a checkpoint
of gtp-recipes (root or ``iter_*`` dir, any layout). Only the model weights are loaded, at this
run's layout; the optimizer, the lr schedule, the iteration and the data position start fresh
(Megatron-LM's ``--pretrained-checkpoint`` / ``--no-load-optim --no-load-rng --finetune``), and
the run is a new wandb run whose config holds ``checkpoint.pretrained``.

Before launch (:func:`apply_source`, one process):

* ``checkpoint.load`` (resume) and ``checkpoint.pretrained`` together are refused;
* the ``model`` fields come from the source (the HF ``config.json`` through
  :func:`ckpt.hf.hf_import.implied_model`, or the checkpoint's run config) unless given on the
  command line; a given field among :data:`TENSOR_FIELDS` or :data:`ROUTING_FIELDS` that differs
  from the source's is refused, naming it (the source's tensors have another shape or meaning,
  or its experts were trained with another routing);
* the tokenizer: an HF dir holding a ``tokenizer.json`` becomes ``data.tokenizer`` unless given;
  a run whose tokenizer has another vocabulary size than the source is refused;
* the lr: no fine-tuning default replaces ``optim.lr`` (as Megatron-LM, whose ``--finetune``
  keeps the given ``--lr``); a fine-tune left at the preset's, meant for training a tiny model
  from scratch, gets one line saying so and how to set it (:func:`lr_note`).
"""

from __future__ import annotations

import time
from pathlib import Path

from omegaconf import open_dict

from ckpt.hf import hf_import
from ckpt.format.records import TRACKER, imported_from
from ckpt.io import CheckpointError
from recipes.config.schema import OptimConfig, given_fields, given_overrides
from recipes.config.errors import ConfigError
from recipes.families import family_name  # also gives ckpt/ the importable families

# Model fields fixed by the source's tensors (their shapes, which tensors exist, or what a
# tensor means: zero-centred norm weights).
TENSOR_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                 "kv_channels", "ffn_hidden_size", "swiglu", "normalization", "add_bias_linear",
                 "add_qkv_bias", "qk_layernorm", "attention_output_gate", "position_embedding_type",
                 "share_embeddings_and_output_weights", "num_moe_experts", "moe_ffn_hidden_size",
                 "moe_shared_expert_intermediate_size", "moe_layer_freq",
                 "moe_shared_expert_gate", "layernorm_zero_centered_gamma")
# Fields the source's experts were trained with: another value computes another model from the
# same tensors (which experts a token reaches, and with what weights).
ROUTING_FIELDS = ("moe_router_topk", "moe_router_pre_softmax", "moe_router_score_function",
                  "moe_router_enable_expert_bias", "moe_router_num_groups",
                  "moe_router_group_topk", "moe_router_topk_scaling_factor")
# Where an HF source is imported, under the job's output dir.
IMPORT_DIR = "pretrained"


def is_hf_dir(path) -> bool:
    """Whether ``path`` is a Hugging Face model directory (holds ``config.json``)."""
    return (Path(path) / "config.json").is_file()


def checkpoint_root(cfg) -> str:
    """The checkpoint the workers load weights from: the import of an HF source, or the
    source checkpoint itself."""
    src = cfg.checkpoint.pretrained
    return str(Path(cfg.output_dir) / IMPORT_DIR) if is_hf_dir(src) else str(src)


def source_config(path) -> tuple[dict, dict]:
    """``(model fields, data fields)`` of a pretrained source; the data fields are
    ``vocab_size`` and, where known, ``tokenizer`` and ``eod_id``.

    Raises:
        ConfigError: not an HF dir nor a readable checkpoint of gtp-recipes, or an HF model
            that cannot be imported (naming the config field).
    """
    if not Path(path).exists():
        raise ConfigError(f"checkpoint.pretrained={path}: no such file or directory (an HF model "
                          f"dir with config.json, or a checkpoint of gtp-recipes)")
    if is_hf_dir(path):
        try:
            _, config = hf_import.read_config(path)
            model = hf_import.implied_model(path)
        except hf_import.HFImportError as exc:
            raise ConfigError(f"checkpoint.pretrained={path}: {exc}") from None
        eos = hf_import.token_ids(config)["eos_token_id"]
        data = {"vocab_size": int(config.vocab_size),
                "eod_id": eos[0] if isinstance(eos, (list, tuple)) else eos}
        if (Path(path) / "tokenizer.json").is_file():
            data["tokenizer"] = str(Path(path).resolve())
        return model, data
    from ckpt.io import load_common

    root = Path(path)
    iteration = int(root.name[5:]) if root.name.startswith("iter_") else None
    try:
        _, common = load_common(root.parent if iteration is not None else root, iteration)
    except CheckpointError as exc:
        raise ConfigError(f"checkpoint.pretrained={path}: {exc}") from None
    saved = (common.get("train_state") or {}).get("config") or {}
    if "model" not in saved:
        raise ConfigError(f"checkpoint.pretrained={path} records no run config (model fields)")
    data = {"vocab_size": common.get("vocab_size")}
    for key in ("tokenizer", "eod_id"):
        if (saved.get("data") or {}).get(key) is not None:
            data[key] = saved["data"][key]
    return dict(saved["model"]), data


def apply_source(cfg, overrides: list[str] | None = None, requeued: bool = False) -> None:
    """Fill ``cfg.model`` (and ``data.tokenizer``) from ``checkpoint.pretrained`` in place, as
    the module doc says; a no-op without ``checkpoint.pretrained``.

    Args:
        overrides: the command line's overrides (default: :func:`given_overrides`).
        requeued: ``checkpoint.load`` was ``auto`` (resolved before this): a save it found is
            this fine-tune's own, which the worker resumes instead of loading the source.

    Raises:
        ConfigError: ``checkpoint.load`` given too; a source that cannot be read; a given model
            field that contradicts the source's tensors, or a tokenizer of another vocabulary
            size (each named with both values).
    """
    src = cfg.checkpoint.get("pretrained")
    if not src:
        return
    if cfg.checkpoint.get("load") and not requeued:
        raise ConfigError(
            f"checkpoint.load={cfg.checkpoint.load} and checkpoint.pretrained={src}: load resumes "
            f"a run (optimizer, schedule, iteration), pretrained starts a new one from weights; "
            f"give one of them")
    overrides = given_overrides() if overrides is None else overrides
    model, data = source_config(src)
    # A source without the field has no gate rows in its QKV projection: a Hugging Face model (its
    # import maps none) or a checkpoint saved before the field existed.
    model.setdefault("attention_output_gate", False)
    model["family"] = family_name(model)  # an HF source or older checkpoint names none
    given, chosen = given_fields(overrides, "model")
    if chosen:  # model=NAME gives every field of that group
        given |= set(cfg.model.keys())
    wrong = []
    with open_dict(cfg):
        for key, value in model.items():
            if key not in cfg.model and key != "name":
                continue
            if key in given:
                if key in TENSOR_FIELDS + ROUTING_FIELDS and not _same(key, cfg.model[key],
                                                                        value, model):
                    wrong.append(f"model.{key}={cfg.model[key]} (the source has {value!r})")
                continue
            cfg.model[key] = value
        if (model.get("position_embedding_type") == "learned_absolute"
                and cfg.model.seq_length != model["seq_length"]):
            wrong.append(f"model.seq_length={cfg.model.seq_length} (the source's learned "
                         f"position embedding has {model['seq_length']} rows)")
        mtp = cfg.model.get("mtp_num_layers")
        if mtp and mtp != model.get("mtp_num_layers"):
            wrong.append(f"model.mtp_num_layers={mtp} (the source has "
                         f"{model.get('mtp_num_layers') or 'none'}; MTP layers are not added to "
                         f"a pretrained model here)")
        if wrong:
            raise ConfigError(f"checkpoint.pretrained={src}: " + "; ".join(wrong)
                              + ": such a model cannot hold the source's weights or computes "
                                "another model from them (drop the override, or model=NAME: "
                                "the model comes from the source; or start from scratch)")
        given_data, _ = given_fields(overrides, "data")
        if data.get("tokenizer") and "tokenizer" not in given_data:
            cfg.data.tokenizer = data["tokenizer"]
            if "eod_id" not in given_data and data.get("eod_id") is not None:
                cfg.data.eod_id = int(data["eod_id"])
    _check_vocab(cfg, src, data.get("vocab_size"))


def lr_note(cfg, overrides: list[str] | None = None) -> str | None:
    """One line when a ``checkpoint.pretrained`` fine-tune runs at the default ``optim.lr``
    (neither the command line nor an experiment set it), naming it and how to set it; else
    None."""
    if not cfg.checkpoint.get("pretrained"):
        return None
    given, _ = given_fields(given_overrides() if overrides is None else overrides, "optim")
    if "lr" in given or float(cfg.optim.lr) != OptimConfig.lr:
        return None
    return (f"> note: this fine-tune of checkpoint.pretrained={cfg.checkpoint.pretrained} uses "
            f"the default optim.lr={cfg.optim.lr} (min_lr {cfg.optim.min_lr}), set for training "
            f"a tiny model from scratch; a fine-tune usually wants far less, e.g. "
            f"optim.lr=1e-5 optim.min_lr=1e-6")


def _same(key: str, mine, source, model: dict) -> bool:
    """Whether a given model field equals the source's, a default (None) equal to the value it
    stands for: query groups as many as heads, ``kv_channels`` hidden / heads."""
    if mine == source:
        return True
    stands_for = {"num_query_groups": model.get("num_attention_heads"),
                  "kv_channels": model["hidden_size"] // model["num_attention_heads"]
                  if model.get("hidden_size") and model.get("num_attention_heads") else None}
    return key in stands_for and {mine, source} <= {None, stands_for[key]}


def _check_vocab(cfg, src, source_vocab) -> None:
    from recipes.data import build_tokenizer

    if source_vocab is None:
        return
    try:
        vocab = build_tokenizer(cfg.data).vocab_size
    except (ValueError, OSError) as exc:
        raise ConfigError(f"data.tokenizer={cfg.data.tokenizer}: {exc}") from None
    if int(vocab) != int(source_vocab):
        raise ConfigError(
            f"checkpoint.pretrained={src} has a vocabulary of {source_vocab} tokens but this run's "
            f"tokenizer (data.tokenizer={cfg.data.tokenizer}) has {vocab}: token ids would mean "
            f"other tokens; use the source's tokenizer")


def prepare(cfg, is_rank0: bool) -> None:
    """Before launch, on the process that starts the workers (or global rank 0): import an HF
    source into ``<output_dir>/pretrained`` (kept when already there from an earlier start of
    this job). A no-op without ``checkpoint.pretrained`` or for a checkpoint source.

    Raises:
        ConfigError: the HF weights cannot be imported (naming the tensor).
    """
    src = cfg.checkpoint.get("pretrained")
    if not src or not is_hf_dir(src) or not is_rank0:
        return

    root = Path(checkpoint_root(cfg))
    if (root / TRACKER).exists():
        return
    started = time.perf_counter()
    try:
        path = hf_import.import_hf(src, root)
    except hf_import.HFImportError as exc:
        raise ConfigError(f"checkpoint.pretrained={src}: {exc}") from None
    print(f"> imported {src} into {path}: {cfg.model.num_layers} layers in "
          f"{time.perf_counter() - started:.1f} s", flush=True)


def load_weights(cfg, model, optimizer) -> dict | None:
    """Load the source's model weights into ``model`` at this run's layout (every rank calls;
    collective), then refresh the optimizer's main params from them (megatron's
    ``reload_model_params``: bf16 and distributed optimizers keep fp32 copies). Optimizer state,
    scheduler and RNG are left as built (iteration 0).

    Returns:
        The Hugging Face model the source came from (``ckpt.format.records.IMPORTED_KEY``: its dir,
        model_type and bos/eos/pad ids), which every save of the run keeps so that its export
        has the source's token ids; None for a source trained from scratch.

    Raises:
        CheckpointError: as :func:`ckpt.io.load.load_model_weights`.
    """
    import torch

    from ckpt.io.load import load_model_weights

    torch.distributed.barrier()  # the import (global rank 0, before its launch) is complete
    from ckpt.io.load import load_common

    path = load_model_weights(checkpoint_root(cfg), model,
                              verify=cfg.checkpoint.get("verify_on_load", True))
    optimizer.reload_model_params()
    return imported_from(load_common(path.parent, int(path.name[5:]))[1])


def describe(cfg) -> dict:
    """What a run's log records about its source (for the ``start`` event)."""
    src = cfg.checkpoint.get("pretrained")
    if not src:
        return {}
    return {"pretrained": str(src), "pretrained_checkpoint": checkpoint_root(cfg)}
