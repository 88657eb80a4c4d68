"""ckpt/adapt/vocab.py without processes: the refusal message and the trimmed vocabulary pieces."""

from __future__ import annotations

import torch

from ckpt.adapt import vocab


def test_refusal_names_both_sizes_and_only_when_they_differ():
    msg = vocab.refusal(300, 257, "/ckpt/iter_0000002")
    assert "/ckpt/iter_0000002" in msg and "300 tokens" in msg and "has 257" in msg
    assert vocab.refusal(257, 257, "x") is None
    assert vocab.refusal(None, 257, "x") is None  # a checkpoint that predates the record


def test_tp_rank_piece_of_a_larger_padding_reads_only_real_rows():
    """tp4 rank 3 of a 264-row output layer (rows 198..263) loading a 258-row checkpoint of a
    257-token vocabulary: one piece of rows 198..256 in a (258, h) tensor; merge pads zeros."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    local = torch.arange(66 * 4, dtype=torch.float32).reshape(66, 4)
    entry = ShardedTensor.from_rank_offsets("output_layer.weight", local, (0, 3, 4),
                                            allow_shape_mismatch=True)
    sd = {"output_layer.weight": entry}
    assert vocab.adapt_to_stored_rows(sd, {"output_layer.weight": (258, 4)}, 257, "x") == [
        "output_layer.weight"]
    factory = sd["output_layer.weight"]
    assert factory.data is local  # optimizer tensors are matched to the param by identity
    (piece,) = factory.build()
    assert piece.global_shape == (258, 4) and piece.global_offset == (198, 0)
    assert piece.data.shape == (59, 4) and not piece.allow_shape_mismatch
    merged = factory.merge_fn([piece.data.clone()])
    assert torch.equal(merged[:59], local[:59]) and not merged[59:].any()
    # The same shapes: left alone.
    same = {"output_layer.weight": entry}
    assert vocab.adapt_to_stored_rows(same, {"output_layer.weight": (264, 4)}, 257, "x") == []
    assert same["output_layer.weight"] is entry


def test_the_fp32_optimizer_tensors_of_a_bf16_vocabulary_param_take_the_trimmed_rows():
    """A bf16 run's fp32 Adam moment (and main param) of a 320-row output layer, loading a
    258-row checkpoint: megatron applies the param's factory to the optimizer tensor
    (``make_sharded_optimizer_tensor``: ``replace(factory, data=<fp32 tensor>)``); its piece is
    that tensor's first 257 rows in fp32, and the merge pads zeros."""
    import dataclasses

    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    weight = torch.zeros(320, 4, dtype=torch.bfloat16)
    entry = ShardedTensor.from_rank_offsets("output_layer.weight", weight,
                                            allow_shape_mismatch=True)
    sd = {"output_layer.weight": entry}
    vocab.adapt_to_stored_rows(sd, {"output_layer.weight": (258, 4)}, 257, "x")
    moment = torch.arange(320 * 4, dtype=torch.float32).reshape(320, 4) / 8
    factory = dataclasses.replace(sd["output_layer.weight"],
                                  key="optimizer.state.exp_avg.output_layer.weight", data=moment)
    (piece,) = factory.build()
    assert piece.key == "optimizer.state.exp_avg.output_layer.weight"
    assert piece.dtype == piece.data.dtype == torch.float32
    assert piece.global_shape == (258, 4) and torch.equal(piece.data, moment[:257])
    merged = factory.merge_fn([piece.data.clone()])
    assert merged.dtype == torch.float32 and torch.equal(merged[:257], moment[:257])
    assert not merged[257:].any()
