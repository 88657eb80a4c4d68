"""Loading a checkpoint saved at any layout: the whole run state (a resume) or the model
weights alone (``checkpoint.pretrained``), through one reading path.

Both open the checkpoint the same way (:func:`_open`: the common state, the byte
verification, the vocabulary refusal, the stock GTP conversion, the stored shapes), adapt the
vocabulary rows alike and read with megatron's strict ``dist_checkpointing.load`` through
``ckpt.format.dcp_reader``, every rank agreeing on a failure before any raises (:func:`_read`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.validation import StrictHandling
# torch DCP's CheckpointException derives from BaseException, not Exception.
from torch.distributed.checkpoint.api import CheckpointException as DCPCheckpointException

from ckpt.format import dcp_reader, logical_format, safe_objects
from ckpt import stock
from gtp.collectives import any_rank_failed
from ckpt.format.records import saved_layout
from ckpt.format.safe_metadata import reused as metadata_reused
from ckpt.adapt import optim_checkpoint, optim_kinds, precision_change, vocab
from ckpt.io.errors import CheckpointError, describe, rank_errors, unreadable
from ckpt.io.integrity import (
    LOAD_FIX,
    check_loadable,
    check_shapes,
    stored_shapes,
    verify_before_load,
)
from ckpt.io.save import gc_paused
from ckpt.io.state import (
    DISTRIB_OPTIM_FORMAT,
    load_model_state,
    model_sharded_state_dict,
    rng_sharded_object,
    set_rng_state,
    sharded_state_dict,
)
from ckpt.io.chunks import model_chunks

COMMON_KEYS = ("iteration", "layout", "train_state", "opt_param_scheduler")


def load_common(root, iteration: int | None = None) -> tuple[Path, dict]:
    """The iter dir and the common (non-sharded) state of a checkpoint (default: the tracker's).

    Raises:
        CheckpointError: as :func:`ckpt.io.integrity.check_loadable`, the common
            state cannot be read or is refused unrun (a crafted object: :mod:`ckpt.format.safe_objects`,
            named), or it lacks one of :data:`COMMON_KEYS` (not written here).
    """
    path = check_loadable(root, iteration)  # also installs ckpt.format.safe_objects
    dcp_reader.install()  # a damaged data file is named (DataFileError)
    try:
        common = dist_checkpointing.load_common_state_dict(str(path))
    except (Exception, DCPCheckpointException) as exc:  # torn or foreign (a BaseException from DCP)
        refused = safe_objects.refusal(exc)
        if refused is not None:  # a crafted object (or a common.pt put there since the check)
            raise CheckpointError(f"{path} is refused: {refused}; not loaded: load another "
                                  f"checkpoint") from None
        raise unreadable(path, exc, "a megatron checkpoint's common state") from exc
    for key in COMMON_KEYS:
        if key not in common:
            raise CheckpointError(f"{path} was not written by gtp-recipes: common state lacks {key!r}")
    return path, common


@dataclass
class _Opened:
    """A checkpoint as a load reads it."""

    path: Path  # the iter dir read (the stock conversion's when converted)
    common: dict
    converted: bool  # a stock GTP checkpoint read from its conversion
    stored: dict  # {key: global shape} of its tensors
    real_vocab: int | None  # this model's real vocabulary size


def _open(path: Path, common: dict, model, layout_dict, verify: bool,
          fix: str = LOAD_FIX) -> _Opened:
    """Checks and conversion shared by every load of ``path`` (its ``common`` state read).

    A stock GTP checkpoint (megatron-core 0.19.2's padded format) is converted once into
    ``<root>/gtp_converted/`` and read from there; its RNG states are not carried over.
    """
    if verify:  # before any tensor is overwritten (checkpoint.verify_on_load)
        verify_before_load(path, fix)
    real = vocab.real_vocab_size(model)
    message = vocab.refusal(common.get(vocab.RECORD_KEY), real, path)
    if message:
        raise CheckpointError(message)
    try:
        path, converted = stock.prepare_load(path, common, layout_dict,
                                              stock_writer=not logical_format.is_installed())
    except stock.StockCheckpointError as exc:
        raise CheckpointError(str(exc)) from exc
    return _Opened(path, common, converted, stored_shapes(path), real)


def _adapt_vocab_rows(opened: _Opened, model_sd: dict) -> None:
    """Request the stored vocabulary rows (``ckpt.adapt.vocab.adapt_to_stored_rows``) in each
    chunk's entries of ``model_sd``."""
    if opened.real_vocab is None:
        return
    for sd in (model_sd.values() if "chunk0" in model_sd else (model_sd,)):
        try:
            vocab.adapt_to_stored_rows(sd, opened.stored, opened.real_vocab, opened.path)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None


def _read(state: dict, opened: _Opened, crc_checked: bool, what) -> dict:
    """megatron's strict load of ``state`` from ``opened.path`` (a collective).

    megatron's naming: "unexpected" = requested here but absent from the checkpoint (an error,
    raised before any tensor is read); "missing" = in the checkpoint but not requested (fine:
    e.g. another layout's RNG). A rank can fail alone (its own tensors, a file only it reads):
    the ranks agree before anyone raises, so no rank waits alone in a later collective.

    Raises:
        CheckpointError: on every rank: ``what(failure)`` (``what(None)`` on a rank whose own
            read succeeded) then the failure, each rank's error first for torch DCP's
            ``CheckpointException``.
    """
    failure = None
    try:
        dcp_reader.install()  # a request for a run of stored rows reads those bytes only
        with contextlib.nullcontext() if crc_checked else dcp_reader.crc_unchecked():
            loaded = dist_checkpointing.load(state, str(opened.path),
                                             strict=StrictHandling.RAISE_UNEXPECTED)
    except (Exception, DCPCheckpointException) as exc:  # noqa: BLE001 - reported below
        failure = exc
    if any_rank_failed(failure is not None):
        if failure is None:
            raise CheckpointError(f"{what(None)}: loading failed on another rank")
        detail = str(failure)
        if isinstance(failure, DCPCheckpointException):  # each rank's error first, then traces
            errors = rank_errors(failure).values()
            known = all(isinstance(e, (dcp_reader.DataFileError, CheckpointError)) or
                        safe_objects.refusal(e) is not None for e in errors)
            # Damage or a crafted object named: its message, not the traces.
            detail = describe(failure) + ("" if errors and known else "\n" + detail)
        detail = detail if len(detail) <= 2000 else detail[:2000] + " ..."
        raise CheckpointError(f"{what(failure)}: {detail}") from failure
    return loaded


@gc_paused
@metadata_reused()  # one unpickling of .metadata for the whole load
def load_checkpoint(root, model, optimizer, scheduler, layout_dict: dict,
                    iteration: int | None = None, verify: bool = True,
                    opened: tuple[Path, dict] | None = None) -> dict:
    """Load a checkpoint of ``root`` (the tracker's, or ``iteration``) into ``model``,
    ``optimizer`` and ``scheduler``.

    The checkpoint may have been saved at any layout: dist_checkpointing reshards every tensor.
    At another padded vocabulary size the real vocabulary rows load exactly and the padding rows
    are zero (``ckpt.adapt.vocab``). Each rank's RNG state is restored only when the layout is
    identical (the state is per rank).

    Args:
        layout_dict: this run's :func:`ckpt.io.state.layout_record`.
        verify: check every byte of the checkpoint first (``checkpoint.verify_on_load``;
            :func:`ckpt.verify.check_share`, each rank a share of the data files).
        opened: what :func:`load_common` returned for this checkpoint, when the caller already
            read it (it is then not read again).

    Returns:
        The checkpoint's common state (``iteration``, ``train_state``, ``layout``...).

    Raises:
        CheckpointError: incomplete or damaged checkpoint (naming the file and the item, before
            any tensor is read), another real vocabulary size (both named, before any tensor is
            read), a tensor missing from it, or a shape mismatch (naming the tensor and both
            shapes).
    """
    path, common = opened if opened is not None else load_common(root, iteration)
    ckpt = _open(path, common, model, layout_dict, verify)
    path = ckpt.path
    try:
        mine = optim_kinds.kind_of(optimizer)
        saved = optim_kinds.saved_kind(common.get("optimizer", {}))
        optim_kinds.check_same_optimizer(optimizer, common.get("optimizer", {}))
    except optim_kinds.OptimizerCheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    optim_checkpoint.prepare_for_load(optimizer)
    saved_bf16 = precision_change.saved_is_bf16(common["train_state"].get("config"), ckpt.stored)
    now_bf16 = precision_change.is_bf16(model_chunks(model))
    # Each rank requests its own ranges of a distributed optimizer's state where the file is
    # one too at the same precision; other kinds and precisions are adapted from whole tensors.
    request_type = (DISTRIB_OPTIM_FORMAT if mine == saved == optim_kinds.DISTRIBUTED
                    and saved_bf16 == now_bf16 else "fully_reshardable")
    state = sharded_state_dict(model, optimizer, is_loading=True,
                               adapt=lambda model_sd: _adapt_vocab_rows(ckpt, model_sd),
                               sharding_type=request_type)
    optim_checkpoint.match_chain_prefixes(state["optimizer"], ckpt.stored)
    check_shapes(state, path, ckpt.stored, skip_prefixes=("optimizer.state.param.",
                                                         "optimizer.state.fp32_param."))
    precision = precision_change.prepare(state, ckpt.stored, mine, saved_bf16, now_bf16)
    dropped = optim_checkpoint.prepare_request(state["optimizer"], ckpt.stored, mine, saved,
                                               optimizer, common.get("optimizer"))
    same_layout = saved_layout(common) == dict(layout_dict) and not ckpt.converted
    if same_layout:
        state["rng_state"] = rng_sharded_object()
    def what(failure) -> str:
        if failure is None:
            return f"cannot load {path}"
        absent = "unexpected" in str(failure).lower()
        return f"{path} " + ("lacks tensors this model needs" if absent else "cannot be loaded")

    # Every byte of these files was just verified: the reader need not CRC them again.
    loaded = _read(state, ckpt, crc_checked=not (verify and not ckpt.converted), what=what)
    precision_change.finish(precision, loaded)
    load_model_state(model, loaded["model"])
    # Weights first: a distributed optimizer resumed from a plain fp32 run takes its main
    # params from them.
    optimizer.load_state_dict(optim_checkpoint.with_sharding_type(optim_checkpoint.finish_load(
        optimizer, loaded["optimizer"], common["optimizer"], mine, saved, dropped), request_type))
    precision_change.after_optimizer_load(precision, optimizer, model_chunks(model))
    scheduler.load_state_dict(common["opt_param_scheduler"])
    if same_layout:
        set_rng_state(loaded["rng_state"])
    return common


def load_model_weights(path, model, verify: bool = True) -> Path:
    """Load the model tensors of ``path`` (a checkpoint root, its tracker's iteration, or an
    ``iter_*`` dir) into ``model`` (one DDP-wrapped model or a list of chunks) in place, for
    ``checkpoint.pretrained``: the reading path of :func:`load_checkpoint` without the
    optimizer, scheduler and RNG entries.

    Collective: every rank calls it. Tensors are resharded to this run's TP/PP/GTP layout by
    dist_checkpointing; at another padded vocabulary size the real rows load exactly and the
    padding rows are zero (:mod:`ckpt.adapt.vocab`). With ``verify`` every byte it reads is
    checked first (:func:`ckpt.io.integrity.verify_before_load`).

    Returns:
        The iter dir read.

    Raises:
        CheckpointError: an incomplete or foreign checkpoint, another real vocabulary size, a
            tensor the checkpoint lacks or holds in another shape (named), or a failed read.
    """
    path = Path(path)
    iteration = int(path.name[5:]) if path.name.startswith("iter_") else None
    path, common = load_common(path.parent if iteration is not None else path, iteration)
    ckpt = _open(path, common, model, None, verify, fix="load another checkpoint.pretrained")
    model_sd = model_sharded_state_dict(model)
    _adapt_vocab_rows(ckpt, model_sd)
    kept = _own_extra_states(model_sd)
    state = {"model": model_sd}
    check_shapes(state, ckpt.path, ckpt.stored)
    loaded = _read(state, ckpt, crc_checked=True,
                   what=lambda failure: f"cannot load the weights of {ckpt.path}")
    for sd, key, value in kept:  # this model's own, back into the loaded state
        (loaded["model"][sd] if sd is not None else loaded["model"])[key] = value
    load_model_state(model, loaded["model"])
    return ckpt.path


def _own_extra_states(model_sd: dict) -> list:
    """Take the layers' ``_extra_state`` entries out of the request (they are not weights:
    TransformerEngine's FP8 scaling state, None for megatron's local layers, and absent from an
    imported checkpoint) and return ``(chunk key or None, key, this model's value)`` of each."""
    out = []
    for chunk, sd in (model_sd.items() if "chunk0" in model_sd else ((None, model_sd),)):
        for key in [k for k, v in sd.items()
                    if k.endswith("._extra_state") and isinstance(v, ShardedObject)]:
            out.append((chunk, key, sd.pop(key).data))
    return out
