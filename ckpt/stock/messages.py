"""Pieces of the stock reader's error messages: how to pass the layout, which layouts explain a
stored shape, and compact renderings of rows, shapes and dims."""

from __future__ import annotations

import itertools
from typing import Mapping

from ckpt.stock.rowmaps import candidate_Ls, expected_stored_rows
from ckpt.stock.specs import GRID_A, GRID_G, GRID_TP, SavedLayout, TensorSpec, spec_for

LAYOUT_HELP = (
    "to read it, pass the layout that wrote it: `python -m gtp <inspect|compare|convert> CKPT "
    "--layout tp=T,gtp=G,pad=A[,hidden_size=..,ffn_hidden_size=..,swiglu=true|false,"
    "padded_vocab_size=..][,etp=..,egtp=..,moe_ffn_hidden_size=.. for routed experts]` "
    "(compare: --layout-a/--layout-b), or in Python "
    "ckpt.stock.convert(src, dst, layout={'tensor_model_parallel_size': T, 'gtp_remat_size': G, "
    "'pad_for_alignment': A, ...}) and load dst"
)


def layout_help(sub_prefixes) -> str:
    """How to read a checkpoint whose layout or dims are not recorded: :data:`LAYOUT_HELP`, or
    for a model of sub-models (``sub_prefixes``, LLaVA's) that its dims cannot be given."""
    if not sub_prefixes:
        return LAYOUT_HELP
    return (f"a model of sub-models ({', '.join(sub_prefixes)}) takes each sub-model's dims from "
            f"the run config its training recorded (train_state.config.model) or from that "
            f"sub-model's tensors, never from --layout: read the checkpoint with its recorded run "
            f"config; --layout gives only the saving layout (tp, gtp, pad, padded_vocab_size)")


def layout_text(lay: SavedLayout) -> str:
    return f"tp={lay.tp},gtp={lay.g},pad={lay.pad_for_alignment}"


def explaining_layouts(spec: TensorSpec, dims: Mapping, stored: Mapping[str, int],
                        kind: str, limit: int = 8) -> str:
    """Grid layouts under which this tensor's stored rows come out."""
    found = []
    for tp, g, a in itertools.product(GRID_TP, GRID_G, GRID_A):
        if g == 1 and a:
            continue
        lay = SavedLayout(tp, g, a)
        s = spec_for(spec.key, kind, dims, tp, spec.singleton_local_shards)
        try:
            if s.L is not None:
                ok = expected_stored_rows(s, lay, s.L) == dict(stored)
            else:
                ok = bool(candidate_Ls(s, lay, stored))
        except ValueError:
            ok = False
        if ok:
            found.append(layout_text(lay))
    if len(found) > limit:
        return ", ".join(found[:limit]) + f" ... ({len(found) - limit} more)"
    return ", ".join(found)


def safe_expected(spec, lay):
    try:
        return _fmt_rows(expected_stored_rows(spec, lay, spec.L))
    except ValueError as exc:
        return f"nothing (this layout cannot hold it: {exc})"


def _fmt_rows(rows: Mapping[str, int]) -> str:
    if list(rows) == [""]:
        return str(rows[""])
    return ", ".join(f"{v} ({k})" for k, v in rows.items())


def _fmt_shapes(shapes: Mapping[str, tuple]) -> str:
    if len(shapes) == 1:
        return str(tuple(next(iter(shapes.values()))))
    return ", ".join(f"{k} {tuple(v)}" for k, v in shapes.items())


def fmt_dims(dims: Mapping) -> str:
    keys = ("hidden_size", "ffn_hidden_size", "swiglu", "qkv_rows", "padded_vocab_size")
    return ", ".join(f"{k}={dims[k]}" for k in keys if k in dims) or "unknown"


def fmt_stored(base: str, sub: Mapping[str, tuple]) -> str:
    """The stored shape(s) of a GTP weight's key group (``sub``: {suffix: stored shape})."""
    return _fmt_shapes({base + s: v for s, v in sub.items()})


def missing_dims(kind) -> str:
    """The model dims that fix the logical size of a GTP weight of this kind."""
    return ("padded_vocab_size" if kind == "vocab" else
            "hidden_size" if kind in ("proj", "fc2", "eh_proj") else
            "ffn_hidden_size and swiglu" if kind == "fc1" else "qkv_rows")
