"""Single-process unit tests of ckpt/format/logical_format.py and logical_factory.py: the
patch's install and uninstall, and the sharded-tensor factory's pieces on worked cases."""

from __future__ import annotations

import pytest
import torch

from layout_goldens import SENTINEL


@pytest.fixture
def patched():
    """ckpt.format.logical_format installed for the test, uninstalled after (the pytest process is shared)."""
    from ckpt.format import logical_format

    was = logical_format.is_installed()
    logical_format.install()
    try:
        yield logical_format
    finally:
        if not was:
            logical_format.uninstall()


def test_install_replaces_megatron_functions_everywhere_and_uninstall_restores():
    import megatron.core.dist_checkpointing.optimizer as dopt
    import megatron.core.optimizer.optimizer as mopt
    import megatron.core.tensor_parallel.layers as layers
    import megatron.core.transformer.mlp as mlp
    import megatron.core.utils as mutils

    from ckpt.format import logical_format

    logical_format.uninstall()
    originals = (mutils.make_tp_sharded_tensor_for_checkpoint, mlp.apply_swiglu_sharded_factory,
                 dopt.get_param_id_to_sharded_param_map)
    assert all(f.__module__.startswith("megatron.core") for f in originals)
    logical_format.configure("logical")
    try:
        assert logical_format.is_installed()
        for module in (mutils, layers):
            assert module.make_tp_sharded_tensor_for_checkpoint is \
                logical_format.make_tp_sharded_tensor_for_checkpoint
        assert mlp.apply_swiglu_sharded_factory is logical_format.apply_swiglu_sharded_factory
        for module in (dopt, mopt):
            assert module.get_param_id_to_sharded_param_map is \
                logical_format.get_param_id_to_sharded_param_map
        logical_format.install()  # idempotent
    finally:
        logical_format.configure("stock")
    assert not logical_format.is_installed()
    assert (mutils.make_tp_sharded_tensor_for_checkpoint, mlp.apply_swiglu_sharded_factory,
            dopt.get_param_id_to_sharded_param_map) == originals
    assert layers.make_tp_sharded_tensor_for_checkpoint is originals[0]
    assert mopt.get_param_id_to_sharded_param_map is originals[2]
    with pytest.raises(ValueError, match="checkpoint.format='padded'.*logical.*stock"):
        logical_format.configure("padded")


def _spec(L, tp, tp_rank, g, gtp_rank, a, tp_axis=0, gated=False, cols=3, prepend=((0, 1, 2),)):
    from ckpt.format.logical_factory import LogicalSpec
    from gtp.shards import GTPShard

    shard = GTPShard(L=L, tp=tp, tp_rank=tp_rank, g=g, gtp_rank=gtp_rank,
                     pad_for_alignment=a, tp_axis=tp_axis, gated=gated)
    return LogicalSpec(shard, prepend, cols)


def test_factory_pieces_of_the_spec_worked_case():
    """Spec section 3: tp=2, g=2, L=10, a=3 (pad 2, shard 6). Hand-computed: TP rank k, GTP
    rank r holds logical rows [6r, min(6r+6, 10)) of TP shard k, i.e. full rows 10k + those."""
    from ckpt.format.logical_factory import make_factory

    want = {(0, 0): (0, 6), (0, 1): (6, 4), (1, 0): (10, 6), (1, 1): (16, 4)}
    for (k, r), (offset, rows) in want.items():
        spec = _spec(10, 2, k, 2, r, 3)
        shard = torch.arange(6 * 3, dtype=torch.float32).reshape(6, 3) + 100
        factory = make_factory(shard, "w", spec, replica_id=(0, 0, 0))
        assert factory.live_param is shard and factory.data is shard
        (piece,) = factory.build()
        assert piece.global_shape == (2, 20, 3) and piece.global_offset == (1, offset, 0)
        assert piece.axis_fragmentations is None and not piece.allow_shape_mismatch
        assert piece.data.shape == (1, rows, 3)
        assert piece.data.data_ptr() == shard.data_ptr()  # a view: no copy
        merged = factory.merge_fn([piece.data.clone()])
        assert torch.equal(merged[:rows], shard[:rows]) and not merged[rows:].any()


def test_factory_all_padding_shard_and_row_parallel():
    from ckpt.format.logical_factory import make_factory

    # L=72, g=4, a=32: rank 3 holds only padding -> one empty piece at the end of the tensor.
    spec = _spec(72, 1, 0, 4, 3, 32, tp_axis=1, cols=5)
    (piece,) = make_factory(torch.ones(32, 5), "w", spec, 0).build()
    assert piece.data.shape == (1, 0, 5)
    assert piece.global_shape == (2, 72, 5) and piece.global_offset == (1, 72, 0)
    # Row-parallel at tp2: the TP split stays on dim 1.
    spec = _spec(72, 2, 1, 4, 2, 32, tp_axis=1, cols=5)
    (piece,) = make_factory(torch.ones(32, 5), "w", spec, 0).build()
    assert piece.global_shape == (2, 72, 10) and piece.global_offset == (1, 64, 5)
    assert piece.data.shape == (1, 8, 5)


def test_factory_gated_fc1_straddling_gate_and_up():
    """tp2 x g2/a16, L=200 (gate 100 + up 100 rows per TP rank), pad 24, shard 112: GTP rank 0
    of TP rank 1 holds gate rows 0-99 and up rows 0-11 of TP rank 1; the file is
    [W_0; W_1; V_0; V_1] (400 rows): gate at 100, up at 300."""
    from ckpt.format.logical_factory import make_factory

    spec = _spec(200, 2, 1, 2, 0, 16, gated=True, cols=2)
    shard = torch.arange(112 * 2, dtype=torch.float32).reshape(112, 2)
    gate, up = make_factory(shard, "fc1", spec, 0).build()
    assert (gate.global_offset, gate.data.shape) == ((1, 100, 0), (1, 100, 2))
    assert (up.global_offset, up.data.shape) == ((1, 300, 0), (1, 12, 2))
    assert gate.global_shape == up.global_shape == (2, 400, 2)
    spec = _spec(200, 2, 1, 2, 1, 16, gated=True, cols=2)  # rank 1: up rows 12-99 only
    (up,) = make_factory(shard, "fc1", spec, 0).build()
    assert (up.global_offset, up.data.shape) == ((1, 312, 0), (1, 88, 2))


def test_optimizer_lookup_uses_the_back_link_and_refuses_a_miss(patched):
    """megatron's lookup matches by id(entry.data) and skips a miss silently; ours follows the
    entry's back-link and raises, naming the param."""
    import megatron.core.dist_checkpointing.optimizer as dopt
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    stock = patched._ORIGINALS["get_param_id_to_sharded_param_map"]
    a, b = torch.nn.Parameter(torch.ones(4, 3)), torch.nn.Parameter(torch.ones(6, 3))
    b._debug_name = "decoder.layers.0.mlp.linear_fc2.weight"
    entry_a = ShardedTensor.from_rank_offsets("a", a)
    # An entry whose data is a new tensor (as a trimmed view or a dequantized copy would be).
    spec = _spec(6, 1, 0, 1, 0, 0, cols=3, prepend=())
    entry_b = patched.make_factory(b, "b", spec, 0)
    entry_b.data = b.detach().clone()
    assert set(stock({"a": entry_a, "b": entry_b}, [a, b])) == {0}  # b silently dropped
    assert set(dopt.get_param_id_to_sharded_param_map({"a": entry_a, "b": entry_b}, [a, b])) == {0, 1}
    with pytest.raises(patched.GTPCheckpointError, match=r"1 optimizer params.*linear_fc2.*\(6, 3\)"):
        dopt.get_param_id_to_sharded_param_map({"a": entry_a}, [a, b])


def test_factory_save_pieces_alias_the_shard_without_a_storage_to_clone(tmp_path):
    """megatron's torch_dist writer clones every CPU tensor whose storage is larger than the
    tensor (``torch.save`` writes whole storages). A trimmed piece of a padded shard shares the
    shard's memory yet owns a storage of exactly its rows: the writer neither clones it nor writes
    the padding rows."""
    from ckpt.format.logical_factory import make_factory

    # tp2 x g2/a16, L=200, TP rank 1: GTP rank 0 holds gate rows 0-99 and up rows 0-11 (two
    # pieces of the 112-row shard); GTP rank 1 holds up rows 12-99 and 24 padding rows.
    shard = torch.randn(112, 64).to(torch.bfloat16)
    row_bytes = 64 * shard.element_size()
    for gtp_rank, los in ((0, (0, 100)), (1, (0,))):
        pieces = make_factory(shard, "fc1", _spec(200, 2, 1, 2, gtp_rank, 16, gated=True, cols=64),
                               0).build()
        assert len(pieces) == len(los)
        for piece, lo in zip(pieces, los):
            data = piece.data
            rows = data.shape[1]
            assert data.untyped_storage().nbytes() == data.numel() * data.element_size()
            assert data.data_ptr() == shard.data_ptr() + lo * row_bytes  # no copy
            assert torch.equal(data[0], shard[lo:lo + rows])
            torch.save(data, tmp_path / "piece.pt")
            torch.save(data.clone(), tmp_path / "copy.pt")  # what the writer's clone writes
            torch.save(shard[lo:lo + rows], tmp_path / "view.pt")  # a plain view: whole storage
            size = {n: (tmp_path / f"{n}.pt").stat().st_size for n in ("piece", "copy", "view")}
            # (a few bytes of zip metadata differ)
            assert abs(size["piece"] - size["copy"]) < 64, size
            assert size["view"] - size["piece"] > (112 - rows) * row_bytes - 64, size


def test_factory_merge_fills_the_live_shard_in_place():
    """Load: the reader fills the pieces (views of the live shard); merge zeroes only the
    padding rows and returns the live shard itself. Pieces read into other tensors are copied
    into it; an optimizer tensor (megatron's ``dataclasses.replace(factory, data=...)``) merges
    into its own tensor, also after megatron's ``without_data()``; without a target the merge
    returns a new zero-padded shard."""
    import dataclasses

    from ckpt.format.logical_factory import _merge_pieces, make_factory

    spec = _spec(200, 2, 1, 2, 1, 16, gated=True, cols=2)  # up rows 12-99 (88 rows), pad 24
    want = torch.zeros(112, 2)
    want[:88] = torch.arange(88 * 2, dtype=torch.float32).reshape(88, 2) + 1

    def check(merged, target):
        assert merged.data_ptr() == target.data_ptr()
        assert torch.equal(target, want)

    live = torch.nn.Parameter(torch.full((112, 2), SENTINEL))
    factory = make_factory(live, "fc1", spec, 0)
    (piece,) = factory.build()
    piece.data.copy_(want[:88].view(1, 88, 2))  # as the reader does
    check(factory.merge_fn([piece.data]), live)

    moment = torch.full((112, 2), SENTINEL)
    optim_factory = dataclasses.replace(factory, data=moment)
    check(optim_factory.merge_fn([want[:88].clone().view(1, 88, 2)]), moment)

    # megatron's load_preprocess drops the factories' data before it loads and merges.
    live.data.fill_(SENTINEL)
    check(factory.without_data().merge_fn([want[:88].clone().view(1, 88, 2)]), live)

    fresh = _merge_pieces(spec, [want[:88].clone().view(1, 88, 2)])  # no target: a new shard
    assert fresh.data_ptr() not in (live.data_ptr(), moment.data_ptr())
    assert torch.equal(fresh, want)


def test_stored_rows_limit_reads_only_the_kept_rows():
    """A vocabulary weight of 320 padded rows (tp1, g2, GTP rank 1 holds rows 160-319) read
    from a file of 258 rows of which 257 are real: one piece of rows 160-256 at offset 160 of
    258; merge fills them in place and zeroes the rest. With every row of the rank past the
    kept ones, one empty piece at the end of the stored tensor (as an all-padding shard)."""
    from ckpt.format.logical_factory import GTPCheckpointError, make_factory, with_stored_rows

    spec = _spec(320, 1, 0, 2, 1, 16, cols=2, prepend=())
    live = torch.nn.Parameter(torch.full((160, 2), SENTINEL))
    factory = with_stored_rows(make_factory(live, "output_layer.weight", spec, 0), 258, 257)
    (piece,) = factory.build()
    assert (piece.global_shape, piece.global_offset, tuple(piece.data.shape)) == (
        (258, 2), (160, 0), (97, 2))
    assert piece.data.data_ptr() == live.data_ptr()
    loaded = torch.arange(97 * 2, dtype=torch.float32).reshape(97, 2) + 1
    piece.data.copy_(loaded)  # as the reader does
    merged = factory.merge_fn([piece.data])
    assert merged.data_ptr() == live.data_ptr()
    assert torch.equal(live[:97], loaded) and torch.equal(live[97:], torch.zeros(63, 2))
    # An optimizer tensor of the param merges into its own tensor, cut the same way.
    moment = torch.full((160, 2), SENTINEL)
    import dataclasses

    optim_factory = dataclasses.replace(factory, data=moment)
    assert optim_factory.merge_fn([loaded.clone()]).data_ptr() == moment.data_ptr()
    assert torch.equal(moment[:97], loaded) and not moment[97:].any()

    (empty,) = with_stored_rows(make_factory(live, "k", spec, 0), 258, 100).build()
    assert (empty.global_offset[0], empty.global_shape[0], empty.data.shape[0]) == (258, 258, 0)
    with pytest.raises(GTPCheckpointError, match="kept_rows=300 not within"):
        with_stored_rows(make_factory(live, "k", spec, 0), 258, 300)
    gated = _spec(200, 2, 1, 2, 1, 16, gated=True, cols=2, prepend=())
    with pytest.raises(GTPCheckpointError, match="column-parallel, non-gated"):
        with_stored_rows(make_factory(torch.zeros(112, 2), "fc1", gated, 0), 200, 100)


def test_native_fp8_weight_goes_through_a_dequantized_copy(monkeypatch):
    """gtp.fp8_param_gather keeps GTP weights in FP8 (TransformerEngine, not here: a stand-in
    marks the param as FP8). The pieces are cut from megatron's dequantized copy, a load fills
    that copy (the model's load_state_dict then quantizes it into the param), and the
    optimizer still finds the param's entry through the back-link."""
    import megatron.core.fp8_utils as fp8_utils
    from megatron.core.tensor_parallel import generalized_tensor_parallelism as gtp_mod

    from ckpt.format.logical_format import get_param_id_to_sharded_param_map
    from ckpt.format.logical_factory import high_precision_data, make_factory

    live = torch.nn.Parameter(torch.full((112, 2), 3.0))
    copies = []
    monkeypatch.setattr(fp8_utils, "is_float8tensor", lambda t: t is live)
    monkeypatch.setattr(gtp_mod, "dequantize_gtp_native_fp8",
                        lambda t: copies.append(t.detach().clone()) or copies[-1])
    plain = torch.nn.Parameter(torch.zeros(112, 2))
    assert high_precision_data(plain) is plain and not copies
    data = high_precision_data(live)
    assert copies == [data] and data.data_ptr() != live.data_ptr()

    spec = _spec(200, 2, 1, 2, 1, 16, cols=2, prepend=())  # rows 0-87 logical, pad 24
    factory = make_factory(live, "fc2", spec, 0, data=data)
    assert factory.live_param is live and factory.data is data
    (piece,) = factory.build()
    assert piece.data.data_ptr() == data.data_ptr()
    piece.data.fill_(7.0)
    merged = factory.merge_fn([piece.data])
    assert merged.data_ptr() == data.data_ptr()
    assert bool((data[:88] == 7).all()) and not data[88:].any()
    assert bool((live == 3).all())  # the FP8 param itself changes only in load_state_dict
    assert get_param_id_to_sharded_param_map({"fc2": factory}, [live]) == {0: factory}


# --------------------------------------------------------------------------------------------
# Pipeline parallelism and the distributed optimizer.
# --------------------------------------------------------------------------------------------
