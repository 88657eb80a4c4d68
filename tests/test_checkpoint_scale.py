"""What a save and a load cost each rank with the distributed optimizer (issue 55).

A world of 4 at dp4 (fp32, ``optim.use_distributed_optimizer=true``, the default
``fully_sharded_model_space`` format) saves the goldens of ``layout_goldens`` and loads them
back into targets pre-filled with a sentinel. Checked on every rank:

* no gather: megatron's ``DistributedOptimizer.get_parameter_state_dp_zero`` (the
  ``fully_reshardable`` format's all-gather of the whole model-parallel group's state) is never
  called, and every optimizer tensor the save writes is a view of the rank's live state (no
  copy of its range either);
* writes spread: each rank's data file within 1.25x of the mean (megatron's format: rank 0
  wrote everything);
* reads: the tensor bytes each rank reads are at most 1.1x what it keeps (its weights and its
  own range of main params and moments; megatron's format: the whole optimizer state on every
  rank), counted at the data reader (:mod:`ckpt.format.dcp_reader`);
* the load is exact (``layout_goldens.check``).

The same checks with ``optim.distrib_optim_sharding_type=fully_reshardable`` (today's format
before issue 55) fail on the gather, the writes and the reads.
"""

from __future__ import annotations

import pytest

from multiproc import run_distributed

pytestmark = pytest.mark.multiprocess

WORLD = 4
# 4 layers: the weights come in pieces small enough for the fully parallel save to balance.
MODEL = ("model.num_layers=4", "optim.use_distributed_optimizer=true")


def _live_ranges(optimizer) -> list[tuple[int, int]]:
    """[start, end) byte addresses of every live fp32 main param and moment of this rank."""
    from optimizer_entries import main_param_entries

    out = []
    for opt, _, main, _ in main_param_entries(optimizer):
        state = opt.state[main]
        for t in (main, state["exp_avg"], state["exp_avg_sq"]):
            out.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
    return out


def _aliasing(model, optimizer) -> tuple[int, int]:
    """(optimizer tensors a save writes, how many are not views of the live state)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from ckpt.io.state import sharded_state_dict

    state = sharded_state_dict(model, optimizer, is_loading=False)
    apply_factories(state)
    live = _live_ranges(optimizer)
    boxes = [t for t in nested_values(state["optimizer"]) if isinstance(t, ShardedTensor)]
    outside = [t.key for t in boxes if t.data.numel() and not any(
        lo <= t.data.data_ptr() and t.data.data_ptr() + t.data.numel() * 4 <= hi
        for lo, hi in live)]
    return len(boxes), len(outside)


def _kept_bytes(model, optimizer) -> int:
    """Tensor bytes this rank keeps: its weights and its range of each main param and moment."""
    from optimizer_entries import main_param_entries

    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    state = sum(3 * main.numel() * 4 for _, _, main, _ in main_param_entries(optimizer))
    return weights + state


def _worker(root: str, cfg_yaml: str) -> dict:
    from pathlib import Path

    from megatron.core import parallel_state
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from ckpt import io as checkpoint
    from ckpt.format import dcp_reader
    from layout_goldens import build, check, fill

    rank = __import__("torch").distributed.get_rank()
    model, opt, sched, record, cfg = build(cfg_yaml)
    fill(model, opt, cfg, sentinel=False)
    gathered = []
    original = DistributedOptimizer.get_parameter_state_dp_zero

    def gather(self, *args, **kwargs):
        gathered.append(True)
        return original(self, *args, **kwargs)

    DistributedOptimizer.get_parameter_state_dp_zero = gather
    try:
        boxes, outside = _aliasing(model, opt)
        checkpoint.save_checkpoint(Path(root), 1, model, opt, sched, {"consumed_samples": 0},
                                   record)
    finally:
        DistributedOptimizer.get_parameter_state_dp_zero = original
    written = (Path(root) / "iter_0000001" / f"__{rank}_0.distcp").stat().st_size

    read = []
    original_run, original_read = dcp_reader._read_run, dcp_reader.read_data

    def counted_run(stream, record_, first, count, target, scratch):
        read.append(count * record_.dtype.itemsize)
        return original_run(stream, record_, first, count, target, scratch)

    def counted_read(reader, plan, planner, stock):
        def whole(reader_, plan_, planner_):  # torch's reader: every touched record, whole
            read.extend(reader_.storage_data[item.storage_index].length for item in plan_.items)
            return stock(reader_, plan_, planner_)
        return original_read(reader, plan, planner, whole)

    fill(model, opt, cfg, sentinel=True)
    dcp_reader._read_run, dcp_reader.read_data = counted_run, counted_read
    try:
        checkpoint.load_checkpoint(Path(root), model, opt, sched, record, verify=False)
    finally:
        dcp_reader._read_run, dcp_reader.read_data = original_run, original_read
    n, problems = check(model, opt, cfg)
    out = {"gathered": bool(gathered), "boxes": boxes, "outside": outside, "written": written,
           "read": sum(read), "kept": _kept_bytes(model, opt), "checked": n,
           "problems": problems}
    parallel_state.destroy_model_parallel()
    return out


def _run(tmp_path, *extra: str) -> list[dict]:
    from layout_goldens import make_cfg

    cfg = make_cfg("tiny", 1, 1, None, WORLD, "logical", *MODEL, *extra)
    return run_distributed(_worker, WORLD, str(tmp_path / "ckpt"), cfg, timeout=300)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("scale"))


def test_a_save_gathers_no_optimizer_state_and_copies_none(ranks):
    for rank, r in enumerate(ranks):
        assert not r["gathered"], rank
        assert r["boxes"] > 0 and r["outside"] == 0, (rank, r["boxes"], r["outside"])


def test_every_rank_writes_about_the_same_bytes(ranks):
    written = [r["written"] for r in ranks]
    mean = sum(written) / len(written)
    assert max(written) <= 1.25 * mean, written


def test_each_rank_reads_what_it_keeps(ranks):
    for rank, r in enumerate(ranks):
        assert r["read"] <= 1.1 * r["kept"], (rank, r["read"], r["kept"])
        assert r["read"] >= r["kept"] * 0.5, (rank, r)  # the counter saw the reads


def test_the_load_is_exact(ranks):
    for rank, r in enumerate(ranks):
        assert r["checked"] > 0 and r["problems"] == [], (rank, r["problems"][:5])
