"""Resolve how a checkpoint was written and what each of its tensors is logically (:func:`analyze`).

Where the saving layout comes from, first match wins per item:

1. a layout the caller passes (``layout=``: a mapping, see :data:`ckpt.stock.LAYOUT_KEYS`);
2. the checkpoint's ``gtp_layout`` record (:mod:`ckpt.format.logical_format`'s per-tensor metadata);
3. the checkpoint's ``layout`` record and its saved run config (``train_state.config``:
   ``model.*`` dims, the vocabulary from ``data.*``), as every gtp-recipes checkpoint has;
4. dims implied by tensors GTP never pads (biases, norms, ``in_features``), and, when ``tp`` /
   ``gtp_remat_size`` / ``pad_for_alignment`` are unknown, every layout of a small grid that
   explains every stored shape. If those layouts do not all read the same rows, or a tensor's
   logical size stays open, :class:`StockCheckpointError` names the tensor, its stored shape and
   the layouts that could explain it, and says how to pass the layout.

A layout that does not explain a stored shape is refused the same way: nothing is ever read
under a guessed layout.

A model of sub-models (LLaVA: :attr:`ckpt.families.FamilyFormats.sub_models`) has its model
dims per key prefix, from 3. (through the family's ``sub_model_dims``) and 4. (that prefix's
tensors), and one layout (:attr:`ckpt.stock.specs.StoredCheckpoint.sub_dims`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional

from ckpt.families import sub_model_dims
from ckpt.format.safe_objects import install
from ckpt.stock.format import SHARDING_RECORD_KEY, TRACKER, StockCheckpointError, checkpoint_format
from ckpt.stock.messages import layout_help
from ckpt.stock.specs import (MODEL_DIMS, Analysis, SavedLayout, StoredCheckpoint, TensorInfo,
                             TensorSpec, config_layout, dims_problems, get_path, gtp_kind,
                             infer_dims, is_plain, parse_layout, split_key, strip_suffix)
from ckpt.stock.saving_layout import analyze_stock


def resolve_iter_dir(path) -> Path:
    """A checkpoint iter dir from a checkpoint root (its tracker's iteration) or an iter dir.

    Raises:
        StockCheckpointError: neither (names what is missing).
    """
    path = Path(path)
    if (path / TRACKER).is_file():
        text = (path / TRACKER).read_text().strip()
        try:
            it = int(text)
        except ValueError:
            raise StockCheckpointError(
                f"{path / TRACKER}: not an iteration number: {text!r}") from None
        path = path / f"iter_{it:07d}"
    if not (path / "metadata.json").is_file():
        raise StockCheckpointError(
            f"{path}: not a megatron torch_dist checkpoint (no metadata.json); pass a checkpoint "
            f"root holding {TRACKER} or an iter_XXXXXXX dir")
    return path


def _stored_shapes(path: Path) -> dict:
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_tensors_metadata(str(path))
    return {k: tuple(v.global_shape) for k, v in meta.items()}


def analyze(ckpt, layout=None, common: Optional[Mapping] = None) -> Analysis:
    """Resolve how ``ckpt`` was written and what each of its tensors is logically.

    Reads only the common state and the tensor metadata (no tensor data). Works in one process
    without ``torch.distributed``.

    Args:
        ckpt: a checkpoint root (with ``latest_checkpointed_iteration.txt``) or an iter dir.
        layout: the saving layout, overriding what the checkpoint records (see
            :func:`parse_layout`); needed only for checkpoints that record too little.
        common: the checkpoint's common state when already loaded (read from ``ckpt`` otherwise).

    Returns:
        An :class:`Analysis`; ``.stock`` is True when some GTP weight's stored rows differ from
        its logical rows.

    Raises:
        StockCheckpointError: the layout is unknown and the stored shapes leave a tensor
            ambiguous, or the given/recorded layout does not explain a stored shape (the message
            names the tensor, its stored shape and the layouts that could explain it).
    """
    install()  # no pickle of the checkpoint (.metadata, objects) runs code, whatever reads it
    ck = _read_checkpoint(ckpt, layout, common)
    if ck.format == "logical":
        return _analyze_logical(ck)
    return analyze_stock(ck)


def is_stock(ckpt, layout=None) -> bool:
    """Whether ``ckpt`` holds GTP weights in stock 0.19.2's padded format (see :func:`analyze`)."""
    return analyze(ckpt, layout).stock


# --------------------------------------------------------------------------------------------
# What the checkpoint records
# --------------------------------------------------------------------------------------------
def _read_checkpoint(ckpt, layout, common: Optional[Mapping]) -> StoredCheckpoint:
    """Common state, stored shapes, layout items by source, model dims and GTP weights.

    Raises:
        StockCheckpointError: the given/recorded dims contradict the stored tensors.
    """
    from megatron.core import dist_checkpointing

    path = resolve_iter_dir(ckpt)
    if common is None:
        common = dist_checkpointing.load_common_state_dict(str(path))
    common = dict(common)
    shapes = _stored_shapes(path)
    fmt = checkpoint_format(common)
    user = parse_layout(layout)
    meta = common.get(SHARDING_RECORD_KEY) or {}

    items, sources = _layout_items(common, user, meta)
    try:
        sub = sub_model_dims((k for k in shapes if not split_key(k)[0]),
                             get_path(common, "train_state", "config", "model"))
    except (TypeError, ValueError) as exc:
        raise StockCheckpointError(f"{path}: the recorded model config: {exc}") from None
    given = sorted(k for k in user if k in MODEL_DIMS)
    if sub and given:
        raise StockCheckpointError(
            f"{path}: a model of sub-models ({', '.join(sub)}) with model dims given by the "
            f"caller ({given}): each sub-model has dims of its own, read from the recorded run "
            f"config (train_state.config.model) or from its tensors; give only the layout "
            f"(tp, gtp, pad, vocab)")
    inferred = infer_dims(_under(shapes, sub, None))
    problems = dims_problems(items, inferred, "recorded" if not user else "given")
    # Each sub-model: its recorded dims over those its tensors imply; the layout is shared.
    shared = {k: v for k, v in items.items() if k not in MODEL_DIMS}
    sub_dims = {}
    for prefix, recorded in sub.items():
        implied = infer_dims(_under(shapes, sub, prefix))
        problems += [f"{prefix}*: {p}" for p in dims_problems(recorded, implied, "recorded")]
        sub_dims[prefix] = {**implied, **recorded, **shared}
    if problems:
        raise StockCheckpointError(
            f"{path}: the layout does not match the stored tensors: {'; '.join(problems)}; "
            + layout_help(sub))
    dims = {**inferred, **items}
    source = " + ".join(sources) if sources else "nothing recorded"
    gtp_bases, unknown = _gtp_weights(shapes, meta.get("tensors") or {})
    return StoredCheckpoint(path, common, fmt, shapes, meta, items, source, dims, gtp_bases,
                            unknown, sub_dims)


def _under(shapes: Mapping[str, tuple], prefixes, prefix: Optional[str]) -> dict:
    """The stored shapes of the keys under the sub-model ``prefix`` (None: of the keys under
    none of ``prefixes``)."""
    def owner(key):
        model_key = split_key(key)[1]
        return next((p for p in prefixes if model_key.startswith(p)), None)
    return {k: v for k, v in shapes.items() if owner(k) == prefix}


def _layout_items(common: dict, user: dict, meta: Mapping) -> tuple[dict, list]:
    """Layout items (first source wins per item) and the names of their sources."""
    items: dict = {}
    sources = []
    if user:
        items.update(user)
        sources.append("given by the caller")
    if meta:
        for src_key, k in (("tp", "tensor_model_parallel_size"), ("gtp_remat_size", "gtp_remat_size"),
                           ("expert_tensor_parallel_size", "expert_tensor_parallel_size"),
                           ("expert_gtp_remat_size", "expert_gtp_remat_size"),
                           ("pad_for_alignment", "pad_for_alignment")):
            if meta.get(src_key) is None:
                continue
            if k == "pad_for_alignment" and max(items.get("gtp_remat_size", 1),
                                                items.get("expert_gtp_remat_size", 1)) == 1:
                # records before the expert keys wrote pad 0 when only expert GTP was on
                continue
            items.setdefault(k, int(meta[src_key]))
        sources.append("sharding record")
    cfg_items, cfg_src = config_layout(common)
    if cfg_items:
        for k, v in cfg_items.items():
            items.setdefault(k, v)
        sources.append(cfg_src)
    return items, sources


def _gtp_weights(shapes: Mapping[str, tuple], meta_tensors: Mapping) -> tuple[dict, list]:
    """GTP keys (model keys; optimizer keys follow their model key): ``{base key: {suffix:
    stored shape}}``, and the model keys not known to be GTP-sharded or not."""
    model_keys = sorted(k for k in shapes if not split_key(k)[0])
    gtp_bases: dict[str, dict] = {}  # base key -> {suffix: stored shape}
    unknown = []
    for key in model_keys:
        base, suffix = strip_suffix(key)
        if base in meta_tensors or gtp_kind(key):
            gtp_bases.setdefault(base, {})[suffix] = shapes[key]
        elif not is_plain(key):
            unknown.append(key)
    return gtp_bases, unknown


# --------------------------------------------------------------------------------------------
# Logical checkpoints
# --------------------------------------------------------------------------------------------
def _analyze_logical(ck: StoredCheckpoint) -> Analysis:
    """A logical checkpoint: every tensor as stored, GTP weights tagged with their recorded spec."""
    items, shapes = ck.items, ck.shapes
    lay = None
    if all(k in items for k in ("tensor_model_parallel_size", "gtp_remat_size")):
        lay = SavedLayout(items["tensor_model_parallel_size"], items["gtp_remat_size"],
                          items.get("pad_for_alignment", 0))
    infos = {k: TensorInfo(k, shapes[k], shapes[k]) for k in shapes}
    for base, sub in ck.gtp_bases.items():
        rec = ck.meta_tensors.get(base)
        for suffix in sub:
            spec = TensorSpec(base, rec["L"], rec["tp_axis"], rec.get("gated", False),
                              rec.get("singleton_local_shards", False)) if rec else None
            for k in shapes:
                if split_key(k)[1] == base + suffix:
                    infos[k].gtp, infos[k].base = spec, base
    return Analysis(ck.path, ck.common, ck.format, lay, ck.source, False, infos, [])
