"""Two-way tables of Hugging Face weight names: a family gives, per architecture, one table
(``model dict -> [entry, ...]``) from which :mod:`ckpt.hf.hf_import`'s plan, :mod:`ckpt.hf.
hf_export`'s state dict and :func:`ckpt.hf.hf_weights.check_sizes`' shapes are all derived.

Each entry maps one megatron tensor (its key in a logical checkpoint; a per-layer one stacked
on dim 0) to one or more HF tensors, both ways, and gives each HF tensor's shape as
``((size key, factor), ...)`` (each dim the size times ``factor``, a number or a size key such
as ``"head_dim"``; the size keys are :func:`ckpt.hf.hf_weights.check_sizes`'). HF names are
written without the architecture's prefix (``"model."``) unless the entry is not ``prefixed``
(an output head outside the base model); ``"{i}"`` stands for the layer, ``"{e}"`` for a routed
expert. Kinds:

* :class:`Direct`: one tensor as it is, or transposed (GPT-2's ``Conv1D`` ``[in, out]``);
* :class:`QKV`: q, k, v <-> megatron's fused rows per query group;
* :class:`ColumnQKV`: one Conv1D tensor of ``[q | k | v]`` columns (GPT-2) <-> the fused rows;
* :class:`GatedFC1`: ``[gate; up]`` <-> megatron's gated fc1 rows;
* :class:`Experts`: per-expert tensors <-> megatron's ``[experts, ...]`` stack.

Layers that differ (dense layers before MoE ones: megatron's ``non_homogeneous_layers``, which
``moe_layer_freq`` as a list implies) are saved by megatron one key per layer
(``decoder.layers.3.mlp.router.weight``, no layer dim): such an entry's megatron key holds
``"{i}"`` too and its ``layers`` name the layers it maps (:func:`per_layer_keys`).

Saved and loaded names: transformers >= 5 holds some weights in its model under other names
than ``save_pretrained`` writes (Mixtral's ``block_sparse_moe.experts.<e>.w1`` are saved,
``mlp.experts.gate_up_proj`` held). An import reads the saved names; an export loads the held
ones into the transformers model (``loaded=True``), which saves them in the saved form.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

Dims = tuple  # ((size key, factor), ...)


def fuse_qkv(q, k, v, groups: int):
    """HF's q ``[heads*d, ...]``, k, v ``[groups*d, ...]`` -> megatron's fused rows
    ``[groups * (heads/groups + 2) * d, ...]`` (per group: its queries, its key, its value;
    megatron-core ``SelfAttention.get_query_key_value_tensors``)."""
    import torch

    rest = q.shape[1:]
    q = q.reshape(groups, -1, *rest)
    k = k.reshape(groups, -1, *rest)
    v = v.reshape(groups, -1, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(w, heads: int, groups: int, head_dim: int):
    """Megatron's fused QKV rows ``[groups * (heads/groups + 2) * head_dim, ...]`` -> (q, k, v)
    with rows ``[heads * head_dim]``, ``[groups * head_dim]``, ``[groups * head_dim]``."""
    per = heads // groups
    g = w.reshape(groups, (per + 2) * head_dim, *w.shape[1:])
    q = g[:, : per * head_dim].reshape(heads * head_dim, *w.shape[1:])
    k = g[:, per * head_dim: (per + 1) * head_dim].reshape(groups * head_dim, *w.shape[1:])
    v = g[:, (per + 1) * head_dim:].reshape(groups * head_dim, *w.shape[1:])
    return q, k, v


def attention_dims(m: dict) -> tuple[int, int, int]:
    """(heads, query groups, head width) of a ``model`` dict: ``num_query_groups`` unset means
    one group per head, ``kv_channels`` unset means ``hidden_size / heads``."""
    heads = m["num_attention_heads"]
    return heads, m.get("num_query_groups") or heads, (m.get("kv_channels")
                                                       or m["hidden_size"] // heads)


@dataclass(frozen=True)
class Entry:
    """One megatron tensor and its HF tensors (the base of the kinds; not used alone).

    Attributes:
        megatron: the megatron key (``"decoder.layers.<module>.weight"``: stacked layers).
        hf: the saved HF names, without the prefix (``"layers.{i}.<module>.weight"``).
        dims: per saved name, its shape as ``((size key, factor), ...)``.
        loaded: the names transformers' model holds them under, when not ``hf`` (one per
            megatron tensor for :class:`Experts`, a rename for :class:`Direct`).
        vocab: the rows are the vocabulary (megatron pads them; an export drops the padding).
        prefixed: the names lie under the architecture's prefix (False: ``lm_head``).
        layers: with ``"{i}"`` in ``megatron``, the layers this entry maps, each its own
            megatron key (:func:`per_layer_keys`); None: every layer, stacked.
    """

    megatron: str
    hf: tuple
    dims: tuple
    loaded: Optional[tuple] = None
    vocab: bool = False
    prefixed: bool = True
    layers: Optional[tuple] = None

    def layer_keys(self, m: dict) -> list:
        """``[(layer or None, megatron key)]``: one per layer of :attr:`layers` when the
        megatron key is per layer, else ``[(None, key)]`` (one tensor, stacked if per layer)."""
        if self.layers is None:
            return [(None, self.megatron)]
        return [(i, self.megatron.format(i=i)) for i in self.layers]

    @property
    def per_layer(self) -> bool:
        """One tensor per layer (``"{i}"`` in the names; megatron stacks them on dim 0)."""
        return any("{i}" in n for n in self.hf)

    def names(self, m: dict, loaded: bool = False) -> list:
        """The HF names (``"{i}"`` kept, ``"{e}"`` expanded), in :meth:`to_megatron`'s order."""
        return list(self.loaded if loaded and self.loaded else self.hf)

    def sizes(self, loaded: bool = False) -> dict:
        """``{name ("{i}", "{e}" kept): dims}`` of the saved (or loaded) names."""
        return dict(zip(self.loaded if loaded and self.loaded else self.hf, self.dims))

    def to_megatron(self, tensors: list, m: dict, loaded: bool = False):
        """The megatron tensor (one layer's) from the HF tensors in :meth:`names` order."""
        raise NotImplementedError

    def to_hf(self, t, m: dict, loaded: bool = False) -> dict:
        """``{HF name ("{i}" kept): tensor}`` of the megatron tensor ``t`` (one layer's)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Direct(Entry):
    """One HF tensor as megatron's, transposed when ``transpose`` (GPT-2's Conv1D
    ``[in, out]`` weights vs megatron's ``[out, in]``)."""

    transpose: bool = False

    def to_megatron(self, tensors, m, loaded=False):
        return tensors[0].t() if self.transpose else tensors[0]

    def to_hf(self, t, m, loaded=False):
        return {self.names(m, loaded)[0]: t.t() if self.transpose else t}


@dataclass(frozen=True)
class QKV(Entry):
    """``hf`` = (q, k, v) names (weights ``[rows, hidden]`` or biases ``[rows]``) <-> megatron's
    fused rows per query group (:func:`fuse_qkv`, :func:`split_qkv`)."""

    def to_megatron(self, tensors, m, loaded=False):
        return fuse_qkv(*tensors, attention_dims(m)[1])

    def to_hf(self, t, m, loaded=False):
        return dict(zip(self.names(m, loaded), split_qkv(t, *attention_dims(m))))


@dataclass(frozen=True)
class ColumnQKV(Entry):
    """GPT-2's fused attention input: the weight ``[hidden, 3 * hidden]`` (Conv1D, columns
    ``[q | k | v]``) or the bias ``[3 * hidden]`` <-> megatron's fused per-head rows (one group
    per head)."""

    def to_megatron(self, tensors, m, loaded=False):
        w = tensors[0].t() if tensors[0].dim() == 2 else tensors[0]  # Conv1D -> [3h, in]
        heads, _, d = attention_dims(m)
        q, k, v = w.split(heads * d, dim=0)
        return fuse_qkv(q, k, v, heads)

    def to_hf(self, t, m, loaded=False):
        import torch

        heads, _, d = attention_dims(m)
        w = torch.cat(split_qkv(t, heads, heads, d), dim=0)
        return {self.names(m, loaded)[0]: w.t() if w.dim() == 2 else w}


@dataclass(frozen=True)
class GatedFC1(Entry):
    """``hf`` = (gate, up) names, each ``[ffn, hidden]`` <-> megatron's gated fc1
    ``[2 * ffn, hidden]`` (gate rows, then up rows: megatron's ``gated_linear_unit``)."""

    def to_megatron(self, tensors, m, loaded=False):
        import torch

        return torch.cat(tensors, dim=0)

    def to_hf(self, t, m, loaded=False):
        return dict(zip(self.names(m, loaded), t.chunk(2, dim=0)))


@dataclass(frozen=True)
class Experts(Entry):
    """Every routed expert's tensors (``"{e}"`` in each saved name; ``hf`` = (gate, up) names
    for a gated fc1, else one name) <-> megatron's ``[experts, ...]`` stack of one layer (a
    gated fc1 ``[E, 2F, H]`` per expert gate rows then up rows, an fc2 ``[E, H, F]``). The
    loaded name (transformers >= 5: one fused tensor, gate and up ``[E, 2F, H]``, down
    ``[E, H, F]``) holds megatron's stack as it is."""

    def names(self, m, loaded=False):
        if loaded and self.loaded:
            return list(self.loaded)
        return [n.replace("{e}", str(e)) for e in range(m["num_moe_experts"]) for n in self.hf]

    def sizes(self, loaded=False):
        if not (loaded and self.loaded):
            return super().sizes()
        (key, factor), *rest = self.dims[0]  # the per-expert rows, gate and up stacked
        return {self.loaded[0]: (("experts", 1), (key, factor * len(self.hf)), *rest)}

    def to_megatron(self, tensors, m, loaded=False):
        import torch

        if loaded and self.loaded:
            return tensors[0]
        n = len(self.hf)
        return torch.stack([torch.cat(tensors[j:j + n], dim=0)
                            for j in range(0, len(tensors), n)])

    def to_hf(self, t, m, loaded=False):
        if loaded and self.loaded:
            return {self.loaded[0]: t}
        parts = [p for expert in t for p in expert.chunk(len(self.hf), dim=0)]
        return dict(zip(self.names(m), parts))


def _full(entry: Entry, name: str, prefix: str) -> str:
    return prefix + name if entry.prefixed else name


def per_layer_keys(table, layers) -> list:
    """``table``'s stacked per-layer entries (megatron key under ``decoder.layers.``) with
    one megatron key per layer instead, for the ``layers`` given (megatron's keys when layers
    differ: ``decoder.layers.<i>.<module>``); other entries unchanged."""
    head = "decoder.layers."
    return [dataclasses.replace(e, megatron=head + "{i}." + e.megatron[len(head):],
                                layers=tuple(layers))
            if e.megatron.startswith(head) and e.per_layer else e for e in table]


def plan(table, m: dict, prefix: str) -> list:
    """:mod:`ckpt.hf.hf_import`'s plan of ``table`` (a model's entries): ``[(megatron key,
    [saved HF names, "{i}" the layer], per_layer, fn(list of tensors) -> tensor)]`` (an entry
    with a megatron key per layer: one item per layer, its names with the layer filled in)."""
    out = []
    for e in table:
        names = [_full(e, n, prefix) for n in e.names(m)]
        fn = (lambda tensors, e=e: e.to_megatron(tensors, m))
        for i, key in e.layer_keys(m):
            if i is None:
                out.append((key, names, e.per_layer, fn))
            else:
                out.append((key, [n.format(i=i) for n in names], False, fn))
    return out


def sizes(table, prefix: str, loaded: bool = False) -> dict:
    """``{full HF name ("{i}": a layer, "{e}": an expert): ((size key, factor), ...)}`` of
    ``table``'s saved (or loaded) names, in table order."""
    return {_full(e, n, prefix): dims for e in table for n, dims in e.sizes(loaded).items()}


def shape(dims: Dims, size: dict) -> tuple:
    """The shape ``dims`` gives at the sizes ``size`` (``{size key: int}``)."""
    return tuple(size[key] * (size[n] if isinstance(n, str) else n) for key, n in dims)


def state_dict(table, tensors: dict, m: dict, vocab: int, prefix: str,
               loaded: bool = True) -> dict:
    """``{HF name: tensor}`` (transformers' model's names unless not ``loaded``) of a model's
    full logical megatron tensors ``tensors`` (per-layer ones stacked on dim 0), each layer's
    under its ``"{i}"``, vocabulary rows cut to the unpadded ``vocab``.

    Raises:
        KeyError: a megatron tensor ``table`` names is missing from ``tensors``.
    """
    out = {}
    for e in table:
        if e.layers is not None:  # one megatron key per layer
            parts = [(i, tensors[key]) for i, key in e.layer_keys(m)]
        else:
            t = tensors[e.megatron]
            parts = ([(i, t[i]) for i in range(m["num_layers"])] if e.per_layer
                     else [(None, t)])
        for i, part in parts:
            part = part[:vocab] if e.vocab else part
            out.update({_full(e, n, prefix).format(i=i): v
                        for n, v in e.to_hf(part, m, loaded).items()})
    return out


def builder(config, table, prefix: str):
    """An :attr:`ckpt.families.HFArchitecture.build` from ``config``, ``(model dict, vocab,
    token ids) -> transformers config``, and ``table``, ``model dict -> entries``: the config,
    then :func:`state_dict` with transformers' model's names under ``prefix``."""
    def build(tensors: dict, m: dict, vocab: int, ids: dict):
        cfg = config(m, vocab, ids)
        return cfg, state_dict(table(m), tensors, m, vocab, prefix)

    return build
