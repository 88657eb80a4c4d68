"""Names of what a checkpoint records, in one light module (no torch, no megatron import).

* :data:`TRACKER` - megatron's tracker file in a checkpoint root: the latest complete iteration.
* :data:`SHARDING_RECORD_KEY` - the common-state key of the sharding record (how the GTP weights
  are stored: :mod:`ckpt.format.sharding_record`), and its format tags :data:`GTP_FORMAT_LOGICAL`
  / :data:`GTP_FORMAT_STOCK`.
* :data:`CHECKPOINT_FORMATS` - the values of ``checkpoint.format`` (old name
  ``gtp.checkpoint_layout``).
* :data:`LAYOUT_KEY` - the common-state key of the ``layout`` record: the parallel layout of the
  run that wrote the checkpoint (tensor, pipeline, GTP and data parallel sizes, optimizer);
  ``pad_for_alignment`` is not in it but in the sharding record, its one owner.
  :func:`saved_layout` joins the two.
* :func:`megatron_core_version` - the megatron-core version both records hold.

``docs/checkpoint-format.md`` describes the records.
"""

import functools
from importlib.metadata import version

from ckpt.families import given_families

TRACKER = "latest_checkpointed_iteration.txt"
# The stored name of the sharding record: checkpoints of every version hold it under this key.
SHARDING_RECORD_KEY = "gtp_layout"
GTP_FORMAT_LOGICAL = "logical-v1"
GTP_FORMAT_STOCK = "stock-0.19.2"
CHECKPOINT_FORMATS = ("logical", "stock")
LAYOUT_KEY = "layout"
PAD_KEY = "pad_for_alignment"
# The Hugging Face model a checkpoint came from (source dir, model_type, architectures, bos/eos/pad
# ids): top-level in an import; in train_state of every save of a run started from one.
IMPORTED_KEY = "hf_imported_from"


def imported_from(common: dict) -> dict | None:
    """The :data:`IMPORTED_KEY` record of a checkpoint's common state: top-level in an import,
    in ``train_state`` in a save of a run started from one; None when neither holds one."""
    return common.get(IMPORTED_KEY) or (common.get("train_state") or {}).get(IMPORTED_KEY)


def layout_defaults(rec: dict) -> dict:
    """The layout keys a record written before they existed lacks, at the value such a run had:
    no sequence parallelism, expert parallel size 1, expert tensor parallel size = the record's
    ``tensor_model_parallel_size`` (megatron's default), no expert GTP, context parallel size 1."""
    return {"sequence_parallel": False, "expert_model_parallel_size": 1,
            "expert_tensor_parallel_size": rec.get("tensor_model_parallel_size", 1),
            "expert_gtp_remat_size": 1, "context_parallel_size": 1}


def saved_layout(common) -> dict | None:
    """A checkpoint's layout with its ``pad_for_alignment``: the :data:`LAYOUT_KEY` record
    (keys it lacks at :func:`layout_defaults`) with the pad of the sharding record
    (:data:`SHARDING_RECORD_KEY`; a checkpoint without that record keeps the pad its layout
    record holds, if any).

    Args:
        common: the checkpoint's common state (a mapping).

    Returns:
        A new dict, or None when the checkpoint has no layout record.
    """
    rec = common.get(LAYOUT_KEY)
    if not isinstance(rec, dict):
        return None
    meta = common.get(SHARDING_RECORD_KEY)
    out = {**layout_defaults(rec), **rec}
    if isinstance(meta, dict) and meta.get(PAD_KEY) is not None:
        out[PAD_KEY] = int(meta[PAD_KEY])
    return out


def stored_layout(layout: dict) -> dict:
    """What :data:`LAYOUT_KEY` stores of a run's layout dict: all of it but ``pad_for_alignment``
    (stored once, in the sharding record)."""
    return {k: v for k, v in layout.items() if k != PAD_KEY}


@functools.cache
def megatron_core_version() -> str:
    """The installed megatron-core's version, as its package metadata gives it (looked up once:
    a lookup costs milliseconds, and every save records it). Not ``package_info.__version__``,
    which appends the git hash of the *current* directory."""
    return version("megatron-core")


# The saved run config's fields that size a tensor or count tensors (``model.``, and the
# vocabulary: ``data.vocab_size`` and the :data:`VOCAB_KEY` record), those every model family
# shares; each family adds its own (``ckpt.families.FamilyFormats.sizes``). Each is at most the
# largest dim a stored tensor has or the number of stored tensors (layers and experts are stacked
# along a dim or stored one key each): :func:`unbounded_size`.
MODEL_SIZE_FIELDS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "kv_channels", "mtp_num_layers", "make_vocab_size_divisible_by")
VOCAB_KEY = "vocab_size"  # the common-state record of the real vocabulary size


def _sizes(common: dict) -> list[tuple[str, object]]:
    """``(setting, value)`` of every size in ``common``'s saved run config."""
    config = (common.get("train_state") or {}).get("config") or {}
    model = config.get("model") if isinstance(config, dict) else None
    data = config.get("data") if isinstance(config, dict) else None
    model = model if isinstance(model, dict) else {}
    out = [(f"model.{f}", model.get(f)) for f in MODEL_SIZE_FIELDS]
    # Each family's sizes (without families given, none: nor is a family's model built then).
    for family in given_families():
        if family.sizes is not None:
            out += family.sizes(model)
    if model.get("position_embedding_type", "learned_absolute") == "learned_absolute":
        out.append(("model.seq_length", model.get("seq_length")))  # the position table's rows
    if isinstance(data, dict):
        out.append(("data.vocab_size", data.get("vocab_size")))
    out.append((f"the {VOCAB_KEY} record", common.get(VOCAB_KEY)))
    return out


def unbounded_size(common: dict, shapes, whose: str = "its saved run config") -> str | None:
    """The first size of a checkpoint's saved run config (``train_state.config``: the fields of
    :data:`MODEL_SIZE_FIELDS`, each model family's (``FamilyFormats.sizes``: the MoE experts, a
    hybrid model's Mamba sizes and pattern length, ...), ``seq_length`` with learned position
    embeddings, the vocabulary) that is larger than every stored
    dim and the number of stored tensors, as ``"model.num_layers=1000000000 ..."``; None when
    all are within. Checked before any parameter shape is enumerated from the config: a
    crafted or damaged size would otherwise enumerate (and build) without bound.

    Args:
        common: the checkpoint's common state.
        shapes: the global shape of every stored tensor (``.metadata``'s).
        whose: the config's name in the message.
    """
    shapes = [tuple(s) for s in shapes]
    largest = max((int(d) for s in shapes for d in s), default=0)
    bound = max(largest, len(shapes))
    for name, value in _sizes(common):
        values = value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            if isinstance(v, int) and not isinstance(v, bool) and v > bound:
                return (f"{whose} has {name}={value!r:.60}, larger than any stored "
                        f"tensor's dims (largest {largest}) and their number ({len(shapes)}): "
                        f"damaged or crafted")
    return None
