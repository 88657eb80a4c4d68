"""megatron-core 0.19.2's ``fully_sharded_model_space`` distributed-optimizer checkpoint format,
made to work: each data-parallel rank saves and loads its own range of every param's fp32 main
param and optimizer moments, as model-space pieces any layout can read.

megatron's ``DistributedOptimizer.sharded_param_state_fs_model_space`` describes a rank's range
with ``ShardedTensor.flattened_range``, which 0.19.2's ``ShardedTensor`` refuses
(``CheckpointingException: ShardedTensor.flattened_range is not supported``): the format cannot
save. The replacement cuts the range into boxes instead. A DP rank's range of a param is a flat
run ``[start, stop)`` of the param's model-parallel-local tensor (megatron's ``param_range`` of
the rank's ``gbuf_ranges``); cut at row boundaries it is at most a partial first row, whole
rows and a partial last row (recursively for 3-D and higher). Each box is an ordinary
``ShardedTensor`` at its global offset, built from the pieces the model's own entry gives (a
``ShardedTensor``, or a factory such as SwiGLU's fc1 halves or a GTP weight's logical pieces,
whose padding rows are never written), so the file holds the same keys and global shapes as
``fully_reshardable`` (``optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>``) and either
format's files load with either.

Cost (``docs/checkpoint-format.md``, "The distributed optimizer's state"): no all-gather; a save
writes each rank's own range (boxes alias the live state, nothing is copied); a load requests
only the rank's new range and the reader fills the live state in place.

Shapes: a box of a ``[rows, cols]`` piece is ``[1, c]`` or ``[n, cols]``; layer-stacked keys get
their layer axes as leading size-1 dims (megatron's irregular ``ShardedTensor`` path ignores
``prepend_axis_num``). dtypes: the optimizer's own (fp32).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from mcore_compat.patches import megatron_patch

FORMAT = "fully_sharded_model_space"
_PATCHED = False


def boxes(shape: tuple, start: int, stop: int) -> list[tuple[tuple, tuple, int]]:
    """The flat row-major run ``[start, stop)`` of a tensor of ``shape`` as boxes.

    Args:
        shape: the tensor's shape (at least 1-D).
        start, stop: element indices, ``0 <= start <= stop <= prod(shape)``.

    Returns:
        ``[(offset, size, flat_start)]`` in flat order, each box ``size`` elements at
        ``offset`` (both ``len(shape)``-tuples) beginning at flat index ``flat_start``; at most
        ``2 * len(shape) - 1`` boxes, none for an empty run.
    """
    if start >= stop:
        return []
    if len(shape) == 1:
        return [((start,), (stop - start,), start)]
    inner = math.prod(shape[1:])
    rest = tuple(shape[1:])
    out = []
    row = start // inner
    if start % inner:  # the tail of a first row
        end = min(stop, (row + 1) * inner)
        out += [((row, *o), (1, *s), row * inner + f)
                for o, s, f in boxes(rest, start - row * inner, end - row * inner)]
        start, row = end, row + 1
    whole = stop // inner - row
    if whole > 0 and start < stop:
        out.append(((row, *(0,) * len(rest)), (whole, *rest), row * inner))
        start, row = (row + whole) * inner, row + whole
    if start < stop:  # the head of a last row
        out += [((row, *o), (1, *s), row * inner + f)
                for o, s, f in boxes(rest, 0, stop - row * inner)]
    return out


def _offset(base: torch.Tensor, view: torch.Tensor) -> int:
    """Element offset of ``view`` in ``base``'s memory (meta tensors: storage offsets)."""
    if view.device.type == "meta":
        return view.storage_offset() - base.storage_offset()
    return (view.data_ptr() - base.data_ptr()) // base.element_size()


def _alias(flat: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """``flat[lo:hi]`` in a tensor whose storage is exactly those elements (same memory), so
    megatron's torch_dist writer does not clone it (it clones every CPU tensor whose storage is
    larger: ``FileSystemWriterAsync``'s ``_clone_or_dequantize_if_needed``)."""
    view = flat.detach()[lo:hi]
    if view.device.type != "cpu" or view.numel() == 0:
        return view
    raw = flat.detach().view(torch.uint8).numpy()[lo * flat.element_size():hi * flat.element_size()]
    return torch.from_numpy(raw).view(flat.dtype)


def model_pieces(sharded) -> list:
    """The ``ShardedTensor`` pieces of one model entry (a ``ShardedTensor``, or a factory built
    on its own ``data``, nested factories built too), each a view of the entry's ``data``."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out, todo = [], [sharded]
    while todo:
        item = todo.pop(0)
        if isinstance(item, ShardedTensorFactory):
            todo[:0] = list(nested_values(item.build()))
        elif isinstance(item, ShardedTensor):
            out.append(item)
    return out


@dataclasses.dataclass(frozen=True)
class Run:
    """One piece of a param's model entry, as a run of the param's flat local tensor.

    A copy of what the piece's ``ShardedTensor`` says (megatron's load later rewrites the
    model's own ``ShardedTensor``s in place, e.g. their ``data``, so none is kept).

    Attributes:
        suffix: the piece's key after the entry's key.
        start: the piece's first element in the flat local tensor.
        shape: the piece's local shape (without prepended axes).
        prepend: megatron's ``prepend_axis_num`` (layer axes before ``shape``).
        global_shape, global_offset: the piece's, prepended axes included.
        replica_id: the piece's (model) ``replica_id``.
    """

    suffix: str
    start: int
    shape: tuple
    prepend: int
    global_shape: tuple
    global_offset: tuple
    replica_id: object

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def piece_runs(sharded, numel: int) -> list[Run]:
    """Where each piece of a model entry lies in the param's flat local tensor.

    Args:
        sharded: the param's model entry (``ShardedTensor`` or factory; ``data`` of ``numel``
            elements: the param, or for a native-FP8 GTP param its dequantized copy).

    Returns:
        One :class:`Run` per piece.

    Raises:
        CheckpointingException: a piece that is no contiguous view of the entry's data, or whose
            key does not extend the entry's (names the key).
    """
    from megatron.core.dist_checkpointing.core import CheckpointingException

    base = sharded.data
    out = []
    for piece in model_pieces(sharded):
        data = piece.data
        if data.numel() == 0:
            continue  # an all-padding GTP shard's empty piece: nothing of the range lies there
        start = _offset(base, data)
        if (not piece.key.startswith(sharded.key) or not data.is_contiguous()
                or not 0 <= start <= start + data.numel() <= numel):
            raise CheckpointingException(
                f"{piece.key}: its piece (shape {tuple(data.shape)}, stride {data.stride()}, "
                f"at element {start}) is not a contiguous view of the {numel}-element param; "
                f"the {FORMAT} format cannot place the optimizer's ranges in it")
        out.append(Run(piece.key[len(sharded.key):], start, tuple(data.shape),
                       piece.prepend_axis_num, tuple(piece.global_shape),
                       tuple(piece.global_offset), piece.replica_id))
    return out


def range_pieces(key: str, flat: torch.Tensor, start: int, runs: list, replica: int) -> list:
    """The boxes of one optimizer tensor of a rank's range.

    Args:
        key: the tensor's key (``optimizer.state.<state>.<model key>``).
        flat: the rank's range of that tensor (1-D, ``stop - start`` elements).
        start: the range's first element in the param's flat local tensor.
        runs: :func:`piece_runs` of the param's model entry.
        replica: the data-parallel coordinate of every box's ``replica_id`` (0: this rank
            writes them; every DP rank's range is its own, see :func:`gtp_peer`).

    Returns:
        ``ShardedTensor``s, views of ``flat`` (no copy), one per box of each piece, with their
        layer axes as leading size-1 dims (``prepend_axis_num`` 0: megatron's irregular path
        ignores it).
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    stop = start + flat.numel()
    out = []
    for run in runs:
        lo, hi = max(start, run.start), min(stop, run.start + run.numel)
        n = run.prepend
        rid = run.replica_id
        rid = (*rid[:2], replica) if isinstance(rid, tuple) else replica
        for offset, size, flat_start in boxes(run.shape, lo - run.start, hi - run.start):
            at = run.start + flat_start - start
            data = _alias(flat, at, at + math.prod(size)).view((1,) * n + size)
            global_offset = (*run.global_offset[:n],
                             *(g + o for g, o in zip(run.global_offset[n:], offset)))
            out.append(ShardedTensor(key + run.suffix, data, data.dtype, tuple(data.shape),
                                     run.global_shape, global_offset, None, replica_id=rid))
    return out


def _build(start: int, runs: list, replica: int, key, data, replica_id, flattened_range):
    return range_pieces(key, data, start, runs, replica)


def _merge(start: int, runs: list, target: torch.Tensor, loaded: list) -> torch.Tensor:
    """The rank's range ``target`` (live, 1-D) with every loaded box in place and the elements
    no piece covers (GTP padding rows, vocabulary rows past the stored ones) zero."""
    built = range_pieces("", target, start, runs, 0)
    if len(built) != len(loaded):
        raise ValueError(f"expected {len(built)} loaded boxes, got {len(loaded)}")
    flat = target.detach()
    covered = []
    with torch.no_grad():
        for box, ten in zip(built, loaded):
            lo = _offset(flat, box.data)
            covered.append((lo, lo + box.data.numel()))
            if ten.data_ptr() != box.data.data_ptr() or ten.dtype != flat.dtype:
                flat[lo:lo + box.data.numel()].copy_(ten.reshape(-1))
        at = 0
        for lo, hi in sorted(covered):
            if lo > at:
                flat[at:lo].zero_()
            at = max(at, hi)
        if at < flat.numel():
            flat[at:].zero_()
    return target


def _ranges(optimizer) -> dict:
    """``{id(model param): (model param, its range on this rank)}`` from megatron's
    ``gbuf_ranges`` (params outside this rank's range are absent)."""
    out = {}
    for gbuf_range_maps in optimizer.gbuf_ranges:
        for by_bucket in gbuf_range_maps.values():
            for bucket in by_bucket:
                for model_param, ranges in bucket["param_map"].items():
                    out[id(model_param)] = (model_param, ranges["param"])
    return out


def gtp_peer(model_param) -> int:
    """This rank's place among the ranks that hold the same range of ``model_param``: its rank
    in the GTP (``gtp_remat``; experts: ``expt_gtp_remat``) group for a param GTP does not
    shard, else 0. Under GTP the distributed optimizer shards over the data-parallel group
    without the GTP ranks (megatron's "replicate group"), so every GTP peer holds the same
    range of a replicated param (a norm, a bias); only peer 0 writes it."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.generalized_tensor_parallelism import is_gtp_param

    if is_gtp_param(model_param):
        return 0
    # megatron tags a routed expert's params ``allreduce = False`` (reduced over the expert
    # data-parallel group); they have no ``is_expert_parallel`` attribute.
    expert = not getattr(model_param, "allreduce", True)
    group = (parallel_state.get_expert_gtp_weight_remat_group(check_initialized=False)
             if expert else parallel_state.get_gtp_weight_remat_group(check_initialized=False))
    return group.rank() if group is not None and group.size() > 1 else 0


def params_in_order(optimizer) -> list:
    """Every model param of the optimizer's buffers in ``param_state`` index order: buffer by
    buffer, ``param_index_map`` order, as megatron's ``fully_reshardable`` format (so a main
    param taken from the model weight lands at the same index in either format)."""
    return [p for buffer in optimizer.buffers for p in buffer.param_index_map]


def param_state(optimizer, model_sharded_state_dict) -> dict:
    """``{param index: {state key: factory}}`` of a ``DistributedOptimizer``'s own ranges, indexed
    as :func:`params_in_order` (a param with no element on this rank, or whose range holds
    only padding rows, has none).

    Each factory builds :func:`range_pieces` of one live state tensor (``param``: the fp32 main
    param; ``exp_avg``, ``exp_avg_sq``) and merges a load into it in place.

    Raises:
        ValueError: a param of this rank's range with no model entry.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    entries = {}
    sharded, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    for sh in nested_values(sharded):
        # A GTP weight's logical factory names its live param (its data may be a copy).
        live = getattr(sh, "live_param", None)
        entries[id(sh.data if live is None else live)] = sh
    instance = optimizer.distributed_optimizer_instance_id
    ranges = _ranges(optimizer)
    state = {}
    for index, model_param in enumerate(params_in_order(optimizer)):
        if id(model_param) not in ranges:
            continue  # no element on this rank (an empty entry would not come back loaded)
        state[index] = tensors = {}
        sh = entries.get(id(model_param))
        if sh is None:
            raise ValueError(f"a model param of shape {tuple(model_param.shape)} has no entry in "
                             f"the model's sharded state dict")
        rng = ranges[id(model_param)][1]
        start = rng.start
        runs = piece_runs(sh, model_param.numel())
        if not any(max(start, r.start) < min(rng.end, r.start + r.numel) for r in runs):
            del state[index]  # all padding (a GTP shard's): nothing to write or read
            continue
        # Each DP rank's range is its own; of GTP peers holding the same one, peer 0 writes.
        replica = instance + gtp_peer(model_param)
        rid = sh.replica_id
        rid = (*rid[:2], replica) if isinstance(rid, tuple) else replica
        for name, ten in optimizer._get_main_param_and_optimizer_states(model_param).items():
            if name == "step":
                continue  # megatron keeps it in the param groups
            flat = ten.view(-1)
            tensors[name] = ShardedTensorFactory(
                f"optimizer.state.{name}.{sh.key}", flat,
                functools.partial(_build, start, runs, replica),
                functools.partial(_merge, start, runs, flat), rid)
    return state


@torch.no_grad()
def load_param_state(optimizer, state: dict) -> None:
    """Put a loaded :func:`param_state` into the optimizer. Each entry is the rank's range,
    already in the live tensors unless the reader copied; an entry of the whole local param's
    size (a main param taken from the model weight, ``ckpt.adapt.optim_checkpoint``) is cut to
    the range."""
    ranges = _ranges(optimizer)
    for index, model_param in enumerate(params_in_order(optimizer)):
        if id(model_param) not in ranges:
            continue
        rng = ranges[id(model_param)][1]
        if index not in state:  # a range of padding rows only (param_state wrote none)
            for ten in optimizer._get_main_param_and_optimizer_states(model_param).values():
                if ten.dim():  # not Adam's step
                    ten.zero_()
            continue
        tensors = {}
        for name, ten in state[index].items():
            if name == "step":
                continue
            flat = ten.reshape(-1)
            tensors[name] = flat[rng.start:rng.end] if flat.numel() == model_param.numel() \
                else flat
        optimizer._set_main_param_and_optimizer_states(model_param, tensors)


@megatron_patch("optimizer.distrib_optimizer.DistributedOptimizer."
                "sharded_param_state_fs_model_space and load_parameter_state_from_fs_model_space")
def install() -> None:
    """Make megatron-core 0.19.2's ``fully_sharded_model_space`` format save and load
    (idempotent; refused on another version): :func:`param_state` replaces
    ``sharded_param_state_fs_model_space`` (its flattened ranges cannot be saved) and
    :func:`load_param_state` ``load_parameter_state_from_fs_model_space``."""
    global _PATCHED
    if _PATCHED:
        return
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original_save = DistributedOptimizer.sharded_param_state_fs_model_space
    original_load = DistributedOptimizer.load_parameter_state_from_fs_model_space

    def sharded_param_state_fs_model_space(self, model_sharded_state_dict, is_loading=False,
                                           metadata=None):
        return param_state(self, model_sharded_state_dict)

    def load_parameter_state_from_fs_model_space(self, state_dict):
        load_param_state(self, state_dict)

    sharded_param_state_fs_model_space.__wrapped__ = original_save
    load_parameter_state_from_fs_model_space.__wrapped__ = original_load
    DistributedOptimizer.sharded_param_state_fs_model_space = sharded_param_state_fs_model_space
    DistributedOptimizer.load_parameter_state_from_fs_model_space = (
        load_parameter_state_from_fs_model_space)
    _PATCHED = True
