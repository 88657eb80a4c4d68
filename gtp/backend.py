"""Portable GTP weight-remat backend: megatron-core 0.19.2's GTP over plain ``torch.distributed``.

megatron's GTP (``tensor_parallel/generalized_tensor_parallelism.py``) takes its collectives and a
few helpers from TransformerEngine. Without TE the module imports with ``MagicMock`` stand-ins and
``gtp_api.HAVE_GTP = False``, yet the local layers (Column/RowParallelLinear,
VocabParallelEmbedding) still wrap their weights as ``GTPShardedParam`` when the ``gtp_remat``
group is larger than 1, so the first forward fails.

:func:`install` replaces exactly those stand-ins, in megatron's module namespace, with
``torch.distributed`` implementations (on gloo built from point-to-point sends and receives,
which move the same bytes faster than gloo's ``all_gather_into_tensor`` and
``reduce_scatter_tensor``) and sets ``HAVE_GTP`` so megatron's GTP-aware paths (checkpoint
sharding, layer-wise optimizer) run as they do with TE. Everything else is megatron's own:
``GTPShardedParam``, the padding (``gtp_remat_shard_dim0``, ``_gtp_slice_one_param``),
``GTP_CONFIG``, the process groups, the mean/sum choice of the wgrad reduce-scatter
(``_prescale_wgrads_for_mean_rs``) and ``finalize_model_grads``' reduction of replicated grads
over the ``gtp_remat`` group.

Only unquantized (fp32/bf16) weights are supported: there is no FP8 without TE. :func:`install`
leaves megatron's overlap off (``GTP_CONFIG.weight_prefetch = False``,
``GTP_CONFIG.async_reduction = False``: every collective completes where it is issued); a caller
may turn it on (``recipes.model.gtp_setup`` does, outside pipeline parallelism): the collectives then
return async handles (on gloo, of the exchange's sends and receives), which megatron waits on
where it consumes the gathered weight or the reduced gradient (its prefetch chain), with the
same math.

On a machine without CUDA, also call ``mcore_compat.cpu.install()``: it redirects the
``torch.cuda`` stream calls left in megatron's GTP module (the pre-DP-sync fence in
``finalize_model_grads``) to CPU no-ops.
"""

from __future__ import annotations

import importlib
import logging
import sys
from unittest.mock import MagicMock

import torch

from mcore_compat.patches import megatron_patch
from mcore_compat.version import check_megatron_version  # noqa: F401 - gtp.backend.check_megatron_version

logger = logging.getLogger(__name__)


_GTP_MODULE = "megatron.core.tensor_parallel.generalized_tensor_parallelism"
_GTP_API_MODULE = "megatron.core.tensor_parallel.gtp_api"

# Modules that copy ``gtp_api.HAVE_GTP`` (and the names imported under it) at import time; if they
# were imported before install() they keep the TE-less values, so refresh them too.
_HAVE_GTP_COPIES = {
    "megatron.core.transformer.cuda_graphs": (
        "GTPChain", "get_ag_stream", "get_rs_stream", "set_cuda_graph_mempool", "wait_async_comms",
    ),
    "megatron.core.ssm.mamba_mixer": ("is_gtp_param",),
}

_INSTALLED = False


class _NoQuantizedTensor:
    """Stand-in for TE's quantized tensor/quantizer classes: no instance ever exists.

    megatron calls ``isinstance(x, QuantizedTensor)`` (``_strip_padding``,
    ``attach_gtp_to_presharded_module``); ``isinstance`` with a MagicMock as its class raises.
    """


class _PeerExchange:
    """Work handle of a collective built from point-to-point sends and receives.

    ``wait()`` waits for every send and receive, then runs ``finish`` (a reduce-scatter's local
    sum) once; the only method megatron calls on a GTP handle (``GTPShardHandle.wait``). Every
    handle must be waited: a pair's messages match in order, so the next exchange on the group
    would receive what an abandoned one left in flight.
    """

    def __init__(self, works: list, finish=None):
        self._works, self._finish = works, finish

    def wait(self, timeout=None) -> bool:
        for work in self._works:
            if timeout is None:
                work.wait()
            else:
                work.wait(timeout)
        self._works = []
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True


# GTP's collectives on gloo groups: point-to-point exchanges (True), or gloo's own
# all_gather_into_tensor / reduce_scatter_tensor (False: benchmarks.train_speed runs both).
GLOO_PEER_EXCHANGE = True


def _uses_peer_exchange(group) -> bool:
    """Whether GTP's collectives on ``group`` are built from point-to-point ops: on gloo (while
    :data:`GLOO_PEER_EXCHANGE`), where gloo's own ``all_gather_into_tensor`` and
    ``reduce_scatter_tensor`` made GTP training steps slower (``benchmarks.train_speed`` runs
    both); other backends keep their own collectives."""
    return GLOO_PEER_EXCHANGE and str(torch.distributed.get_backend(group)).lower() == "gloo"


def _check_buffers(kind: str, output: torch.Tensor, inp: torch.Tensor, want_rows: int) -> None:
    """Refuse, before any message is posted, buffers an exchange cannot fill exactly (gloo
    would receive into them without complaint, or raise halfway and strand the sends already
    posted).

    Raises:
        ValueError: ``output`` not contiguous, or its dtype or shape not what ``kind`` makes of
            ``inp`` (``want_rows`` rows, the rest of ``inp``'s shape).
    """
    want = (want_rows, *inp.shape[1:])
    if not output.is_contiguous() or output.dtype != inp.dtype or tuple(output.shape) != want:
        raise ValueError(
            f"gtp.backend {kind}: output {tuple(output.shape)} {output.dtype} "
            f"(contiguous: {output.is_contiguous()}); needs a contiguous {want} {inp.dtype}")


def _exchange(group, sends: dict, recvs: dict) -> list:
    """Post ``isend(sends[j])`` and ``irecv(recvs[j])`` for every peer ``j`` (group ranks).

    Every rank of the group posts its ops in the same (ascending peer) order, so each pair's
    messages match in order (gloo matches a pair's messages of one tag first in, first out).
    Returns the work handles (the tensors stay referenced by them until waited).
    """
    works = []
    for peer in sorted(sends):
        dst = torch.distributed.get_global_rank(group, peer)
        works.append(torch.distributed.isend(sends[peer], dst, group=group))
        works.append(torch.distributed.irecv(recvs[peer], dst, group=group))
    return works


def _rank_and_size(group) -> tuple[int, int]:
    return torch.distributed.get_rank(group), torch.distributed.get_world_size(group)


def _peer_all_gather(output: torch.Tensor, shard: torch.Tensor, group) -> _PeerExchange:
    """All-gather along dim 0 by point-to-point ops: this rank's ``shard`` is copied into its
    rows of ``output`` and sent to every peer, whose shards are received into their rows.
    ``output``: ``(g * shard.shape[0], *shard.shape[1:])``, contiguous, same dtype."""
    (me, world), rows = _rank_and_size(group), shard.shape[0]
    _check_buffers("all-gather", output, shard, world * rows)
    output.narrow(0, me * rows, rows).copy_(shard)
    peers = [j for j in range(world) if j != me]
    return _PeerExchange(_exchange(group, {j: shard for j in peers},
                                   {j: output.narrow(0, j * rows, rows) for j in peers}))


def _peer_reduce_scatter(output: torch.Tensor, inp: torch.Tensor, group) -> _PeerExchange:
    """Reduce-scatter (SUM) along dim 0 by point-to-point ops: rows ``j`` of ``inp`` go to group
    rank ``j``; this rank receives its rows from every peer into one temporary buffer and sums
    the g contributions in group-rank order (0, 1, ..., g-1: the same order on every rank and
    every run) into ``output`` when the handle is waited (the transfers run in the background,
    the sum at the wait). Temporary memory: (g - 1) shards, and this rank's own rows when
    ``output`` shares memory with ``inp``."""
    (me, world), rows = _rank_and_size(group), output.shape[0]
    if inp.shape[0] != world * rows:
        raise ValueError(f"gtp.backend reduce-scatter: input rows {inp.shape[0]} != group size "
                         f"{world} x output rows {rows}")
    _check_buffers("reduce-scatter", output, inp.narrow(0, 0, rows), rows)
    peers = [j for j in range(world) if j != me]
    buffer = torch.empty((len(peers) * rows, *output.shape[1:]), dtype=inp.dtype,
                         device=inp.device)
    parts = {j: inp.narrow(0, j * rows, rows) for j in range(world)}
    if output.untyped_storage().data_ptr() == inp.untyped_storage().data_ptr():
        parts[me] = parts[me].clone()  # the sum writes output before it reads this rank's rows
    received = {j: buffer.narrow(0, k * rows, rows) for k, j in enumerate(peers)}

    def finish():
        terms = [parts[me] if j == me else received[j] for j in range(world)]
        torch.add(terms[0], terms[1], out=output)
        for term in terms[2:]:
            output.add_(term)

    return _PeerExchange(_exchange(group, {j: parts[j] for j in peers}, received), finish)


def _dispatch(group, output: torch.Tensor, source: torch.Tensor, async_op: bool, peer, native):
    """``(output, handle)`` of one GTP collective: ``peer(output, source, group)`` where the
    group exchanges point to point (:func:`_uses_peer_exchange`), else the group's own
    ``native(output, source, group=group, async_op=async_op)``. The handle is None when the
    collective completed here (``async_op`` false)."""
    if not _uses_peer_exchange(group):
        return output, native(output, source, group=group, async_op=async_op)
    handle = peer(output, source, group)
    if async_op:
        return output, handle
    handle.wait()
    return output, None


def _gather_along_first_dim(
    inp, process_group, async_op=False, quantizer=None, output_tensor=None,
    external_coalescing=False,
):
    """torch.distributed twin of TE ``gather_along_first_dim`` (unquantized inputs only).

    Covers ``GTPShardedParam._all_gather_weight``: all-gather the padded dim-0 shards of the
    ``gtp_remat`` group into ``output_tensor`` (megatron's cached buffer), by point-to-point ops
    on gloo (:func:`_peer_all_gather`), by ``all_gather_into_tensor`` otherwise.
    Returns ``(gathered, work handle or None)``.
    """
    if quantizer is not None or external_coalescing:
        raise NotImplementedError(
            "gtp.backend: quantized or coalesced (grouped-expert) GTP all-gather needs "
            "TransformerEngine"
        )
    world = torch.distributed.get_world_size(process_group)
    if world == 1:
        return inp, None
    if output_tensor is None:
        output_tensor = torch.empty(
            (inp.shape[0] * world, *inp.shape[1:]), dtype=inp.dtype, device=inp.device
        )
    # detach: the shard is a Parameter; outside an autograd.Function (grad mode on) the copy
    # into the output would otherwise be recorded by autograd and rejected.
    return _dispatch(process_group, output_tensor, inp.detach().contiguous(), async_op,
                     _peer_all_gather, torch.distributed.all_gather_into_tensor)


def _reduce_scatter_along_first_dim(inp, tp_group, async_op=False, output=None):
    """torch.distributed twin of TE ``reduce_scatter_along_first_dim`` (SUM, like TE).

    Covers ``GTPShardedParam._reduce_scatter``: megatron has already pre-scaled the wgrad by
    1/g (mean) or not (``calculate_per_token_loss``: sum) and zero-padded it to the padded dim 0.
    By point-to-point ops on gloo (:func:`_peer_reduce_scatter`: summed in group-rank order), by
    ``reduce_scatter_tensor`` otherwise.
    Returns ``(this rank's shard, work handle or None)``.
    """
    world = torch.distributed.get_world_size(tp_group)
    if world == 1:
        return inp, None
    if inp.shape[0] % world:
        raise ValueError(f"reduce-scatter input dim 0 {inp.shape[0]} not divisible by {world}")
    if output is None:
        output = torch.empty(
            (inp.shape[0] // world, *inp.shape[1:]), dtype=inp.dtype, device=inp.device
        )
    return _dispatch(tp_group, output, inp.detach().contiguous(), async_op,
                     _peer_reduce_scatter, torch.distributed.reduce_scatter_tensor)


_dummy_wgrads: dict = {}


def _get_dummy_wgrad(shape, dtype, zero=False):
    """Twin of TE ``module.base.get_dummy_wgrad``: a cached wgrad placeholder per (shape, dtype).

    Covers ``GTPShardedParam._handle_megatron_grad_accum``: the real wgrad already sits in
    ``main_grad``; autograd receives this placeholder. Allocated zeroed (TE: uninitialized), so a
    stray accumulation of it can never add garbage.
    """
    key = (tuple(shape), dtype)
    buf = _dummy_wgrads.get(key)
    if buf is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"  # TE: always "cuda"
        buf = _dummy_wgrads[key] = torch.zeros(shape, dtype=dtype, device=device)
    elif zero:
        buf.zero_()
    return buf.detach()


def _not_in_fp8_recompute():
    """Twin of TE ``in_fp8_activation_recompute_phase``: no FP8 activation recompute without TE.

    The MagicMock stand-in returns a truthy mock, which would send ``all_gather_and_prefetch``
    down the recompute-chain branch.
    """
    return False


def _nvtx_noop(*args, **kwargs):
    """Twin of TE ``nvtx_range_push/pop``; the MagicMock would record every call forever."""


def _releasing_bwd_gather(all_gather_and_prefetch_bwd, gtp_module):
    """Wrap megatron's ``GTPShardedParam.all_gather_and_prefetch_bwd`` so that, with the weight
    prefetch off, the weight's backward gather buffer goes back to megatron's pool on return.

    megatron-core 0.19.2 releases a backward gather buffer (``GTPWeightCache.release`` of
    ``_ag_ticket_bwd``) only on its prefetch path (``weight_prefetch`` on and a next weight in
    the chain). In order, no weight ever returns it: each GTP weight keeps a gathered buffer of
    its own unsharded, padded shape for the life of the process, one full copy of every GTP
    weight per rank, and the step's memory does not fall with the GTP degree. Released on
    return (megatron's "coat check", as its prefetch path and its forward gathers do), the
    buffer stays valid for the dgrad GEMM that consumes it (in order, nothing gathers again
    before that GEMM has run) and the next weight of the same padded shape and dtype reuses
    it: one buffer per (shape, dtype) instead of one per weight. Same values, bit for bit.
    """

    def wrapped(self, nvtx_label=None):
        result = all_gather_and_prefetch_bwd(self, nvtx_label=nvtx_label)
        if not gtp_module.GTP_CONFIG.weight_prefetch:
            cache = gtp_module.get_global_GTP_cache()
            for w in self._weights:
                cache.release(w._ag_ticket_bwd)
        return result

    wrapped.__wrapped__ = all_gather_and_prefetch_bwd
    wrapped.__doc__ = all_gather_and_prefetch_bwd.__doc__
    return wrapped


@megatron_patch("tensor_parallel.generalized_tensor_parallelism internals (gather/reduce-scatter, "
                "TE stand-ins, GTPShardedParam.all_gather_and_prefetch_bwd, GTP_CONFIG)")
def install() -> bool:
    """Make megatron-core 0.19.2's GTP weight remat run without TransformerEngine.

    Patches, in ``megatron.core.tensor_parallel.generalized_tensor_parallelism``:
    ``gather_along_first_dim``, ``reduce_scatter_along_first_dim`` (torch.distributed),
    ``get_dummy_wgrad``, ``in_fp8_activation_recompute_phase``, ``nvtx_range_push/pop`` and the
    TE quantized classes used in isinstance checks; wraps
    ``GTPShardedParam.all_gather_and_prefetch_bwd`` to return its gather buffer to megatron's
    pool when the weight prefetch is off (:func:`_releasing_bwd_gather`); sets
    ``GTP_CONFIG.weight_prefetch`` and ``GTP_CONFIG.async_reduction`` to False; sets
    ``gtp_api.HAVE_GTP = True`` (and refreshes the modules that copied it at import).

    Returns:
        True when the backend is active after the call; False when TransformerEngine is usable
        for GTP (megatron's ``HAVE_TE``), in which case nothing is patched and TE stays in charge.

    Raises:
        RuntimeError: megatron-core is not 0.19.2, or the TE stand-ins are not the expected
            MagicMocks (something else already replaced them).
    """
    global _INSTALLED
    if _INSTALLED:
        return True
    gtp = importlib.import_module(_GTP_MODULE)
    if gtp.HAVE_TE:
        logger.info("gtp.backend: TransformerEngine is usable for GTP; portable backend not used")
        return False
    for name in ("gather_along_first_dim", "reduce_scatter_along_first_dim", "get_dummy_wgrad"):
        if not isinstance(getattr(gtp, name), MagicMock):
            raise RuntimeError(f"gtp.backend: {_GTP_MODULE}.{name} is not megatron's TE stand-in")

    gtp.gather_along_first_dim = _gather_along_first_dim
    gtp.reduce_scatter_along_first_dim = _reduce_scatter_along_first_dim
    gtp.get_dummy_wgrad = _get_dummy_wgrad
    gtp.in_fp8_activation_recompute_phase = _not_in_fp8_recompute
    gtp.nvtx_range_push = gtp.nvtx_range_pop = _nvtx_noop
    for name in ("QuantizedTensor", "MXFP8TensorStorage", "NVFP4TensorStorage", "MXFP8Quantizer",
                 "_NVFP4AllGatherAsyncHandle"):
        setattr(gtp, name, _NoQuantizedTensor)
    # In order until a caller asks for megatron's overlap (module docstring).
    gtp.update_gtp_config(weight_prefetch=False, async_reduction=False)
    gtp.GTPShardedParam.all_gather_and_prefetch_bwd = _releasing_bwd_gather(
        gtp.GTPShardedParam.all_gather_and_prefetch_bwd, gtp)

    # HAVE_GTP gates megatron's GTP-aware checkpoint path (transformer/utils.py
    # make_sharded_tensors_for_checkpoint, utils.py make_tp_sharded_tensor_for_checkpoint) and the
    # layer-wise optimizer's replica fold; those read it from gtp_api at call time.
    api = importlib.import_module(_GTP_API_MODULE)
    api.HAVE_GTP = True
    for module_name, names in _HAVE_GTP_COPIES.items():
        module = sys.modules.get(module_name)
        if module is not None:
            module.HAVE_GTP = True
            for name in names:
                setattr(module, name, getattr(api, name))
    _INSTALLED = True
    return True


def is_installed() -> bool:
    """Whether :func:`install` has activated the backend in this process."""
    return _INSTALLED
