"""The vocabulary of the stock reader: layout keys, tensor specs, the analysis result, and the
helpers that classify checkpoint keys and derive model dims.

A user layout (:func:`parse_layout`) and the gtp-recipes records (:func:`config_layout`) give
the saving layout and model dims; :func:`spec_for` turns them into a GTP weight's
:class:`TensorSpec`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from gtp.alignment import resolve_pad_for_alignment
from ckpt.families import gtp_patterns, run_config_vocab, stored_logical_patterns
from ckpt.stock.format import StockCheckpointError

# What a user may pass as ``layout`` (aliases in parentheses):
#   tensor_model_parallel_size (tp), gtp_remat_size (gtp, g), pad_for_alignment (pad, a),
#   hidden_size, ffn_hidden_size, swiglu, num_attention_heads, num_query_groups, kv_channels,
#   qkv_rows (global out_features of linear_qkv), padded_vocab_size (vocab), and for routed
#   experts (MoE): expert_tensor_parallel_size (etp), expert_gtp_remat_size (egtp),
#   moe_ffn_hidden_size.
LAYOUT_KEYS = (
    "tensor_model_parallel_size", "gtp_remat_size", "pad_for_alignment", "hidden_size",
    "ffn_hidden_size", "swiglu", "num_attention_heads", "num_query_groups", "kv_channels",
    "qkv_rows", "padded_vocab_size", "expert_tensor_parallel_size", "expert_gtp_remat_size",
    "moe_ffn_hidden_size",
)
_ALIASES = {"tp": "tensor_model_parallel_size", "gtp": "gtp_remat_size", "g": "gtp_remat_size",
            "pad": "pad_for_alignment", "a": "pad_for_alignment", "vocab": "padded_vocab_size",
            "etp": "expert_tensor_parallel_size", "egtp": "expert_gtp_remat_size"}
# The layout items of the routed experts, and the dense items they stand for when the expert
# weights are read (megatron splits an expert's linears over the expert tensor parallel group and
# shards them over the expert GTP group; their width is moe_ffn_hidden_size).
EXPERT_ITEMS = {"expert_tensor_parallel_size": "tensor_model_parallel_size",
                "expert_gtp_remat_size": "gtp_remat_size",
                "moe_ffn_hidden_size": "ffn_hidden_size"}

# The model dims among LAYOUT_KEYS (the others are the layout and the vocabulary, one per
# checkpoint): a model of sub-models (LLaVA) has one set of these per key prefix.
MODEL_DIMS = ("hidden_size", "ffn_hidden_size", "swiglu", "num_attention_heads",
              "num_query_groups", "kv_channels", "qkv_rows", "moe_ffn_hidden_size")

# Grid searched when the checkpoint records no layout.
GRID_TP = (1, 2, 4, 8, 16)
GRID_G = (1, 2, 4, 8)
GRID_A = (0, 1, 2, 4, 8, 16, 32, 64, 128)

_OPT_PREFIX = re.compile(r"^(optimizer\.state\.[^.]+\.)(.+)$")
# Tensors GTP never shards (megatron wraps only Column/RowParallelLinear and
# VocabParallelEmbedding weights).
PLAIN = re.compile(r"(\.bias|norm_weight|norm_bias|norm\.weight|position_embeddings\.weight|"
                   r"\.router\.weight|\.router\.expert_bias)$")
# Routed-expert weights (megatron's SequentialMLP keys: ``...mlp.experts.experts.linear_fc1.weight``
# with a prepended expert axis; shared experts are ``shared_experts.`` and dense-parallel).
_ROUTED_EXPERT = re.compile(r"(^|\.)experts\.")


def is_plain(key: str) -> bool:
    """Whether a stock-format model key is stored at its logical shape and read as stored: a
    norm, bias, position embedding or router (:data:`PLAIN`), or a key a model family registers
    as stored at its logical shape (:attr:`ckpt.families.FamilyFormats.stored_logical`)."""
    return bool(PLAIN.search(key)) or any(p.search(key) for p in stored_logical_patterns())


def is_routed_expert(key: str) -> bool:
    """Whether a model key is a routed expert's (split by expert TP, sharded by expert GTP)."""
    return bool(_ROUTED_EXPERT.search(key))


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
    """The parallel layout a checkpoint was written at (only what the stored rows depend on)."""

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
        stock: the stored rows differ from the logical ones (padding and/or shifted rows).
        out_key: key of the logical tensor (differs from ``key`` only for singleton gated halves,
            which keep their suffix).
    """

    key: str
    stored_shape: tuple
    logical_shape: tuple
    gtp: Optional[TensorSpec] = None
    stock: bool = False
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
    stock: bool
    tensors: dict  # stored key -> TensorInfo
    notes: list = field(default_factory=list)
    # The routed experts' layout (expert TP as tp, expert GTP as g), None without expert weights.
    expert_layout: Optional[SavedLayout] = None

    def describe(self) -> str:
        lay = self.layout.describe() if self.layout else "unknown"
        if self.expert_layout is not None:
            lay += f"; routed experts at expert {self.expert_layout.describe()}"
        kind = ("stock padded GTP format (megatron-core 0.19.2)" if self.stock else
                "logical format" if self.format == "logical" else
                "stock format, nothing padded or shifted")
        return f"{kind}; saved at {lay} [{self.layout_source}]"


@dataclass
class StoredCheckpoint:
    """What :func:`ckpt.stock.analyze` knows of a checkpoint before resolving its saving layout."""

    path: Path
    common: dict
    format: str  # "logical" | "stock"
    shapes: dict  # stored key -> global shape
    meta: dict  # the sharding record ({} when absent)
    items: dict  # layout items, the first source wins per item
    source: str  # where the items come from
    dims: dict  # model dims: inferred from the stored shapes, overridden by the items
    gtp_bases: dict  # base key of a GTP weight -> {suffix: stored shape}
    unknown: list  # model keys neither known GTP weights nor known plain tensors
    # {key prefix: model dims} of a model of sub-models (LLaVA: ckpt.families.sub_model_dims)
    sub_dims: dict = field(default_factory=dict)

    def dims_for(self, key: str) -> dict:
        """The model dims that shape ``key`` (a model or optimizer key): its sub-model's
        (:attr:`sub_dims`, by key prefix), else the checkpoint's (:attr:`dims`)."""
        model_key = split_key(key)[1]
        for prefix, dims in self.sub_dims.items():
            if model_key.startswith(prefix):
                return dims
        return self.dims

    @property
    def meta_tensors(self) -> dict:
        return self.meta.get("tensors") or {}

    def as_stored(self, lay: Optional[SavedLayout], source: str, notes: list) -> Analysis:
        """Every tensor read as stored (nothing padded or shifted)."""
        infos = {k: TensorInfo(k, self.shapes[k], self.shapes[k]) for k in self.shapes}
        return Analysis(self.path, self.common, self.format, lay, source, False, infos, notes)


def parse_layout(text_or_mapping) -> dict:
    """A user layout as a dict of :data:`LAYOUT_KEYS` (aliases accepted).

    Accepts a mapping or a string ``"tp=2,gtp=2,pad=16,swiglu=true"``.

    Raises:
        StockCheckpointError: unknown key or a value that is not an int / bool.
    """
    if text_or_mapping is None:
        return {}
    if isinstance(text_or_mapping, str):
        items = []
        for part in filter(None, (p.strip() for p in text_or_mapping.split(","))):
            if "=" not in part:
                raise StockCheckpointError(f"layout item {part!r}: expected key=value")
            k, v = part.split("=", 1)
            items.append((k.strip(), v.strip()))
    else:
        items = list(dict(text_or_mapping).items())
    out = {}
    for k, v in items:
        name = _ALIASES.get(k, k)
        if name not in LAYOUT_KEYS:
            raise StockCheckpointError(
                f"unknown layout key {k!r}; valid: {list(LAYOUT_KEYS)} (aliases {_ALIASES})")
        if name == "swiglu":
            if isinstance(v, str):
                if v.lower() not in ("true", "false", "1", "0"):
                    raise StockCheckpointError(f"layout swiglu={v!r}: expected true or false")
                v = v.lower() in ("true", "1")
            out[name] = bool(v)
        else:
            try:
                out[name] = int(v)
            except (TypeError, ValueError):
                raise StockCheckpointError(f"layout {k}={v!r}: expected an integer") from None
            if out[name] < (0 if name == "pad_for_alignment" else 1):
                raise StockCheckpointError(f"layout {k}={v!r} out of range")
    return out


def get_path(d, *path):
    for p in path:
        if not isinstance(d, Mapping) or p not in d:
            return None
        d = d[p]
    return d


def _vocab_from_config(cfg: Mapping, tp: int) -> Optional[int]:
    """Padded vocab rows of a saved run config, from the reader the package that saves it gave
    (:func:`ckpt.families.install`; None: no reader, or it does not know this config, the vocab
    stays unknown)."""
    reader = run_config_vocab()
    if reader is None:
        return None
    try:
        vocab = reader(cfg, tp)
    except Exception:  # noqa: BLE001 - a reader that cannot read this config
        return None
    return None if vocab is None else int(vocab)


def config_layout(common: Mapping) -> tuple[dict, str]:
    """Layout items recorded by gtp-recipes (``layout`` record, run config)."""
    out, src = {}, []
    rec = common.get("layout")
    if isinstance(rec, Mapping):
        for k in ("tensor_model_parallel_size", "gtp_remat_size", "pad_for_alignment",
                  "expert_tensor_parallel_size", "expert_gtp_remat_size"):
            if rec.get(k) is not None:
                out[k] = int(rec[k])
        if out:
            src.append("layout record")
    cfg = get_path(common, "train_state", "config")
    if isinstance(cfg, Mapping):
        m = cfg.get("model") or {}
        for k in ("hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                  "kv_channels", "moe_ffn_hidden_size"):
            if m.get(k) is not None:
                out.setdefault(k, int(m[k]))
        if m.get("swiglu") is not None:
            out.setdefault("swiglu", bool(m["swiglu"]))
        if m.get("attention_output_gate") and m.get("num_attention_heads") and m.get("hidden_size"):
            # Gated attention: a gate head per query head in linear_qkv (megatron's
            # SelfAttention.linear_qkv_out_dim), rows the heads/groups formula leaves out.
            heads = int(m["num_attention_heads"])
            groups = int(m.get("num_query_groups") or heads)
            kv = int(m.get("kv_channels") or int(m["hidden_size"]) // heads)
            out.setdefault("qkv_rows", (2 * heads + 2 * groups) * kv)
        par, gtp_cfg = cfg.get("parallelism") or {}, cfg.get("gtp") or {}
        if par.get("tensor_model_parallel_size") is not None:
            out.setdefault("tensor_model_parallel_size", int(par["tensor_model_parallel_size"]))
        if gtp_cfg.get("gtp_remat_size") is not None:
            out.setdefault("gtp_remat_size", int(gtp_cfg["gtp_remat_size"]))
        if m.get("num_moe_experts"):
            # megatron's expert TP defaults to TP; expert GTP to none
            etp = par.get("expert_tensor_parallel_size") or out.get("tensor_model_parallel_size")
            if etp is not None:
                out.setdefault("expert_tensor_parallel_size", int(etp))
            out.setdefault("expert_gtp_remat_size", int(gtp_cfg.get("expert_gtp_remat_size") or 1))
        if "pad_for_alignment" not in out and max(out.get("gtp_remat_size", 1),
                                                  out.get("expert_gtp_remat_size", 1)) > 1:
            try:
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


def gtp_kind(key: str) -> Optional[str]:
    """The GTP weight kind of a stock-format key (``vocab``, ``qkv``, ``proj``, ``fc1``,
    ``fc2``: :func:`spec_for`), from the registered model families' patterns
    (:func:`ckpt.families.gtp_patterns`); None for a tensor GTP does not shard."""
    for pattern, kind in gtp_patterns():
        if pattern.search(key):
            return kind
    return None


def split_key(key: str) -> tuple[str, str]:
    """(optimizer prefix or "", model key)."""
    m = _OPT_PREFIX.match(key)
    return (m.group(1), m.group(2)) if m else ("", key)


def strip_suffix(model_key: str) -> tuple[str, str]:
    for suf in ("_w", "_v"):
        if model_key.endswith(".weight" + suf):
            return model_key[: -len(suf)], suf
    return model_key, ""


def infer_dims(shapes: Mapping[str, tuple]) -> dict:
    """Model dims implied by tensors GTP never pads (biases, norms, in_features)."""
    out: dict = {}
    model = {k: v for k, v in shapes.items() if not split_key(k)[0]}
    for key, shape in model.items():
        if ".shared_experts." in key:
            continue  # its width is moe_shared_expert_intermediate_size, not ffn_hidden_size
        kind = gtp_kind(key)
        if kind == "qkv" and len(shape) >= 2:
            out.setdefault("hidden_size", shape[-1])
        elif kind == "fc2" and len(shape) >= 2 and is_routed_expert(key):
            out.setdefault("moe_ffn_hidden_size", shape[-1])
        elif kind == "fc2" and len(shape) >= 2:
            out.setdefault("ffn_hidden_size", shape[-1])
        elif key.endswith("linear_qkv.bias"):
            out.setdefault("qkv_rows", shape[-1])
        elif key.endswith("linear_fc1.bias"):
            out["_fc1_bias_rows"] = shape[-1]
        elif key.endswith(("final_layernorm.weight", "final_norm.weight")):  # GPT, hybrid
            out.setdefault("hidden_size", shape[-1])
        elif key.endswith(("linear_proj.bias", "linear_fc2.bias")):
            # a model without qkv or final norm (LLaVA's projector) shows its width here
            out.setdefault("hidden_size", shape[-1])
    ffn, fc1b = out.get("ffn_hidden_size"), out.pop("_fc1_bias_rows", None)
    if ffn and fc1b in (ffn, 2 * ffn):
        out["swiglu"] = fc1b == 2 * ffn
    return out


def dims_problems(given: Mapping, inferred: Mapping, source: str) -> list[str]:
    return [
        f"{k}={given[k]} ({source}) but the stored tensors imply {k}={inferred[k]}"
        for k in ("hidden_size", "ffn_hidden_size", "qkv_rows", "swiglu", "moe_ffn_hidden_size")
        if k in given and k in inferred and given[k] != inferred[k]
    ]


def logical_rows_global(kind: str, dims: Mapping) -> Optional[int]:
    """Global logical dim 0 (all TP ranks) of a GTP weight kind, from model dims."""
    if kind == "vocab":
        return dims.get("padded_vocab_size")
    if kind in ("proj", "fc2", "eh_proj"):
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


def spec_for(base: str, kind: str, dims: Mapping, tp: int, singleton: bool) -> TensorSpec:
    rows = logical_rows_global(kind, dims)
    tp_axis = 1 if kind in ("proj", "fc2") else 0
    L = None
    if rows is not None:
        if tp_axis == 1:
            L = rows
        elif rows % tp == 0:
            L = rows // tp
    gated = kind == "fc1" and bool(dims.get("swiglu"))
    return TensorSpec(base, L, tp_axis, gated, singleton and gated, kind)
