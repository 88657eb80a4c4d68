"""Reading checkpoints of the layout matrix (tests/helpers/checkpoint_matrix.py) other ways:
stock megatron-core (no gtp/ patch) reads GTP checkpoints into non-GTP models, and bad input
(another model shape or vocabulary, a truncated file, missing or foreign optimizer state) is
refused with a clear error naming it, nothing loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkpoint_matrix import check_goldens, fill_sentinel, set_golden
from optimizer_entries import opt_states
from layout_goldens import SENTINEL, build as _build, make_cfg
from multiproc import run_distributed

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def matrix(checkpoint_matrix):
    """``(root, results)`` of the session's checkpoint matrix."""
    return checkpoint_matrix


# --------------------------------------------------------------------------------------------
# Stock megatron-core (no gtp/ patch, no GTP backend) reads our GTP checkpoints.
# --------------------------------------------------------------------------------------------
STOCK_WORLD = 2


def _stock_reader_worker(root: str, cfgs: dict, sources: list) -> dict:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gtp_api

    from gtp import backend
    from ckpt.format import logical_format
    from ckpt import io as checkpoint

    assert torch.distributed.get_world_size() == STOCK_WORLD
    out = {}
    for name, cfg_yaml in cfgs.items():
        model, opt, sched, record, cfg = _build(cfg_yaml)
        # Nothing of gtp/ is active: megatron-core 0.19.2 as shipped (CPU redirects aside).
        assert not logical_format.is_installed() and not backend.is_installed()
        assert not gtp_api.HAVE_GTP
        for src in sources:
            fill_sentinel(model, opt)
            checkpoint.load_checkpoint(Path(root) / src, model, opt, sched, record)
            out[(src, name)] = check_goldens(model, opt, cfg)
    parallel_state.destroy_model_parallel()
    return out


def test_stock_megatron_loads_gtp_checkpoints_into_non_gtp_models(matrix):
    root, _ = matrix
    cfgs = {name: make_cfg("tiny_swiglu", tp, 1, None, STOCK_WORLD, "stock")
            for name, tp in (("tp1", 1), ("tp2", 2))}
    sources = ["g2a16", "g4a32", "tp2g2a16", "g2a1"]
    results = run_distributed(_stock_reader_worker, STOCK_WORLD, str(root), cfgs, sources,
                              timeout=600)
    for rank, res in enumerate(results):
        assert len(res) == len(sources) * len(cfgs)
        for (src, dst), (n, problems) in sorted(res.items()):
            assert n > 50 and not problems, f"rank {rank}: {src} -> stock {dst}: {problems[:5]}"


# --------------------------------------------------------------------------------------------
# Bad input: a clear error naming the tensor or file, and nothing loaded.
# --------------------------------------------------------------------------------------------
def _untouched(model, optimizer) -> list[str]:
    """Names of weights / moments that no longer hold the sentinel everywhere."""
    bad = [n for n, p in model.module.named_parameters() if not bool((p == SENTINEL).all())]
    for opt, p in opt_states(optimizer):
        st = opt.state[p]
        if not (bool((st["exp_avg"] == SENTINEL).all()) and float(st["step"]) == SENTINEL):
            bad.append(f"moment of {tuple(p.shape)}")
    return bad


def _bad_input_worker(root: str, good: str, cfgs: dict) -> dict:
    import shutil

    from megatron.core import parallel_state

    from ckpt import io as checkpoint
    from ckpt.io import CheckpointError

    assert torch.distributed.get_world_size() == STOCK_WORLD
    root, rank = Path(root), torch.distributed.get_rank()

    # Bad checkpoints, each written at g2/a16 (2 ranks) or derived from a good one.
    # wide: hidden 80 instead of 72; vocab: 384 vocab rows instead of 320 (only the padding
    # differs: loads); other_vocab: a 300-token tokenizer (also 320 rows: only the record differs).
    for case in ("wide", "vocab", "other_vocab"):
        model, opt, sched, record, cfg = _build(cfgs[case])
        set_golden(model, opt, cfg)
        checkpoint.save_checkpoint(root / case, 1, model, opt, sched, {}, record)
    model, opt, sched, record, cfg = _build(cfgs["g2a16"])
    checkpoint.save_checkpoint(root / "no_moments", 1, model, opt, sched, {}, record)  # fresh Adam
    set_golden(model, opt, cfg)
    for co in opt.chained_optimizers:  # the output layer's moments missing
        for group in co.optimizer.param_groups:
            for p in group["params"]:
                if p is model.module.output_layer.weight:
                    co.optimizer.state[p].clear()
    checkpoint.save_checkpoint(root / "fewer_moments", 1, model, opt, sched, {}, record)
    if rank == 0:
        shutil.copytree(good, root / "truncated")
        data = root / "truncated" / "iter_0000001" / "__1_0.distcp"
        with open(data, "r+b") as f:
            f.truncate(data.stat().st_size // 2)
    torch.distributed.barrier()

    out = {}
    for case in ("wide", "other_vocab", "no_moments", "fewer_moments", "truncated"):
        fill_sentinel(model, opt)
        try:
            checkpoint.load_checkpoint(root / case, model, opt, sched, record)
            error = None
        except CheckpointError as exc:
            error = str(exc)
        out[case] = {"error": error, "changed": _untouched(model, opt)}
    # And the good one still loads (the failures left nothing behind), unpickling its
    # .metadata once for the whole load (ckpt.format.safe_metadata.reused).
    from ckpt.format import safe_metadata

    fill_sentinel(model, opt)
    unpickle, count = safe_metadata._RestrictedUnpickler.load, [0]

    def counted(self):
        count[0] += 1
        return unpickle(self)

    safe_metadata._RestrictedUnpickler.load = counted
    try:
        checkpoint.load_checkpoint(Path(good), model, opt, sched, record)
    finally:
        safe_metadata._RestrictedUnpickler.load = unpickle
    out["good"] = check_goldens(model, opt, cfg)
    out["metadata_unpicklings"] = count[0]

    # Another padded vocabulary size: 258 rows (tp1, make_vocab_size_divisible_by=3, no GTP)
    # and 384 rows (g2/a16, 128) into 320-row models with and without GTP. The saved padding
    # rows hold goldens too, so a load that read them would show.
    model, opt, sched, record, cfg = _build(cfgs["div3"])
    set_golden(model, opt, cfg)
    checkpoint.save_checkpoint(root / "div3", 1, model, opt, sched, {}, record)
    out["padding"] = {}
    for target in ("g2a16", "tp2"):
        model, opt, sched, record, cfg = _build(cfgs[target])
        for src in ("div3", "vocab"):
            fill_sentinel(model, opt)
            try:
                checkpoint.load_checkpoint(root / src, model, opt, sched, record)
            except checkpoint.CheckpointError as exc:
                out["padding"][(src, target)] = (0, [f"load refused: {exc}"])
                continue
            out["padding"][(src, target)] = check_goldens(model, opt, cfg, real_vocab=257)
    parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def bad_inputs(matrix, tmp_path_factory):
    root, _ = matrix
    # Another tokenizer's model (300 tokens): only built, never fed, but its data paths are
    # checked before launch, so they name (empty) files that exist.
    fake = tmp_path_factory.mktemp("indexed") / "corpus"
    for suffix in (".bin", ".idx"):
        fake.with_suffix(suffix).touch()
    cfgs = {"g2a16": make_cfg("tiny_swiglu", 1, 2, 16, STOCK_WORLD),
            "wide": make_cfg("tiny_swiglu", 1, 2, 16, STOCK_WORLD, "logical",
                             "model.hidden_size=80"),
            "vocab": make_cfg("tiny_swiglu", 1, 2, 16, STOCK_WORLD, "logical",
                              "model.make_vocab_size_divisible_by=128"),
            "other_vocab": make_cfg("tiny_swiglu", 1, 2, 16, STOCK_WORLD, "logical",
                                    "data=indexed", f"data.paths=[{fake}]", "data.vocab_size=300",
                                    "data.eod_id=299"),
            "div3": make_cfg("tiny_swiglu", 1, 1, None, STOCK_WORLD, "logical",
                             "model.make_vocab_size_divisible_by=3"),
            "tp2": make_cfg("tiny_swiglu", 2, 1, None, STOCK_WORLD)}
    out_root = tmp_path_factory.mktemp("bad")
    results = run_distributed(_bad_input_worker, STOCK_WORLD, str(out_root),
                              str(root / "g2a16"), cfgs, timeout=600)
    return out_root, results


def _errors(results, case):
    errors = [r[case]["error"] for r in results]
    for rank, r in enumerate(results):
        assert r[case]["error"], f"rank {rank}: loading {case} did not fail"
        assert not r[case]["changed"], f"rank {rank}: {case}: changed {r[case]['changed'][:5]}"
    return errors


def test_other_model_shape_is_refused_naming_the_tensor(bad_inputs):
    _, results = bad_inputs
    for err in _errors(results, "wide"):
        assert "differently shaped model" in err or "Global shape mismatch" in err, err
        assert "(2, 80)" in err and "(2, 72)" in err, err


def test_other_real_vocabulary_is_refused_naming_both_sizes(bad_inputs):
    """A checkpoint of a 300-token tokenizer into a 257-token run: the same padded shapes (320
    rows), refused from the recorded real vocabulary before any tensor is read."""
    _, results = bad_inputs
    for err in _errors(results, "other_vocab"):
        assert "vocabulary of 300 tokens" in err and "has 257" in err, err


def test_other_padded_vocabulary_loads_the_real_rows_exactly(bad_inputs):
    """258 -> 320 rows (tp1 -> tp2, no GTP; tp1 -> g2/a16) and 384 -> 320 rows (g2/a16 ->
    g2/a16, tp2): weights and Adam moments of the 257 real rows exact, padding rows zero."""
    _, results = bad_inputs
    for rank, r in enumerate(results):
        assert set(r["padding"]) == {(s, d) for s in ("div3", "vocab") for d in ("g2a16", "tp2")}
        for pair, (n, problems) in sorted(r["padding"].items()):
            assert n > 50 and not problems, (rank, pair, problems[:5])


def test_truncated_tensor_file_is_refused_naming_it(bad_inputs):
    root, results = bad_inputs
    for err in _errors(results, "truncated"):
        assert "__1_0.distcp" in err and "truncated" in err, err


def test_truncated_file_is_caught_before_launch(bad_inputs):
    from ckpt.io import CheckpointError, check_loadable

    root, _ = bad_inputs
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp has \d+ bytes.*tensor '"):
        check_loadable(root / "truncated")


def test_checkpoint_without_optimizer_state_is_refused(bad_inputs):
    _, results = bad_inputs
    for err in _errors(results, "no_moments"):
        assert "lacks tensors" in err and "optimizer.state.exp_avg." in err, err


def test_checkpoint_with_another_optimizer_param_set_is_refused(bad_inputs):
    _, results = bad_inputs
    for err in _errors(results, "fewer_moments"):
        assert "lacks tensors" in err, err
        assert "optimizer.state.exp_avg.output_layer.weight" in err, err
        assert "optimizer.state.exp_avg.embedding" not in err, err


def test_good_checkpoint_loads_after_the_failures(bad_inputs):
    _, results = bad_inputs
    for rank, r in enumerate(results):
        n, problems = r["good"]
        assert n > 50 and not problems, (rank, problems[:5])


def test_a_load_unpickles_the_metadata_once(bad_inputs):
    _, results = bad_inputs
    assert [r["metadata_unpicklings"] for r in results] == [1] * len(results)


# --------------------------------------------------------------------------------------------
