"""Read GTP checkpoints written in megatron-core 0.19.2's padded layout ("legacy"/"stock").

Stock 0.19.2 writes every GTP-sharded weight in a padded, TP-shifted layout (spec
``shared/design/gtp-checkpointing.md`` section 3; :func:`gtp.layout.stock_0192_offsets`): a
column-parallel weight of TP-local logical dim 0 ``L`` is stored with dim 0 ``tp*(L+pad)`` and
every TP rank's rows ``tp_rank*pad`` late; a row-parallel one with ``L+pad`` rows (zero tail); a
gated (SwiGLU) fc1 has its gate/up halves mislabelled whenever ``g > 1``. Upstream can read such a
file only into the exact layout that wrote it. This module reconstructs the **logical** tensors
(what the non-GTP model at the same TP writes; spec section 4) from the plain stored tensors with
the layout math of :mod:`gtp.layout`, so a legacy file loads at any layout.

Entry points:

* :func:`checkpoint_format` - "logical" or "stock" from the common state (the one place that
  knows the format tag written by :mod:`gtp.checkpoint`).
* :func:`analyze` - resolve the saving layout and, for every tensor, its logical shape and
  whether its stored layout differs (no tensor data is read).
* :func:`read_logical` - the logical tensors of any checkpoint (legacy ones reconstructed).
* :func:`convert` - write a legacy checkpoint as a normal logical one (non-GTP layout record).
* :func:`prepare_load` - the hook of ``recipes.checkpoint.load_checkpoint``: converts a legacy
  checkpoint once into ``<root>/gtp_converted/`` and returns the directory to load.

Where the saving layout comes from, first match wins per item:

1. a layout the caller passes (``layout=``: a mapping, see :data:`LAYOUT_KEYS`);
2. the checkpoint's ``gtp_layout`` record (:mod:`gtp.checkpoint`'s per-tensor metadata);
3. the checkpoint's ``layout`` record and its saved run config (``train_state.config``:
   ``model.*`` dims, the vocabulary from ``data.*``), as every gtp-recipes checkpoint has;
4. dims implied by tensors GTP never pads (biases, norms, ``in_features``), and, when ``tp`` /
   ``gtp_remat_size`` / ``pad_for_alignment`` are unknown, every layout of a small grid that
   explains every stored shape. If those layouts do not all read the same rows, or a tensor's
   logical size stays open, :class:`LegacyCheckpointError` names the tensor, its stored shape and
   the layouts that could explain it, and says how to pass the layout.

A layout that does not explain a stored shape is refused the same way: nothing is ever read
under a guessed layout.

Memory: :func:`read_logical` holds the whole checkpoint (stored and logical copies of the GTP
tensors) in the memory of one process; :func:`convert` and :func:`prepare_load` do that on
rank 0 only.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

# gtp/checkpoint.py's common-state key and format tags (one source of truth).
from gtp.checkpoint import GTP_FORMAT_LOGICAL as FORMAT_LOGICAL
from gtp.checkpoint import GTP_FORMAT_STOCK as FORMAT_STOCK
from gtp.checkpoint import METADATA_KEY
from gtp.layout import TensorLayout, logical_pieces, stock_0192_offsets

__all__ = [
    "CONVERTED_DIR",
    "LAYOUT_KEYS",
    "Analysis",
    "LegacyCheckpointError",
    "SavedLayout",
    "TensorInfo",
    "analyze",
    "checkpoint_format",
    "convert",
    "is_legacy",
    "parse_layout",
    "prepare_load",
    "read_logical",
    "resolve_iter_dir",
]

# Common-state key of a converted checkpoint: where it came from.
CONVERTED_KEY = "gtp_converted_from"
# Cache folder (under the checkpoint root) that prepare_load converts legacy checkpoints into.
CONVERTED_DIR = "gtp_converted"
TRACKER = "latest_checkpointed_iteration.txt"
CONVERTER_VERSION = 1

# What a user may pass as ``layout`` (aliases in parentheses):
#   tensor_model_parallel_size (tp), gtp_remat_size (gtp, g), pad_for_alignment (pad, a),
#   hidden_size, ffn_hidden_size, swiglu, num_attention_heads, num_query_groups, kv_channels,
#   qkv_rows (global out_features of linear_qkv), padded_vocab_size (vocab).
LAYOUT_KEYS = (
    "tensor_model_parallel_size", "gtp_remat_size", "pad_for_alignment", "hidden_size",
    "ffn_hidden_size", "swiglu", "num_attention_heads", "num_query_groups", "kv_channels",
    "qkv_rows", "padded_vocab_size",
)
_ALIASES = {"tp": "tensor_model_parallel_size", "gtp": "gtp_remat_size", "g": "gtp_remat_size",
            "pad": "pad_for_alignment", "a": "pad_for_alignment", "vocab": "padded_vocab_size"}
_LAYOUT_HELP = (
    "to read it, pass the layout that wrote it: `python -m gtp <inspect|compare|convert> CKPT "
    "--layout tp=T,gtp=G,pad=A[,hidden_size=..,ffn_hidden_size=..,swiglu=true|false,"
    "padded_vocab_size=..]` (compare: --layout-a/--layout-b), or in Python "
    "gtp.legacy.convert(src, dst, layout={'tensor_model_parallel_size': T, 'gtp_remat_size': G, "
    "'pad_for_alignment': A, ...}) and load dst"
)

# Grid searched when the checkpoint records no layout.
_GRID_TP = (1, 2, 4, 8, 16)
_GRID_G = (1, 2, 4, 8)
_GRID_A = (0, 1, 2, 4, 8, 16, 32, 64, 128)

_OPT_PREFIX = re.compile(r"^(optimizer\.state\.[^.]+\.)(.+)$")
# GTP-sharded weights of megatron's GPT model (local spec): kind per key pattern.
_GTP_PATTERNS = (
    (re.compile(r"(^|\.)embedding\.word_embeddings\.weight$"), "vocab"),
    (re.compile(r"(^|\.)output_layer\.weight$"), "vocab"),
    (re.compile(r"(^|\.)linear_qkv\.weight$"), "qkv"),
    (re.compile(r"(^|\.)linear_proj\.weight$"), "proj"),
    (re.compile(r"(^|\.)linear_fc1\.weight(_w|_v)?$"), "fc1"),
    (re.compile(r"(^|\.)linear_fc2\.weight$"), "fc2"),
)
# Tensors GTP never shards (megatron wraps only Column/RowParallelLinear and
# VocabParallelEmbedding weights).
_PLAIN = re.compile(r"(\.bias|norm_weight|norm_bias|norm\.weight|position_embeddings\.weight)$")


class LegacyCheckpointError(ValueError):
    """A checkpoint whose tensors cannot be read exactly; the message says what is ambiguous or
    inconsistent and how to pass the layout."""


# --------------------------------------------------------------------------------------------
# Format
# --------------------------------------------------------------------------------------------
def checkpoint_format(common: Mapping) -> str:
    """``"logical"`` or ``"stock"``: how the checkpoint's GTP weights are laid out on disk.

    Reads the ``gtp_layout`` record that :mod:`gtp.checkpoint` adds to the common state
    (``gtp_format``: ``"logical-v1"`` or ``"stock-0.19.2"``). A checkpoint without it predates that
    record (or was written by megatron itself): "stock". Whether a stock checkpoint is actually
    padded depends on its GTP degree (:func:`is_legacy`).

    Raises:
        LegacyCheckpointError: an unknown ``gtp_format`` tag.
    """
    meta = common.get(METADATA_KEY)
    if not meta:
        return "stock"
    tag = meta.get("gtp_format")
    if tag == FORMAT_LOGICAL:
        return "logical"
    if tag == FORMAT_STOCK:
        return "stock"
    raise LegacyCheckpointError(
        f"unknown {METADATA_KEY}.gtp_format {tag!r} (known: {FORMAT_LOGICAL!r}, {FORMAT_STOCK!r}); "
        "this checkpoint was written by a newer gtp/"
    )


# --------------------------------------------------------------------------------------------
# Layout resolution
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorSpec:
    """One GTP weight's checkpoint key (without megatron's ``_w``/``_v`` suffix) and its shape."""

    key: str
    L: Optional[int]  # logical TP-local dim 0 (None: unknown)
    tp_axis: int
    gated: bool = False
    singleton_local_shards: bool = False
    kind: str = ""


@dataclass(frozen=True)
class SavedLayout:
    """The parallel layout a checkpoint was written at (only what the stored layout depends on)."""

    tp: int
    g: int
    pad_for_alignment: int

    def describe(self) -> str:
        if self.g == 1:
            return f"tp{self.tp} (no GTP)"
        return f"tp{self.tp} x gtp{self.g} (pad_for_alignment={self.pad_for_alignment})"


@dataclass
class TensorInfo:
    """What :func:`analyze` says about one stored tensor.

    Attributes:
        key: checkpoint key as stored (optimizer tensors: ``optimizer.state.<name>.<key>``).
        stored_shape: global shape on disk.
        logical_shape: shape of the logical tensor (what a non-GTP model at any TP reads).
        gtp: the key's GTP spec, None for tensors GTP never shards.
        legacy: the stored rows differ from the logical ones (padding and/or shifted rows).
        out_key: key of the logical tensor (differs from ``key`` only for singleton gated halves,
            which keep their suffix).
    """

    key: str
    stored_shape: tuple
    logical_shape: tuple
    gtp: Optional[TensorSpec] = None
    legacy: bool = False
    rowmap: Any = field(default=None, repr=False)  # {out_suffix: [(src_suffix, src_row)...]}
    base: str = ""


@dataclass
class Analysis:
    """Result of :func:`analyze`: the checkpoint's format, saving layout and tensors."""

    path: Path
    common: dict
    format: str  # "logical" | "stock"
    layout: Optional[SavedLayout]
    layout_source: str
    legacy: bool
    tensors: dict  # stored key -> TensorInfo
    notes: list = field(default_factory=list)

    def describe(self) -> str:
        lay = self.layout.describe() if self.layout else "unknown"
        kind = ("legacy padded GTP layout (megatron-core 0.19.2)" if self.legacy else
                "logical layout" if self.format == "logical" else
                "stock layout, nothing padded or shifted")
        return f"{kind}; saved at {lay} [{self.layout_source}]"


def parse_layout(text_or_mapping) -> dict:
    """A user layout as a dict of :data:`LAYOUT_KEYS` (aliases accepted).

    Accepts a mapping or a string ``"tp=2,gtp=2,pad=16,swiglu=true"``.

    Raises:
        LegacyCheckpointError: unknown key or a value that is not an int / bool.
    """
    if text_or_mapping is None:
        return {}
    if isinstance(text_or_mapping, str):
        items = []
        for part in filter(None, (p.strip() for p in text_or_mapping.split(","))):
            if "=" not in part:
                raise LegacyCheckpointError(f"layout item {part!r}: expected key=value")
            k, v = part.split("=", 1)
            items.append((k.strip(), v.strip()))
    else:
        items = list(dict(text_or_mapping).items())
    out = {}
    for k, v in items:
        name = _ALIASES.get(k, k)
        if name not in LAYOUT_KEYS:
            raise LegacyCheckpointError(
                f"unknown layout key {k!r}; valid: {list(LAYOUT_KEYS)} (aliases {_ALIASES})")
        if name == "swiglu":
            if isinstance(v, str):
                if v.lower() not in ("true", "false", "1", "0"):
                    raise LegacyCheckpointError(f"layout swiglu={v!r}: expected true or false")
                v = v.lower() in ("true", "1")
            out[name] = bool(v)
        else:
            try:
                out[name] = int(v)
            except (TypeError, ValueError):
                raise LegacyCheckpointError(f"layout {k}={v!r}: expected an integer") from None
            if out[name] < (0 if name == "pad_for_alignment" else 1):
                raise LegacyCheckpointError(f"layout {k}={v!r} out of range")
    return out


def _get(d, *path):
    for p in path:
        if not isinstance(d, Mapping) or p not in d:
            return None
        d = d[p]
    return d


def _vocab_from_config(cfg: Mapping, tp: int) -> Optional[int]:
    """Padded vocab rows of a gtp-recipes run config (recipes.model.padded_vocab_size)."""
    try:
        from omegaconf import OmegaConf

        from recipes.data import build_tokenizer
        from recipes.model import padded_vocab_size

        vocab = build_tokenizer(OmegaConf.create(dict(cfg["data"]))).vocab_size
        return padded_vocab_size(vocab, int(cfg["model"]["make_vocab_size_divisible_by"]), tp)
    except Exception:  # noqa: BLE001 - not a gtp-recipes config: the vocab stays unknown
        return None


def _config_layout(common: Mapping) -> tuple[dict, str]:
    """Layout items recorded by gtp-recipes (``layout`` record, run config)."""
    out, src = {}, []
    rec = common.get("layout")
    if isinstance(rec, Mapping):
        for k in ("tensor_model_parallel_size", "gtp_remat_size", "pad_for_alignment"):
            if rec.get(k) is not None:
                out[k] = int(rec[k])
        if out:
            src.append("layout record")
    cfg = _get(common, "train_state", "config")
    if isinstance(cfg, Mapping):
        m = cfg.get("model") or {}
        for k in ("hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                  "kv_channels"):
            if m.get(k) is not None:
                out.setdefault(k, int(m[k]))
        if m.get("swiglu") is not None:
            out.setdefault("swiglu", bool(m["swiglu"]))
        par, gtp_cfg = cfg.get("parallelism") or {}, cfg.get("gtp") or {}
        if par.get("tensor_model_parallel_size") is not None:
            out.setdefault("tensor_model_parallel_size", int(par["tensor_model_parallel_size"]))
        if gtp_cfg.get("gtp_remat_size") is not None:
            out.setdefault("gtp_remat_size", int(gtp_cfg["gtp_remat_size"]))
        if "pad_for_alignment" not in out and out.get("gtp_remat_size", 1) > 1:
            try:
                from gtp.alignment import resolve_pad_for_alignment

                out["pad_for_alignment"] = resolve_pad_for_alignment(
                    gtp_cfg.get("pad_for_alignment"), gtp_cfg.get("quantization", "none"))
            except Exception:  # noqa: BLE001
                pass
        if "tensor_model_parallel_size" in out:
            vocab = _vocab_from_config(cfg, out["tensor_model_parallel_size"])
            if vocab is not None:
                out["padded_vocab_size"] = vocab
        src.append("run config")
    return out, " + ".join(src)


def _kind(key: str) -> Optional[str]:
    for pattern, kind in _GTP_PATTERNS:
        if pattern.search(key):
            return kind
    return None


def _split_key(key: str) -> tuple[str, str]:
    """(optimizer prefix or "", model key)."""
    m = _OPT_PREFIX.match(key)
    return (m.group(1), m.group(2)) if m else ("", key)


def _strip_suffix(model_key: str) -> tuple[str, str]:
    for suf in ("_w", "_v"):
        if model_key.endswith(".weight" + suf):
            return model_key[: -len(suf)], suf
    return model_key, ""


def _infer_dims(shapes: Mapping[str, tuple]) -> dict:
    """Model dims implied by tensors GTP never pads (biases, norms, in_features)."""
    out: dict = {}
    model = {k: v for k, v in shapes.items() if not _split_key(k)[0]}
    for key, shape in model.items():
        kind = _kind(key)
        if kind == "qkv" and len(shape) >= 2:
            out.setdefault("hidden_size", shape[-1])
        elif kind == "fc2" and len(shape) >= 2:
            out.setdefault("ffn_hidden_size", shape[-1])
        elif key.endswith("linear_qkv.bias"):
            out.setdefault("qkv_rows", shape[-1])
        elif key.endswith("linear_fc1.bias"):
            out["_fc1_bias_rows"] = shape[-1]
        elif key.endswith("final_layernorm.weight"):
            out.setdefault("hidden_size", shape[-1])
    ffn, fc1b = out.get("ffn_hidden_size"), out.pop("_fc1_bias_rows", None)
    if ffn and fc1b in (ffn, 2 * ffn):
        out["swiglu"] = fc1b == 2 * ffn
    return out


def _dims_problems(given: Mapping, inferred: Mapping, source: str) -> list[str]:
    return [
        f"{k}={given[k]} ({source}) but the stored tensors imply {k}={inferred[k]}"
        for k in ("hidden_size", "ffn_hidden_size", "qkv_rows", "swiglu")
        if k in given and k in inferred and given[k] != inferred[k]
    ]


def _logical_rows_global(kind: str, dims: Mapping) -> Optional[int]:
    """Global logical dim 0 (all TP ranks) of a GTP weight kind, from model dims."""
    if kind == "vocab":
        return dims.get("padded_vocab_size")
    if kind in ("proj", "fc2"):
        return dims.get("hidden_size")
    if kind == "fc1":
        ffn = dims.get("ffn_hidden_size")
        if ffn is None or dims.get("swiglu") is None:
            return None
        return ffn * (2 if dims["swiglu"] else 1)
    if kind == "qkv":
        if dims.get("qkv_rows"):
            return dims["qkv_rows"]
        hidden, heads = dims.get("hidden_size"), dims.get("num_attention_heads")
        if hidden is None:
            return None
        groups = dims.get("num_query_groups")
        if groups is None or heads is None:
            return 3 * hidden if groups is None else None
        kv = dims.get("kv_channels") or hidden // heads
        return (heads + 2 * groups) * kv
    return None


def _spec_for(base: str, kind: str, dims: Mapping, tp: int, singleton: bool) -> TensorSpec:
    rows = _logical_rows_global(kind, dims)
    tp_axis = 1 if kind in ("proj", "fc2") else 0
    L = None
    if rows is not None:
        if tp_axis == 1:
            L = rows
        elif rows % tp == 0:
            L = rows // tp
    gated = kind == "fc1" and bool(dims.get("swiglu"))
    return TensorSpec(base, L, tp_axis, gated, singleton and gated, kind)


# --------------------------------------------------------------------------------------------
# Row maps: logical row -> stored row
# --------------------------------------------------------------------------------------------
def _row_map(spec: TensorSpec, lay: SavedLayout, L: Optional[int] = None):
    """``({out_suffix: [(src_suffix, src_row) per logical row]}, {src_suffix: stored rows})``.

    Raises:
        ValueError: the layout cannot hold this L (e.g. pad 0 with L % g != 0, odd gated shard).
    """
    L = spec.L if L is None else L
    tp_ranks = range(lay.tp) if spec.tp_axis == 0 else (0,)  # row-parallel: rows same on all TP
    out: dict[str, list] = {}
    stored_rows: dict[str, int] = {}
    for k in tp_ranks:
        for r in range(lay.g):
            tl = TensorLayout(L=L, tp=lay.tp, tp_rank=k, g=lay.g, gtp_rank=r,
                              pad_for_alignment=lay.pad_for_alignment, tp_axis=spec.tp_axis,
                              gated=spec.gated, singleton_local_shards=spec.singleton_local_shards)
            # where each padded shard row sits on disk
            src = [None] * tl.shard_rows
            for p in stock_0192_offsets(tl):
                stored_rows.setdefault(p.key_suffix, p.global_size)
                if stored_rows[p.key_suffix] != p.global_size:
                    raise ValueError(f"inconsistent stock sizes for {spec.key}{p.key_suffix}")
                for i in range(p.rows):
                    src[p.lo + i] = (p.key_suffix, p.global_offset + i)
            for p in logical_pieces(tl):
                rows = out.setdefault(p.key_suffix, [None] * p.global_size)
                for i in range(p.rows):
                    if rows[p.global_offset + i] is not None:
                        raise ValueError(f"logical row {p.global_offset + i} written twice")
                    rows[p.global_offset + i] = src[p.lo + i]
    for suffix, rows in out.items():
        if any(x is None for x in rows):
            raise ValueError(f"{spec.key}{suffix}: logical rows not covered")
    return out, stored_rows


def _expected_stored_rows(spec: TensorSpec, lay: SavedLayout, L: int) -> dict:
    """{suffix: stored dim 0} of this GTP weight under ``lay`` (stock 0.19.2; g=1: logical).

    Raises:
        ValueError: the layout cannot hold this L.
    """
    tl = TensorLayout(L=L, tp=lay.tp, tp_rank=0, g=lay.g, gtp_rank=0,
                      pad_for_alignment=lay.pad_for_alignment, tp_axis=spec.tp_axis,
                      gated=spec.gated, singleton_local_shards=spec.singleton_local_shards)
    return {p.key_suffix: p.global_size for p in stock_0192_offsets(tl)}


def _candidate_Ls(spec: TensorSpec, lay: SavedLayout, stored: Mapping[str, int]) -> list[int]:
    """Every L that gives the stored dim 0 under ``lay`` (for a weight of unknown size)."""
    total = max(stored.values())
    if spec.tp_axis == 1:
        hi = total
    elif spec.gated and spec.singleton_local_shards:
        hi = 2 * total // lay.tp
    else:
        hi = total // lay.tp
    found = []
    for L in range(max(hi - lay.pad_for_alignment * lay.g, 1), hi + 1):
        if spec.gated and L % 2:
            continue
        try:
            if _expected_stored_rows(spec, lay, L) == dict(stored):
                found.append(L)
        except ValueError:
            continue
    return found


# --------------------------------------------------------------------------------------------
# analyze
# --------------------------------------------------------------------------------------------
def resolve_iter_dir(path) -> Path:
    """A checkpoint iter dir from a checkpoint root (its tracker's iteration) or an iter dir.

    Raises:
        LegacyCheckpointError: neither (names what is missing).
    """
    path = Path(path)
    if (path / TRACKER).is_file():
        text = (path / TRACKER).read_text().strip()
        try:
            it = int(text)
        except ValueError:
            raise LegacyCheckpointError(f"{path / TRACKER}: not an iteration number: {text!r}") from None
        path = path / f"iter_{it:07d}"
    if not (path / "metadata.json").is_file():
        raise LegacyCheckpointError(
            f"{path}: not a megatron torch_dist checkpoint (no metadata.json); pass a checkpoint "
            f"root holding {TRACKER} or an iter_XXXXXXX dir")
    return path


def _stored_shapes(path: Path) -> dict:
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_tensors_metadata(str(path))
    return {k: tuple(v.global_shape) for k, v in meta.items()}


def _layout_text(lay: SavedLayout) -> str:
    return f"tp={lay.tp},gtp={lay.g},pad={lay.pad_for_alignment}"


def _explaining_layouts(spec: TensorSpec, dims: Mapping, stored: Mapping[str, int],
                        kind: str, limit: int = 8) -> str:
    """Grid layouts under which this tensor's stored rows come out."""
    found = []
    for tp, g, a in itertools.product(_GRID_TP, _GRID_G, _GRID_A):
        if g == 1 and a:
            continue
        lay = SavedLayout(tp, g, a)
        s = _spec_for(spec.key, kind, dims, tp, spec.singleton_local_shards)
        try:
            if s.L is not None:
                ok = _expected_stored_rows(s, lay, s.L) == dict(stored)
            else:
                ok = bool(_candidate_Ls(s, lay, stored))
        except ValueError:
            ok = False
        if ok:
            found.append(_layout_text(lay))
    if len(found) > limit:
        return ", ".join(found[:limit]) + f" ... ({len(found) - limit} more)"
    return ", ".join(found)


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
        An :class:`Analysis`; ``.legacy`` is True when some GTP weight's stored rows differ from
        its logical rows.

    Raises:
        LegacyCheckpointError: the layout is unknown and the stored shapes leave a tensor
            ambiguous, or the given/recorded layout does not explain a stored shape (the message
            names the tensor, its stored shape and the layouts that could explain it).
    """
    from megatron.core import dist_checkpointing

    path = resolve_iter_dir(ckpt)
    if common is None:
        common = dist_checkpointing.load_common_state_dict(str(path))
    common = dict(common)
    shapes = _stored_shapes(path)
    fmt = checkpoint_format(common)
    user = parse_layout(layout)
    meta = common.get(METADATA_KEY) or {}
    notes: list[str] = []

    # ---- layout items, by source
    items: dict = {}
    sources = []
    if user:
        items.update(user)
        sources.append("given by the caller")
    if meta:
        for src_key, k in (("tp", "tensor_model_parallel_size"), ("gtp_remat_size", "gtp_remat_size"),
                           ("pad_for_alignment", "pad_for_alignment")):
            if meta.get(src_key) is not None:
                items.setdefault(k, int(meta[src_key]))
        sources.append(f"{METADATA_KEY} record")
    cfg_items, cfg_src = _config_layout(common)
    if cfg_items:
        for k, v in cfg_items.items():
            items.setdefault(k, v)
        sources.append(cfg_src)
    inferred = _infer_dims(shapes)
    problems = _dims_problems(items, inferred, "recorded" if not user else "given")
    if problems:
        raise LegacyCheckpointError(
            f"{path}: the layout does not match the stored tensors: {'; '.join(problems)}; "
            + _LAYOUT_HELP)
    dims = {**inferred, **items}
    source = " + ".join(sources) if sources else "nothing recorded"

    # ---- GTP keys (model keys; optimizer keys follow their model key)
    model_keys = sorted(k for k in shapes if not _split_key(k)[0])
    meta_tensors = meta.get("tensors") or {}
    gtp_bases: dict[str, dict] = {}  # base key -> {suffix: stored shape}
    unknown = []
    for key in model_keys:
        base, suffix = _strip_suffix(key)
        if base in meta_tensors or _kind(key):
            gtp_bases.setdefault(base, {})[suffix] = shapes[key]
        elif not _PLAIN.search(key):
            unknown.append(key)

    if fmt == "logical":
        lay = None
        if all(k in items for k in ("tensor_model_parallel_size", "gtp_remat_size")):
            lay = SavedLayout(items["tensor_model_parallel_size"], items["gtp_remat_size"],
                              items.get("pad_for_alignment", 0))
        infos = {k: TensorInfo(k, shapes[k], shapes[k]) for k in shapes}
        for base, sub in gtp_bases.items():
            rec = meta_tensors.get(base)
            for suffix in sub:
                spec = TensorSpec(base, rec["L"], rec["tp_axis"], rec.get("gated", False),
                                  rec.get("singleton_local_shards", False)) if rec else None
                for k in shapes:
                    if _split_key(k)[1] == base + suffix:
                        infos[k].gtp, infos[k].base = spec, base
        return Analysis(path, common, fmt, lay, source, False, infos, notes)

    # ---- stock: the saving layout
    tp, g, a = (items.get(k) for k in ("tensor_model_parallel_size", "gtp_remat_size",
                                       "pad_for_alignment"))
    if g is not None and g > 1 and unknown:
        raise LegacyCheckpointError(
            f"{path}: saved with GTP (gtp_remat_size={g}) and holds tensors gtp.legacy does not "
            f"know to be GTP-sharded or not: {unknown[:5]}; only megatron GPT (local spec) "
            "weights are supported")
    if g == 1 or (g is None and not gtp_bases):
        lay = SavedLayout(tp or 1, 1, 0)
        infos = {k: TensorInfo(k, shapes[k], shapes[k]) for k in shapes}
        return Analysis(path, common, fmt, lay, source, False, infos, notes)

    if g is None and not meta:
        # Nothing says GTP was used. If every GTP-able weight of known size is stored at its
        # logical size, nothing is padded: read as stored. (A gated fc1 written by stock GTP with
        # zero padding would look the same: pass the layout to rule that out.)
        known_sizes = []
        for base, sub in gtp_bases.items():
            kind = _kind(base)
            rows = _logical_rows_global(kind, dims)
            if rows is None:
                continue
            want = ({"_w": rows // 2, "_v": rows // 2} if ("_w" in sub or "_v" in sub)
                    else {"": rows})
            known_sizes.append({s: v[-2] for s, v in sub.items()} == want)
        if known_sizes and all(known_sizes):
            notes.append("no layout recorded; every GTP-able weight of known size is stored at "
                         "its logical size: read as stored (assumed written without GTP)")
            infos = {k: TensorInfo(k, shapes[k], shapes[k]) for k in shapes}
            return Analysis(path, common, fmt, SavedLayout(tp, 1, 0) if tp else None,
                            source + "; assumed no GTP", False, infos, notes)

    if tp is not None and g is not None and a is not None:
        candidates = [SavedLayout(tp, g, a)]
        known = True
    else:
        candidates = [SavedLayout(t, gg, aa) for t, gg, aa in
                      itertools.product(_GRID_TP if tp is None else (tp,),
                                        _GRID_G if g is None else (g,),
                                        _GRID_A if a is None else (a,))
                      if not (gg == 1 and aa)]
        known = False

    def options_for(lay: SavedLayout) -> dict:
        """{base: (spec with L unset, kind, stored rows, [L explaining the stored rows])}."""
        opts = {}
        for base, sub in sorted(gtp_bases.items()):
            stored_rows = {suf: shp[-2] for suf, shp in sub.items()}
            rec = meta_tensors.get(base)
            if rec is not None:
                spec = TensorSpec(base, int(rec["L"]), int(rec["tp_axis"]), bool(rec["gated"]),
                                  bool(rec.get("singleton_local_shards", False)), "meta")
                kind = _kind(base)  # for messages only (None: not a known GPT weight)
            else:
                kind = _kind(base)
                spec = _spec_for(base, kind, dims, lay.tp, "_w" in sub or "_v" in sub)
            Ls = [spec.L] if spec.L is not None else _candidate_Ls(spec, lay, stored_rows)
            ok = []
            for L in Ls:
                try:
                    if _expected_stored_rows(spec, lay, L) == stored_rows:
                        ok.append(L)
                except ValueError:
                    pass
            opts[base] = (spec, kind, stored_rows, ok)
        return opts

    def shown(base):
        return _fmt_shapes({base + s: v for s, v in gtp_bases[base].items()})

    def need(kind):
        return ("padded_vocab_size" if kind == "vocab" else
                "hidden_size" if kind in ("proj", "fc2") else
                "ffn_hidden_size and swiglu" if kind == "fc1" else "qkv_rows")

    plans = {}
    if known:
        lay = candidates[0]
        for base, (spec, kind, stored_rows, ok) in options_for(lay).items():
            if len(ok) == 1:
                spec = dataclasses.replace(spec, L=ok[0])
                plans[base] = (spec, _row_map(spec, lay)[0])
            elif not ok and spec.L is not None:
                expl = _explaining_layouts(spec, dims, stored_rows, kind) if kind else ""
                raise LegacyCheckpointError(
                    f"{path}: {base} is stored with shape {shown(base)}, but the layout "
                    f"{lay.describe()} [{source}] with its logical size (TP-local dim 0 "
                    f"L={spec.L}{', gated' if spec.gated else ''}) gives dim 0 "
                    f"{_safe_expected(spec, lay)}. Layouts that explain this stored shape: "
                    f"{expl or 'none in the searched grid'}; check the checkpoint's "
                    f"layout record and run config, or {_LAYOUT_HELP}")
            else:
                raise LegacyCheckpointError(
                    f"{path}: {base} is stored with shape {shown(base)}; under {lay.describe()} "
                    f"[{source}] its logical size is {'ambiguous' if ok else 'unexplained'}: "
                    f"TP-local dim 0 L could be any of {ok or 'none'}, and each reads different "
                    f"rows. The checkpoint does not record {need(kind)}; {_LAYOUT_HELP}")
    else:
        viable = {}
        for cand in candidates:
            opts = options_for(cand)
            if all(o[3] for o in opts.values()):
                viable[cand] = opts
        if not viable:
            # Report the first tensor and the layouts explaining it alone.
            base, sub = next(iter(sorted(gtp_bases.items())))
            kind = _kind(base)
            spec = _spec_for(base, kind, dims, tp or 1, "_w" in sub or "_v" in sub)
            expl = _explaining_layouts(spec, dims, {s: v[-2] for s, v in sub.items()}, kind)
            raise LegacyCheckpointError(
                f"{path}: no layout explains every stored GTP weight (saving layout not recorded: "
                f"{source}; model dims {_fmt_dims(dims)}). {base} is stored with shape "
                f"{shown(base)}; layouts explaining it: {expl or 'none in the searched grid'}. "
                f"{_LAYOUT_HELP}")
        names = [_layout_text(c) for c in viable]
        listed = ", ".join(names[:10]) + (f" ... ({len(names) - 10} more)" if len(names) > 10 else "")
        first_lay = next(iter(viable))
        for base in sorted(gtp_bases):
            per = {c: opts[base] for c, opts in viable.items()}
            Ls = {L for (_, _, _, ok) in per.values() for L in ok}
            multi = any(len(o[3]) > 1 for o in per.values())
            maps = {}
            if not multi and len(Ls) == 1:
                for c, (spec, _, _, ok) in per.items():
                    spec = dataclasses.replace(spec, L=ok[0])
                    maps[c] = (spec, _row_map(spec, c)[0])
                distinct = {repr(m[1]) for m in maps.values()}
                if len(distinct) == 1:
                    plans[base] = maps[first_lay]
                    continue
                other = next(c for c in maps if maps[c][1] != maps[first_lay][1])
                raise LegacyCheckpointError(
                    f"{path}: the saving layout (tp, gtp_remat_size, pad_for_alignment) is neither "
                    f"recorded nor given ({source}) and is ambiguous: "
                    f"{base} stored with shape {shown(base)} is explained by {len(viable)} "
                    f"layouts that read different rows for it: {listed} (e.g. "
                    f"{_layout_text(first_lay)} vs {_layout_text(other)}); {_LAYOUT_HELP}")
            kind = next(iter(per.values()))[1]
            raise LegacyCheckpointError(
                f"{path}: the saving layout (tp, gtp_remat_size, pad_for_alignment) is neither "
                f"recorded nor given ({source}) and {base} stored with "
                f"shape {shown(base)} is ambiguous: its TP-local dim 0 L could be any of "
                f"{sorted(Ls)[:12]} under the layouts {listed}, and each reads different rows. "
                f"The checkpoint does not record {need(kind)}; {_LAYOUT_HELP}")
        lay = first_lay
        if len(viable) > 1:
            notes.append(f"layout not recorded; {len(viable)} layouts explain the stored shapes "
                         f"and all read the same rows (e.g. {_layout_text(lay)})")
        source = f"inferred from the stored shapes ({len(viable)} equivalent layouts)"

    # ---- per stored key
    infos = {}
    legacy_any = False
    for key, shape in shapes.items():
        prefix, model_key = _split_key(key)
        base, suffix = _strip_suffix(model_key)
        if base in plans:
            spec, rowmap = plans[base]
            identity = _is_identity(rowmap)
            pre, cols = shape[:-2], shape[-1]
            if spec.singleton_local_shards:
                out_rows = len(rowmap[suffix])
                logical = (*pre, out_rows, cols)
            else:
                logical = (*pre, len(rowmap[""]), cols)
            info = TensorInfo(key, shape, logical, spec,
                              not identity or tuple(logical) != tuple(shape), rowmap, base)
            legacy_any |= info.legacy
            infos[key] = info
        else:
            infos[key] = TensorInfo(key, shape, shape)
    if not legacy_any:
        notes.append("stored rows equal the logical rows (no padding, no gated GTP weight)")
    return Analysis(path, common, fmt, lay, source, legacy_any, infos, notes)


def _safe_expected(spec, lay):
    try:
        return _fmt_rows(_expected_stored_rows(spec, lay, spec.L))
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


def _fmt_dims(dims: Mapping) -> str:
    keys = ("hidden_size", "ffn_hidden_size", "swiglu", "qkv_rows", "padded_vocab_size")
    return ", ".join(f"{k}={dims[k]}" for k in keys if k in dims) or "unknown"


def _is_identity(rowmap) -> bool:
    for suffix, rows in rowmap.items():
        if any(src != (suffix, i) for i, src in enumerate(rows)):
            return False
    return True


def is_legacy(ckpt, layout=None) -> bool:
    """Whether ``ckpt`` holds GTP weights in stock 0.19.2's padded layout (see :func:`analyze`)."""
    return analyze(ckpt, layout).legacy


# --------------------------------------------------------------------------------------------
# read / convert
# --------------------------------------------------------------------------------------------
def _cpu_compat() -> None:
    """Without CUDA, megatron's checkpoint writer needs gtp-recipes' CPU shims
    (``recipes.cpu_compat``; already installed in a training process)."""
    import torch

    if torch.cuda.is_available():
        return
    try:
        from recipes import cpu_compat
    except ImportError as exc:  # gtp/ used without recipes/
        raise LegacyCheckpointError(
            "writing a checkpoint on a machine without CUDA needs recipes.cpu_compat "
            f"(gtp-recipes): {exc}") from exc
    cpu_compat.install()


def _ensure_dist():
    """Init a 1-process gloo group when none exists; returns a cleanup callable."""
    import torch

    if torch.distributed.is_initialized():
        return lambda: None
    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    return torch.distributed.destroy_process_group


def _reconstruct(info: TensorInfo, stored: Mapping[str, Any]):
    """The logical tensor of one stored key from the stored tensors of its base key group."""
    import torch

    out_suffix = _strip_suffix(_split_key(info.key)[1])[1]
    rows = info.rowmap[out_suffix]
    order = sorted({s for s, _ in rows})
    base_off, parts, off = {}, [], 0
    for s in order:
        t = stored[s]
        base_off[s] = off
        off += t.shape[-2]
        parts.append(t)
    src = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)
    index = torch.tensor([base_off[s] + r for s, r in rows], dtype=torch.long)
    return torch.index_select(src, src.dim() - 2, index).contiguous()


def read_logical(ckpt, layout=None, analysis: Optional[Analysis] = None):
    """The logical tensors of ``ckpt``: ``(analysis, {key: tensor})``.

    Legacy GTP weights (and their optimizer moments / fp32 copies, sharded like them) are
    reconstructed; every other tensor is returned as stored. Initializes a 1-process gloo group
    for the read when ``torch.distributed`` is not initialized (and removes it after). In a
    multi-process group this reads on the calling rank only (no collective).

    Raises:
        LegacyCheckpointError: as :func:`analyze`.
    """
    from megatron.core import dist_checkpointing

    analysis = analysis or analyze(ckpt, layout)
    cleanup = _ensure_dist()
    try:
        stored = dist_checkpointing.load_plain_tensors(str(analysis.path))
    finally:
        cleanup()
    out = {}
    for key, info in analysis.tensors.items():
        if not info.legacy:
            out[key] = stored[key]
            continue
        prefix, model_key = _split_key(key)
        group = {}
        for suf in ("", "_w", "_v"):
            k = prefix + info.base + suf
            if k in stored:
                group[suf] = stored[k]
        logical = _reconstruct(info, group)
        if tuple(logical.shape) != tuple(info.logical_shape):
            raise LegacyCheckpointError(
                f"{key}: reconstructed shape {tuple(logical.shape)} != {info.logical_shape}")
        out[key] = logical
    return analysis, out


def _fingerprint(path: Path) -> dict:
    st = (path / ".metadata").stat()
    return {"source": str(path.resolve()), "metadata_size": st.st_size,
            "metadata_mtime_ns": st.st_mtime_ns}


def _converted_common(analysis: Analysis) -> dict:
    import copy
    from importlib.metadata import version

    common = copy.deepcopy(analysis.common)
    lay = analysis.layout or SavedLayout(
        int(_get(common, "layout", "tensor_model_parallel_size") or 1), 1, 0)
    orig_layout = common.get("layout")
    if isinstance(orig_layout, dict):
        new = dict(orig_layout)
        g = int(new.get("gtp_remat_size", 1) or 1)
        new["gtp_remat_size"] = 1
        new["pad_for_alignment"] = 0
        if new.get("data_parallel_size") is not None:
            new["data_parallel_size"] = int(new["data_parallel_size"]) * g
        common["layout"] = new
    common[METADATA_KEY] = {
        "gtp_format": FORMAT_LOGICAL, "tp": lay.tp, "gtp_remat_size": 1, "pad_for_alignment": 0,
        "megatron_core": version("megatron-core"), "tensors": {},
    }
    common[CONVERTED_KEY] = {
        "converted_by": f"gtp.legacy v{CONVERTER_VERSION}",
        "saved_layout": {"tensor_model_parallel_size": lay.tp, "gtp_remat_size": lay.g,
                         "pad_for_alignment": lay.pad_for_alignment},
        "layout_source": analysis.layout_source,
        "layout": orig_layout,
        METADATA_KEY: analysis.common.get(METADATA_KEY),
        "legacy_keys": sorted(k for k, i in analysis.tensors.items() if i.legacy),
        **_fingerprint(analysis.path),
    }
    return common


def _broadcast(obj):
    import torch

    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


# Sharded objects not carried into a converted checkpoint: the common state is rewritten, and
# per-rank RNG states belong to the ranks of the saving layout.
_DROPPED_OBJECTS = ("common_state", "rng_state")


def _read_objects(path: Path) -> list:
    """Every ShardedObject of the checkpoint but :data:`_DROPPED_OBJECTS` (e.g. the linear
    layers' ``_extra_state``), with its data; this rank reads them all (no collective)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    meta = TorchDistLoadShardedStrategy().load_sharded_metadata(path)
    state = {
        uk: ShardedObject(o.key, None, o.global_shape, o.global_offset, replica_id=0)
        for uk, o in meta.items()
        if isinstance(o, ShardedObject) and o.key not in _DROPPED_OBJECTS
    }
    if not state:
        return []
    loaded = dist_checkpointing.load(state, str(path), validate_access_integrity=False)
    return [(o.key, o.global_shape, o.global_offset, loaded[uk]) for uk, o in state.items()]


def _write(dst_iter: Path, common: dict, tensors: Optional[Mapping], objects=()) -> None:
    """Collective: every rank calls; rank 0 passes all tensors (one unfragmented shard each,
    replica 0) and sharded objects, the others none. ``common`` must be the same on every rank."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    state = dict(common)
    if tensors:  # (an empty dict would stay in the other ranks' common state)
        state["model"] = {
            key: ShardedTensor.from_rank_offsets(key, t.contiguous(), replica_id=0)
            for key, t in tensors.items()
        }
    if objects:
        state["objects"] = {
            f"{key}/{'.'.join(map(str, offset))}": ShardedObject(key, data, tuple(shape),
                                                                 tuple(offset), replica_id=0)
            for key, shape, offset, data in objects
        }
    dist_checkpointing.save(state, str(dst_iter))


def convert(src, dst_root, layout=None) -> Path:
    """Write ``src`` (any checkpoint; legacy GTP weights reconstructed) as a logical checkpoint.

    The result is a normal torch_dist checkpoint under ``dst_root`` (``iter_XXXXXXX`` and
    ``latest_checkpointed_iteration.txt``) that stock megatron-core loads at any TP without GTP,
    and gtp-recipes loads at any layout. Its common state is the source's, with ``layout``
    rewritten to the non-GTP layout of the same TP (``gtp_remat_size`` 1, pad 0), a
    ``gtp_layout`` record tagged ``logical-v1``, and ``gtp_converted_from`` (source path,
    original layout and its source, legacy keys). Per-rank RNG states are not carried over.

    Collective when ``torch.distributed`` is initialized with several ranks (all call it; rank 0
    reads and writes the data); in one process it initializes a 1-process gloo group itself.

    Args:
        src: checkpoint root or iter dir.
        dst_root: output checkpoint root (created; an existing iter dir of the same iteration
            is replaced).
        layout: the saving layout when the checkpoint does not record it (:func:`parse_layout`).

    Returns:
        The written iter dir.

    Raises:
        LegacyCheckpointError: as :func:`analyze` (on every rank).
    """
    import torch

    _cpu_compat()
    cleanup = _ensure_dist()
    try:
        rank = torch.distributed.get_rank()
        status, tensors, objects = None, None, ()
        if rank == 0:
            try:
                analysis, tensors = read_logical(src, layout)
                objects = _read_objects(analysis.path)
                common = _converted_common(analysis)
                status = ("ok", common, int(common.get("iteration", 0) or 0))
            except LegacyCheckpointError as exc:
                status = ("error", str(exc), 0)
            except Exception as exc:  # noqa: BLE001 - the other ranks must not wait forever
                status = ("error", f"cannot read {src}: {type(exc).__name__}: {exc}", 0)
        status = _broadcast(status)
        if status[0] == "error":
            raise LegacyCheckpointError(status[1])
        common, iteration = status[1], status[2]
        dst_root = Path(dst_root)
        dst_iter = dst_root / f"iter_{iteration:07d}"
        if rank == 0:
            dst_root.mkdir(parents=True, exist_ok=True)
            if dst_iter.exists():
                shutil.rmtree(dst_iter)
            dst_iter.mkdir()
        if torch.distributed.get_world_size() > 1:
            torch.distributed.barrier()
        _write(dst_iter, common, tensors, objects)
        if rank == 0:
            tmp = dst_root / (TRACKER + ".tmp")
            tmp.write_text(f"{iteration}\n")
            os.replace(tmp, dst_root / TRACKER)
        if torch.distributed.get_world_size() > 1:
            torch.distributed.barrier()
        return dst_iter
    finally:
        cleanup()


def _cached(cache_iter: Path, src_iter: Path) -> bool:
    from megatron.core import dist_checkpointing

    if not (cache_iter / "metadata.json").is_file() or not (cache_iter / ".metadata").is_file():
        return False
    try:
        rec = dist_checkpointing.load_common_state_dict(str(cache_iter)).get(CONVERTED_KEY) or {}
    except Exception:  # noqa: BLE001 - a torn cache entry is rebuilt
        return False
    fp = _fingerprint(src_iter)
    return all(rec.get(k) == v for k, v in fp.items()) and \
        rec.get("converted_by") == f"gtp.legacy v{CONVERTER_VERSION}"


def prepare_load(path, common: Mapping, layout_record: Optional[Mapping] = None,
                 stock_writer: bool = False, cache_root=None) -> tuple[Path, bool]:
    """Where to load ``path`` from: itself, or its logical conversion (collective).

    Every rank of the default group calls this with the same arguments. For a checkpoint that
    is not legacy it returns ``(path, False)`` without reading anything beyond metadata. For a
    legacy one (stock 0.19.2 GTP layout with padded or gated GTP weights) it returns
    ``(converted_iter_dir, True)``: rank 0 converts it once (:func:`convert`) into
    ``<cache_root or path.parent/gtp_converted>/iter_XXXXXXX`` and later loads reuse it while the
    source is unchanged. Exception: when the loader itself writes the stock layout
    (``stock_writer``) and its layout record equals the checkpoint's, the stock file is loaded
    as is (megatron's same-layout resume is self-consistent).

    Raises:
        LegacyCheckpointError: the legacy checkpoint cannot be read exactly (on every rank), or
            the cache folder cannot be written (the message says how to convert elsewhere).
    """
    import torch

    path = Path(path)
    if checkpoint_format(common) == "logical":
        return path, False
    layout_g = _get(common, "layout", "gtp_remat_size") or _get(common, METADATA_KEY, "gtp_remat_size")
    if not layout_g or int(layout_g) <= 1:
        return path, False
    if stock_writer and layout_record is not None and common.get("layout") == dict(layout_record):
        return path, False
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    cache_root = Path(cache_root) if cache_root else path.parent / CONVERTED_DIR
    cache_iter = cache_root / path.name
    decision = None
    if rank == 0:
        try:
            analysis = analyze(path, common=common)
            if not analysis.legacy:
                decision = ("as_is", str(path))
            elif _cached(cache_iter, path):
                decision = ("cached", str(cache_iter))
            else:
                try:
                    cache_root.mkdir(parents=True, exist_ok=True)
                    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=cache_root))
                    decision = ("convert", str(staging))
                except OSError as exc:
                    decision = ("error", (
                        f"{path} is a legacy GTP checkpoint (megatron-core 0.19.2 padded layout) "
                        f"and its converted copy cannot be written to {cache_root}: {exc}. "
                        f"Convert it elsewhere: `python -m gtp convert {path} DST` and load DST"))
        except LegacyCheckpointError as exc:
            decision = ("error", str(exc))
        except Exception as exc:  # noqa: BLE001 - the other ranks must not wait forever
            decision = ("error", f"cannot read {path}: {type(exc).__name__}: {exc}")
    kind, where = _broadcast(decision)
    if kind == "error":
        raise LegacyCheckpointError(where)
    if kind == "as_is":
        return path, False
    if kind == "convert":
        # Written into a private staging root, then moved into place by rank 0, so a
        # concurrent job loading the same checkpoint never reads a half-written copy.
        staging = Path(where)
        convert(path, staging)
        if rank == 0:
            try:
                if not _cached(cache_iter, path):
                    if cache_iter.exists():
                        shutil.rmtree(cache_iter)
                    os.replace(staging / path.name, cache_iter)
                    tmp = cache_root / f"{TRACKER}.{staging.name}"
                    tmp.write_text(f"{int(path.name[5:]) if path.name[5:].isdigit() else 0}\n")
                    os.replace(tmp, cache_root / TRACKER)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.barrier()
        where = str(cache_iter)
    return Path(where), True
