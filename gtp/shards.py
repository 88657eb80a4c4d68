"""Row arithmetic of GTP-sharded weights: padded shards, logical rows, on-disk pieces.

Pure functions, no ``torch.distributed``: everything here is integer arithmetic on one weight's
rows, so it can be tested exhaustively and reused by the save path, the load path and the
stock-checkpoint reader. Units are **rows of dim 0** throughout (never elements or bytes).

Names used below (``docs/checkpoint-format.md`` explains the format they describe):

* ``L``   - logical TP-local dim 0 of the weight: the number of rows the non-GTP model holds on one
  TP rank (column-parallel: ``out_features / tp``; row-parallel: ``out_features``; gated fc1:
  ``2 * ffn_hidden / tp``, the gate half followed by the up half).
* ``g``   - GTP (``gtp_remat``) group size; ``r`` / ``gtp_rank`` - rank in that group.
* ``a``   - ``GTP_CONFIG.pad_for_alignment``; ``A = a * g`` - the alignment of the padded dim 0.
* ``pad`` - tail rows appended to the TP-local tensor; ``P = L + pad``; ``s = P / g`` rows per
  GTP shard. Rank ``r`` holds padded rows ``[r*s, (r+1)*s)``; padding is a tail suffix, so a
  shard's logical rows are always a *prefix* ``[0, n)`` of that shard.

Where the math comes from in megatron-core 0.19.2 (modules under ``megatron.core``):

* ``tensor_parallel.generalized_tensor_parallelism``: ``gtp_remat_shard_dim0`` and
  ``_gtp_slice_one_param``: padding and slicing (:func:`gtp_padding`,
  :func:`logical_rows`).
* ``utils``: ``make_tp_sharded_tensor_for_checkpoint`` (its GTP branch) and
  ``dist_checkpointing.mapping``: ``ShardedTensor.from_rank_offsets``: what stock
  0.19.2 writes (:func:`stock_0192_offsets`).
* ``transformer.mlp``: ``apply_swiglu_sharded_factory`` (its inner ``sh_ten_build_fn``):
  how a gated fc1 lands on disk (:func:`logical_pieces` with ``gated=True``).

How a gated (SwiGLU) fc1 is stored without GTP (``apply_swiglu_sharded_factory``): each TP
rank's local weight ``[W_k ; V_k]`` (gate rows then up rows, ``h = L/2`` each) is cut in two with
``torch.chunk`` and written as two ShardedTensors. With the default
``singleton_local_shards=False`` both go to the *same key* with global dim 0 ``2*tp*h = tp*L``:
gate of TP rank k at ``k*h``, up of TP rank k at ``(tp + k)*h``, i.e. the file holds
``[W_0; W_1; ...; W_{tp-1}; V_0; ...; V_{tp-1}]``. With ``singleton_local_shards=True`` they go to
keys ``<key>_w`` and ``<key>_v``, each of global dim 0 ``tp*h``, TP rank k at ``k*h``.

0-row pieces (an all-padding GTP shard, e.g. ``L=192, g=4, a=32`` rank 3): measured with the
torch_dist strategy on 2 gloo ranks (megatron-core 0.19.2, torch 2.14.1), a 0-row
``ShardedTensor`` (``axis_fragmentations=None``) saves and loads **only where its dim-0 offset is
not inside, and not at the start of, another chunk of the same key**:

* strictly inside another chunk: torch DCP's global-plan validation rejects the save
  ("overlapping chunks");
* at the start offset of a real chunk on another rank: DCP's ``dedup_save_plans`` treats both as
  one item (``MetadataIndex`` compares key and offset only) and may keep the empty one; the save
  then fails with "invalid fill tensor-volume" (it is not silent, but it breaks the save);
* at the end of the tensor (offset == global dim-0 size): save, load, and a stock regular-grid
  loader reading the file all work, also with several empty chunks at the same offset.

So :func:`logical_pieces` returns, for an all-padding shard, exactly one empty piece placed at
the end of the on-disk tensor (``global_offset == global_size``). Every param thus keeps a
ShardedTensor (the optimizer maps params to checkpoint keys through them), and the offset is safe.

Pieces have unequal sizes and offsets that are not multiples of their sizes, so the
ShardedTensors built from them must use explicit ``global_shape``/``global_offset`` with
``axis_fragmentations=None`` (megatron's regular-grid check ``offset % local_shape == 0`` and
``_validate_sharding_for_key``'s equal-local-shape assertion only apply to regular grids; all
ShardedTensors of one key must agree on regular vs irregular).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "Piece",
    "GTPShard",
    "gtp_padding",
    "logical_pieces",
    "logical_rows",
    "stock_0192_offsets",
]

# ``Piece.part`` values.
ALL, GATE, UP = "all", "gate", "up"
# Key suffixes megatron uses for gated fc1 halves when ``singleton_local_shards`` is set.
GATE_SUFFIX, UP_SUFFIX = "_w", "_v"


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def gtp_padding(L: int, g: int, a: int) -> tuple[int, int]:
    """Tail padding and shard size of a GTP-sharded dim 0, exactly as megatron computes them.

    Mirrors ``gtp_remat_shard_dim0`` / ``_gtp_slice_one_param``
    (``megatron.core.tensor_parallel.generalized_tensor_parallelism``): for ``a > 0``,
    ``A = a*g``, ``pad = (A - L % A) % A``; for ``a == 0`` megatron asserts ``L % g == 0`` and
    ``pad = 0``. Shard rows ``s = (L + pad) // g``.

    Args:
        L: logical TP-local dim 0, in rows (>= 1).
        g: GTP group size (>= 1).
        a: ``pad_for_alignment`` (>= 0); 0 disables padding.

    Returns:
        ``(pad, shard_rows)``: rows appended at the tail of the TP-local tensor, and rows held by
        every GTP rank (all shards are the same padded size).

    Raises:
        ValueError: ``a < 0``, ``L < 1``, ``g < 1``, or ``a == 0`` with ``L % g != 0`` (megatron's
            assert; the message names the values).
    """
    _check_int("L", L, 1)
    _check_int("g", g, 1)
    _check_int("pad_for_alignment", a, 0)
    if a > 0:
        alignment = a * g
        pad = (alignment - L % alignment) % alignment
    else:
        if L % g != 0:
            raise ValueError(
                f"gtp_padding: dim0 L={L} is not divisible by gtp size g={g} with "
                f"pad_for_alignment=0 (megatron asserts dim0 % gtp_remat_size == 0 in "
                f"gtp_remat_shard_dim0); set pad_for_alignment > 0 or make L a multiple of g"
            )
        pad = 0
    return pad, (L + pad) // g


def logical_rows(L: int, g: int, a: int, gtp_rank: int) -> tuple[int, int]:
    """Logical (unpadded) rows of the TP-local tensor that GTP rank ``gtp_rank`` holds.

    Rank ``r`` holds padded rows ``[r*s, (r+1)*s)`` (``_gtp_slice_one_param``); clipping to the
    logical extent gives ``[min(r*s, L), min((r+1)*s, L))``. These rows are the first
    ``stop - start`` rows of the rank's shard (padding is a tail suffix).

    Args:
        L, g, a: see :func:`gtp_padding`.
        gtp_rank: rank in the GTP group, ``0 <= gtp_rank < g``.

    Returns:
        ``(start, stop)`` in TP-local logical rows, ``0 <= start <= stop <= L``;
        ``start == stop == L`` for an all-padding shard.

    Raises:
        ValueError: invalid arguments (see :func:`gtp_padding`) or ``gtp_rank`` out of range.
    """
    _, s = gtp_padding(L, g, a)
    _check_int("gtp_rank", gtp_rank, 0)
    if gtp_rank >= g:
        raise ValueError(f"gtp_rank={gtp_rank} out of range for g={g}")
    return min(gtp_rank * s, L), min((gtp_rank + 1) * s, L)


@dataclass(frozen=True)
class GTPShard:
    """One GTP-sharded weight on one rank.

    Attributes:
        L: logical TP-local dim 0 in rows (gated fc1: gate + up rows, i.e. ``2*ffn/tp``).
        tp: tensor-parallel size; ``tp_rank`` in ``[0, tp)``.
        g: GTP group size; ``gtp_rank`` in ``[0, g)``.
        pad_for_alignment: megatron's ``GTP_CONFIG.pad_for_alignment`` (``a``).
        tp_axis: 0 column-parallel (TP splits dim 0), 1 row-parallel (TP splits dim 1; GTP still
            splits dim 0, which then is the full ``out_features = L``).
        gated: SwiGLU fc1 whose TP-local rows are ``[gate (L/2) ; up (L/2)]``; needs
            ``tp_axis == 0`` and even ``L``.
        singleton_local_shards: megatron's sharded_state_dict metadata flag of the same name;
            for gated fc1 it stores gate/up under ``<key>_w`` / ``<key>_v`` instead of one key.
        components: ``((key_suffix, rows), ...)`` for a column-parallel weight whose TP-local
            rows pack several tensors, each TP-sharded on its own and stored under its own key
            ``<key><key_suffix>`` (Mamba's ``in_proj``: ``.z | .x | .B | .C | .dt``; megatron's
            ``ssm.utils._split_tensor_factory``); rows are TP-local and sum to ``L``.
    """

    L: int
    tp: int = 1
    tp_rank: int = 0
    g: int = 1
    gtp_rank: int = 0
    pad_for_alignment: int = 0
    tp_axis: int = 0
    gated: bool = False
    singleton_local_shards: bool = False
    components: tuple = ()

    def __post_init__(self):
        _check_int("tp", self.tp, 1)
        _check_int("tp_rank", self.tp_rank, 0)
        if self.tp_rank >= self.tp:
            raise ValueError(f"tp_rank={self.tp_rank} out of range for tp={self.tp}")
        if self.tp_axis not in (0, 1) or isinstance(self.tp_axis, bool):
            raise ValueError(f"tp_axis must be 0 (column-parallel) or 1 (row-parallel), "
                             f"got {self.tp_axis!r}")
        if self.gated and self.tp_axis != 0:
            raise ValueError("gated (SwiGLU fc1) weights are column-parallel: tp_axis must be 0")
        if self.gated and self.L % 2:
            raise ValueError(
                f"gated weight needs an even TP-local dim 0 (gate + up), got L={self.L}")
        # validates L, g, a, gtp_rank
        logical_rows(self.L, self.g, self.pad_for_alignment, self.gtp_rank)
        if self.components:
            _check_components(self)

    @property
    def pad(self) -> int:
        """Tail rows appended to the TP-local tensor (:func:`gtp_padding`)."""
        return gtp_padding(self.L, self.g, self.pad_for_alignment)[0]

    @property
    def shard_rows(self) -> int:
        """Rows of this rank's padded GTP shard (the param's dim 0)."""
        return gtp_padding(self.L, self.g, self.pad_for_alignment)[1]

    @property
    def logical(self) -> tuple[int, int]:
        """``(start, stop)`` TP-local logical rows held by this rank (:func:`logical_rows`)."""
        return logical_rows(self.L, self.g, self.pad_for_alignment, self.gtp_rank)

    @property
    def n_logical(self) -> int:
        """Number of logical rows of this shard; they are shard rows ``[0, n_logical)``."""
        start, stop = self.logical
        return stop - start

    @property
    def global_rows(self) -> int:
        """Dim 0 of the logical on-disk tensor (per key), as the non-GTP model writes it.

        Column-parallel: ``tp*L``; row-parallel: ``L``; gated with singleton_local_shards:
        ``tp*L/2`` for each of the two keys.
        """
        if self.tp_axis == 1:
            return self.L
        if self.gated and self.singleton_local_shards:
            return self.tp * (self.L // 2)
        return self.tp * self.L


def _check_components(shard: "GTPShard") -> None:
    if shard.tp_axis != 0 or shard.gated:
        raise ValueError("components: only a column-parallel, non-gated weight packs components")
    for part in shard.components:
        if not (isinstance(part, tuple) and len(part) == 2 and isinstance(part[0], str)):
            raise ValueError(f"components: expected (key_suffix, rows) pairs, got {part!r}")
        _check_int(f"rows of component {part[0]!r}", part[1], 1)
    total = sum(rows for _, rows in shard.components)
    if total != shard.L:
        raise ValueError(f"components {shard.components} hold {total} rows, but the weight's "
                         f"TP-local dim 0 is L={shard.L}")


@dataclass(frozen=True)
class Piece:
    """A contiguous run of rows of one rank's shard and where it sits in an on-disk tensor.

    All numbers are dim-0 rows. Other dims are untouched: a row-parallel weight keeps its TP
    split on dim 1 (offset ``tp_rank * local_cols`` of ``tp * local_cols``), a column-parallel one
    has no split on dim 1.

    Attributes:
        lo, hi: rows ``[lo, hi)`` of the rank's padded local shard (the GTP param's ``data``).
        key_suffix: appended to the weight's checkpoint key ("" or megatron's ``_w``/``_v`` for
            gated fc1 with ``singleton_local_shards``).
        global_offset: dim-0 offset of the piece in the on-disk tensor.
        global_size: dim-0 size of the on-disk tensor for that key.
        part: "all", or "gate"/"up" for gated fc1 halves.
        allow_shape_mismatch: the flag the ShardedTensor carries (only ever True for what stock
            0.19.2 writes for padded non-gated weights; never for our logical pieces).
    """

    lo: int
    hi: int
    key_suffix: str
    global_offset: int
    global_size: int
    part: str = ALL
    allow_shape_mismatch: bool = False

    @property
    def rows(self) -> int:
        """``hi - lo``."""
        return self.hi - self.lo


def logical_pieces(shard: GTPShard) -> list[Piece]:
    """The logical on-disk description of one rank's GTP shard (``docs/checkpoint-format.md``,
    "The logical format").

    The union over all ``(tp_rank, gtp_rank)`` of the returned pieces tiles, for each key, the
    tensor the non-GTP model at the same TP writes, exactly once; padding rows never appear.

    * column-parallel: one piece ``[0, n)`` at ``tp_rank*L + start`` of ``tp*L``;
    * row-parallel: one piece ``[0, n)`` at ``start`` of ``L``;
    * gated fc1 (``h = L/2``): the rank's logical rows ``[start, stop)`` are split at ``h``; rows
      below ``h`` are gate rows, stored at ``tp_rank*h + row``; rows from ``h`` on are up rows,
      stored at ``tp*h + tp_rank*h + (row - h)`` (``singleton_local_shards``: keys ``_w`` / ``_v``,
      each at ``tp_rank*h + row_in_half`` of ``tp*h``). One or two pieces, gate first.
    * packed components (``shard.components``, component ``c`` at TP-local rows
      ``[o_c, o_c + n_c)``): the rank's logical rows ``[start, stop)`` meet each component in
      ``[lo, hi)``, stored under key suffix ``c`` at ``tp_rank*n_c + (lo - o_c)`` of ``tp*n_c``
      (the two-component gated case with ``singleton_local_shards``, generalised). A shard
      may straddle several components; one piece per component it meets, in row order.
    * all-padding shard (``n == 0``): one empty piece ``[0, 0)`` at ``global_offset ==
      global_size`` (the only offset torch_dist tolerates for an empty chunk of any weight;
      see the module docstring). For singleton gated it is on the ``_v`` key, for packed
      components on the last component's key.

    Args:
        shard: the weight's rows on this rank.

    Returns:
        Pieces ordered by ``lo``; local ranges are disjoint and cover ``[0, n_logical)``.
    """
    L, tp, k = shard.L, shard.tp, shard.tp_rank
    start, stop = shard.logical
    if shard.tp_axis == 1:
        return [Piece(0, stop - start, "", start, L)]  # empty shard: start == L, the end
    if shard.components:
        return _component_pieces(shard.components, tp, k, start, stop)
    if not shard.gated:
        if start == stop:  # not (k+1)*L: that is where TP rank k+1's first chunk starts
            return [Piece(0, 0, "", tp * L, tp * L)]
        return [Piece(0, stop - start, "", k * L + start, tp * L)]

    h = L // 2
    singleton = shard.singleton_local_shards
    size = shard.global_rows
    gate_suffix, up_suffix = (GATE_SUFFIX, UP_SUFFIX) if singleton else ("", "")
    up_base = k * h if singleton else tp * h + k * h
    if start == stop:
        return [Piece(0, 0, up_suffix, size, size, UP)]
    pieces = []
    if start < h:
        g_stop = min(stop, h)
        pieces.append(Piece(0, g_stop - start, gate_suffix, k * h + start, size, GATE))
    if stop > h:
        u_start = max(start, h)
        pieces.append(
            Piece(u_start - start, stop - start, up_suffix, up_base + (u_start - h), size, UP)
        )
    return pieces


def _component_pieces(components, tp: int, k: int, start: int, stop: int) -> list[Piece]:
    """:func:`logical_pieces` of a weight packing ``components`` (TP rank ``k`` of ``tp``,
    logical TP-local rows ``[start, stop)``)."""
    pieces, base = [], 0
    for suffix, n in components:
        lo, hi = max(start, base), min(stop, base + n)
        if lo < hi:
            pieces.append(Piece(lo - start, hi - start, suffix, k * n + (lo - base), tp * n))
        base += n
    if not pieces:  # all padding: at the end of the last component's tensor
        suffix, n = components[-1]
        pieces.append(Piece(0, 0, suffix, tp * n, tp * n))
    return pieces


def stock_0192_offsets(shard: GTPShard) -> list[Piece]:
    """What stock megatron-core 0.19.2 writes for this shard (the bug;
    ``docs/checkpoint-format.md``, "What megatron-core 0.19.2 writes").

    ``make_tp_sharded_tensor_for_checkpoint`` (GTP branch) builds ``from_rank_offsets`` over the
    whole **padded** shard of ``s`` rows, and ``from_rank_offsets`` sets global dim = fragments *
    local rows, offset = fragment index * local rows:

    * column-parallel: axis entry ``(0, tp_rank*g + gtp_rank, tp*g)`` -> one piece ``[0, s)`` at
      ``(tp_rank*g + gtp_rank)*s`` of ``tp*g*s = tp*(L+pad)``; ``allow_shape_mismatch`` = pad > 0.
    * row-parallel: extra axis entry ``(0, gtp_rank, g)`` -> ``[0, s)`` at ``gtp_rank*s`` of
      ``g*s = L+pad`` (TP stays on dim 1); ``allow_shape_mismatch`` = pad > 0.
    * gated fc1: ``apply_swiglu_sharded_factory`` then ``torch.chunk``s the padded shard in two
      halves ``c1 = ceil(s/2)``, ``c2 = s - c1`` as if it were a whole ``[W; V]`` TP shard, with
      fragment index ``f = tp_rank*g + gtp_rank`` of ``F = tp*g``: gate-labelled ``[0, c1)`` at
      ``f*c1`` of ``2*F*c1``, up-labelled ``[c1, s)`` at ``(F + f)*c2`` of ``2*F*c2``
      (``singleton_local_shards``: keys ``_w``/``_v``, offsets ``f*c1`` of ``F*c1`` and ``f*c2``
      of ``F*c2``). The factory rebuilds the ShardedTensors without ``allow_shape_mismatch``.
      Padding rows are written as data.

    Args:
        shard: the weight's rows on this rank.

    Returns:
        Pieces covering the whole padded shard ``[0, s)`` (padding included).

    Raises:
        ValueError: gated with odd ``s`` (``torch.chunk`` gives unequal halves with different
            global shapes, which stock megatron cannot save: ``s == 1`` yields a single chunk and
            the factory's unpacking fails; larger odd ``s`` fails the same-global-shape check);
            packed components (stock 0.19.2 gathers those and writes the logical rows).
    """
    if shard.components:
        raise ValueError("stock 0.19.2 gathers a GTP weight of packed components (Mamba's "
                         "in_proj) and writes it without padding: no per-shard offsets")
    s, pad = shard.shard_rows, shard.pad
    mismatch = pad > 0
    if shard.tp_axis == 1:
        return [Piece(0, s, "", shard.gtp_rank * s, shard.g * s, ALL, mismatch)]
    F = shard.tp * shard.g
    f = shard.tp_rank * shard.g + shard.gtp_rank
    if not shard.gated:
        return [Piece(0, s, "", f * s, F * s, ALL, mismatch)]
    if s % 2:
        raise ValueError(
            f"stock 0.19.2 cannot save a gated fc1 GTP shard of odd size s={s} "
            f"(L={shard.L}, g={shard.g}, pad_for_alignment={shard.pad_for_alignment}): "
            "apply_swiglu_sharded_factory's torch.chunk gives unequal gate/up halves"
        )
    c = s // 2
    if shard.singleton_local_shards:
        return [Piece(0, c, GATE_SUFFIX, f * c, F * c, GATE),
                Piece(c, s, UP_SUFFIX, f * c, F * c, UP)]
    return [Piece(0, c, "", f * c, 2 * F * c, GATE),
            Piece(c, s, "", (F + f) * c, 2 * F * c, UP)]
