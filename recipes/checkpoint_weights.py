"""Load only the model weights of a checkpoint (any layout), for ``checkpoint.pretrained``.

The same reading path as a resume (:func:`recipes.checkpoint.load_checkpoint`: vocabulary
refusal and padding, legacy GTP conversion, shape check, megatron's strict load through
``gtp.dcp_reader``) without the optimizer, scheduler and RNG entries.
"""

from __future__ import annotations

from pathlib import Path

from recipes import vocab
from recipes.checkpoint import (
    CheckpointError,
    any_rank_failed,
    check_shapes,
    load_common,
    load_model_state,
    model_sharded_state_dict,
    stored_shapes,
    verify_before_load,
)


def load_model_weights(path, model, verify: bool = True) -> Path:
    """Load the model tensors of ``path`` (a checkpoint root, its tracker's iteration, or an
    ``iter_*`` dir) into ``model`` (one DDP-wrapped model or a list of chunks) in place.

    Collective: every rank calls it. Tensors are resharded to this run's TP/PP/GTP layout by
    dist_checkpointing; at another padded vocabulary size the real rows load exactly and the
    padding rows are zero (:mod:`recipes.vocab`). With ``verify`` every byte it reads is
    checked first (:func:`recipes.checkpoint.verify_before_load`).

    Returns:
        The iter dir read.

    Raises:
        CheckpointError: an incomplete or foreign checkpoint, another real vocabulary size, a
            tensor the checkpoint lacks or holds in another shape (named), or a failed read.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from torch.distributed.checkpoint.api import CheckpointException as DCPCheckpointException

    from gtp import checkpoint as gtp_checkpoint, dcp_reader, legacy

    path = Path(path)
    iteration = int(path.name[5:]) if path.name.startswith("iter_") else None
    path, common = load_common(path.parent if iteration is not None else path, iteration)
    if verify:  # before any weight is overwritten (checkpoint.verify_on_load)
        verify_before_load(path)
    real = vocab.real_vocab_size(model)
    message = vocab.refusal(common.get(vocab.RECORD_KEY), real, path)
    if message:
        raise CheckpointError(message)
    try:
        path, _ = legacy.prepare_load(path, common, None,
                                      stock_writer=not gtp_checkpoint.is_installed())
    except legacy.LegacyCheckpointError as exc:
        raise CheckpointError(str(exc)) from exc
    stored = stored_shapes(path)
    model_sd = model_sharded_state_dict(model)
    if real is not None:
        for sd in (model_sd.values() if "chunk0" in model_sd else (model_sd,)):
            try:
                vocab.adapt_to_stored_rows(sd, stored, real, path)
            except ValueError as exc:
                raise CheckpointError(str(exc)) from None
    kept = _own_extra_states(model_sd)
    state = {"model": model_sd}
    check_shapes(state, path, stored)
    failure = None
    try:
        dcp_reader.install()
        loaded = dist_checkpointing.load(state, str(path), strict=StrictHandling.RAISE_UNEXPECTED)
    except (Exception, DCPCheckpointException) as exc:  # noqa: BLE001 - reported below
        failure = exc
    if any_rank_failed(failure is not None):
        if failure is None:
            raise CheckpointError(f"cannot load the weights of {path}: loading failed on another "
                                  f"rank")
        detail = str(failure)
        detail = detail if len(detail) <= 2000 else detail[:2000] + " ..."
        raise CheckpointError(f"cannot load the weights of {path}: {detail}") from failure
    for sd, key, value in kept:  # this model's own, back into the loaded state
        (loaded["model"][sd] if sd is not None else loaded["model"])[key] = value
    load_model_state(model, loaded["model"])
    return path


def _own_extra_states(model_sd: dict) -> list:
    """Take the layers' ``_extra_state`` entries out of the request (they are not weights:
    TransformerEngine's FP8 scaling state, None for megatron's local layers, and absent from an
    imported checkpoint) and return ``(chunk key or None, key, this model's value)`` of each."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    out = []
    for chunk, sd in (model_sd.items() if "chunk0" in model_sd else ((None, model_sd),)):
        for key in [k for k, v in sd.items()
                    if k.endswith("._extra_state") and isinstance(v, ShardedObject)]:
            out.append((chunk, key, sd.pop(key).data))
    return out
