"""Real and padded vocabulary rows in checkpoints.

The embedding and output layer hold the *padded* vocabulary (``recipes.model.shapes.padded_vocab_size``:
a multiple of ``lcm(make_vocab_size_divisible_by, tp)``), always real rows first and padding rows
after them, at every TP and GTP layout. Padding rows never reach the loss
(``recipes.model.build.mask_padded_vocab``), so they carry no information:

* a checkpoint records the real vocabulary size (common-state key :data:`RECORD_KEY`); loading
  it with another real vocabulary (another tokenizer, another ``data.vocab_size``) is refused,
  naming both sizes, before any tensor is read;
* loading it at another padded size (another ``make_vocab_size_divisible_by``, or a TP size that
  changes the padding) reads the real rows exactly, weights and Adam moments alike, and sets the
  padding rows of the new model to zero (:func:`adapt_to_stored_rows`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

RECORD_KEY = "vocab_size"
# Model state-dict keys of the weights with one row per (padded) vocabulary entry.
VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


def real_vocab_size(model) -> Optional[int]:
    """The tokenizer's vocabulary size recorded on the model by ``recipes.model.build.build_model``
    (looked up through DDP / Float16Module wrappers and lists of pipeline chunks); None when
    absent."""
    if isinstance(model, (list, tuple)):
        model = model[0] if model else None
    while model is not None:
        if hasattr(model, "real_vocab_size"):
            return int(model.real_vocab_size)
        model = getattr(model, "module", None)
    return None


def refusal(stored: Optional[int], current: Optional[int], where) -> Optional[str]:
    """The error message when a checkpoint's real vocabulary differs from this run's, else None.

    Args:
        stored: the checkpoint's recorded real vocabulary size (None: not recorded).
        current: this run's tokenizer vocabulary size.
        where: the checkpoint path, for the message.
    """
    if stored is None or current is None or int(stored) == int(current):
        return None
    return (f"{where} was trained with a vocabulary of {stored} tokens but this run's tokenizer "
            f"has {current} (data.tokenizer / data.vocab_size): token ids would mean other "
            f"tokens; use the tokenizer the checkpoint was trained with")


def _trim_piece(piece, stored_rows: int, real: int):
    """``piece`` (a ShardedTensor over the padded vocab, no GTP) cut to its real rows, placed in
    a tensor of ``stored_rows`` rows."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    axis = piece.data.dim() - 2  # vocab rows: the first non-layer axis
    rows = piece.data.shape[axis]
    first = piece.global_offset[axis]
    keep = max(0, min(rows, real - first))
    data = piece.data.narrow(axis, 0, keep)
    global_shape = list(piece.global_shape)
    global_shape[axis] = stored_rows
    offset = list(piece.global_offset)
    offset[axis] = min(first, real)
    return ShardedTensor(piece.key, data, data.dtype, tuple(data.shape), tuple(global_shape),
                         tuple(offset), None, replica_id=piece.replica_id)


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    axis = tensor.dim() - 2
    missing = rows - tensor.shape[axis]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[axis] = missing
    return torch.cat([tensor, tensor.new_zeros(shape)], dim=axis)


def _trimming_factory(entry, stored_rows: int, real: int):
    """``entry`` made to load only the real rows from a tensor of ``stored_rows`` rows, the rest
    of the model's rows zero.

    ``entry`` is megatron's ShardedTensor (no GTP: wrapped in a ShardedTensorFactory) or
    ``ckpt.format.logical_format``'s logical GTP factory (:func:`ckpt.format.logical_format.with_stored_rows`, which
    merges into the live tensor in place). Megatron applies the factory to every optimizer
    tensor of the param too (``dist_checkpointing.optimizer.make_sharded_optimizer_tensor``).

    Raises:
        TypeError: any other kind of entry.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from ckpt.format.logical_format import LogicalGTPFactory, with_stored_rows

    if isinstance(entry, LogicalGTPFactory):
        return with_stored_rows(entry, stored_rows, real)
    if not isinstance(entry, ShardedTensor):
        raise TypeError(f"{entry.key}: cannot limit the vocabulary rows of a {type(entry).__name__}")

    def build(key, data, replica_id, flattened_range):
        # data: the param, or an optimizer tensor of it (fp32 moments of a bf16 param)
        piece = dataclasses.replace(entry, key=key, data=data, dtype=data.dtype,
                                    replica_id=replica_id)
        return [_trim_piece(piece, stored_rows, real)]

    def merge(loaded):
        return _pad_rows(loaded[0], entry.data.shape[entry.data.dim() - 2])

    return ShardedTensorFactory(entry.key, entry.data, build, merge, entry.replica_id, None)


def adapt_to_stored_rows(model_sd: dict, stored_shapes: dict, real: int, where) -> list[str]:
    """Make the vocabulary entries of ``model_sd`` load from a checkpoint of another padded size.

    Must run before the optimizer's sharded state dict is derived from ``model_sd`` (so the Adam
    moments follow). Entries whose stored rows equal the model's are left alone.

    Args:
        model_sd: the model's sharded state dict (changed in place).
        stored_shapes: ``{key: global shape}`` of the checkpoint (layer axes excluded for
            these keys: the vocabulary weights are not layer-stacked).
        real: the real vocabulary size (this run's tokenizer, equal to the checkpoint's record).
        where: the checkpoint path, for messages.

    Returns:
        The keys adapted.

    Raises:
        ValueError: the checkpoint holds fewer rows than the real vocabulary.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    adapted = []
    for sd_key, entry in list(model_sd.items()):
        # The stored name, not the dict key: on the last pipeline stage of a tied model the
        # output layer's entry (dict key ``output_layer.weight``) reads the embedding's tensor
        # (megatron's ``tie_embeddings_and_output_weights_state_dict``).
        key = getattr(entry, "key", None)
        if key not in VOCAB_KEYS or key not in stored_shapes:
            continue
        stored_rows = int(stored_shapes[key][0])
        model_rows = (entry.global_shape[0] if isinstance(entry, ShardedTensor)
                      else entry.spec.shard.global_rows)
        if stored_rows == model_rows:
            continue
        if stored_rows < real:
            raise ValueError(f"{where}: {key} holds {stored_rows} vocabulary rows, fewer than "
                             f"the {real} tokens of this run's tokenizer")
        model_sd[sd_key] = _trimming_factory(entry, stored_rows, real)
        adapted.append(key)
    return adapted
