"""Stock megatron-core 0.19.2 MoE checkpoints (expert GTP padding written into the expert
weights) read exactly at other expert layouts through ``ckpt.stock``.

One 4-process gloo world, moe_tiny (4 SwiGLU experts, fc1 200 rows, hidden 72, 2 layers, fp32,
Adam), the goldens of ``tests/test_moe_checkpoint_layouts.py`` (plain-sliced from a full logical
tensor per parameter; independent of ``gtp/``), with every expert-GTP padding row of the weights
and both Adam moments set to garbage before saving:

1. ``A``: etp2 x egtp2/a16 (ep1) saved with ``checkpoint.format=stock`` (megatron's own padded
   writer): fc1 stored (2, 4, 256, 72) for 200 logical rows, each expert-TP rank's shards at
   shifted offsets, gate and up halves mislabelled;
2. ``B``: ep2 x egtp2/a64 (etp1), stock: fc1 stored (2, 4, 256, 72) too (200 rows padded to
   256). B's own file, loaded at B in the stock format, is read as is (not converted, its
   garbage padding rows too) into sentinel-filled tensors: exact. In B's model, megatron's own loader reads A's expert fc1 (the
   naive read at another layout: the global shapes agree, nothing complains) and most rows come
   out wrong; then, the logical format switched on in the same model,
   ``ckpt.io.load_checkpoint`` reads A (converted once by ``ckpt.stock``) into
   sentinel-filled tensors: every weight and moment exact. (At B's alignment 16, megatron
   refuses A's fc1 instead: global shape mismatch, 256 stored rows against 224.)
3. ``C``: ep2 x etp2 without expert GTP, logical format: A and B each loaded into sentinel-filled
   tensors, every weight and moment exact.

In this process: ``ckpt.stock`` analyses A, and its reconstructed expert tensors equal the full
golden, while the stored rows read as they lie do not.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from layout_goldens import build as _build
from moe_matrix import (
    all_logical_names,
    check_goldens,
    fill_sentinel,
    golden_full,
    goldens,
    set_golden,
    make_cfg,
)
from optimizer_entries import opt_states

pytestmark = pytest.mark.multiprocess

WORLD = 4
GARBAGE = -5555.0
LAYOUTS = {
    "A": ("parallelism.expert_tensor_parallel_size=2", "gtp.expert_gtp_remat_size=2",
          "gtp.pad_for_alignment=16", "checkpoint.format=stock"),
    "B": ("parallelism.expert_model_parallel_size=2", "gtp.expert_gtp_remat_size=2",
          "gtp.pad_for_alignment=64", "checkpoint.format=stock"),
    "C": ("parallelism.expert_model_parallel_size=2",
          "parallelism.expert_tensor_parallel_size=2"),
}
FC1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
FC2 = "decoder.layers.mlp.experts.experts.linear_fc2.weight"


def _padding(model, optimizer):
    """(padding rows, their row count) of every expert-GTP weight and its Adam moments on this
    rank (views: the tail of the TP-local weight that falls in this rank's shard)."""
    tensors = {id(p): [p] for p in model.module.parameters()}
    for opt, p in opt_states(optimizer):
        tensors[id(p)] += [opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]]
    for p in model.module.parameters():
        if getattr(p, "pad_length", 0) <= 0:
            continue
        s, r, L = p.shape[0], p.group.rank(), int(p._unsharded_shape[0])
        first = max(0, min(s, L - r * s))
        for t in tensors[id(p)]:
            yield t[first:], s - first


@torch.no_grad()
def _garbage_padding(model, optimizer) -> int:
    """Set the padding rows to GARBAGE (what a stock file then holds in its padding rows);
    returns the rows set on this rank."""
    rows = 0
    for view, n in _padding(model, optimizer):
        view.fill_(GARBAGE)
        rows += n
    return rows


@torch.no_grad()
def _padding_was_garbage_then_zero(model, optimizer) -> bool:
    """Whether every padding row holds GARBAGE (a stock file read as is); zeroes them, as the
    golden has them."""
    ok = True
    for view, _ in _padding(model, optimizer):
        ok &= bool((view == GARBAGE).all())
        view.zero_()
    return ok


def _naive_stock_read(model, path, cfg) -> tuple:
    """megatron's own loader (stock format) reading the expert fc1 weights of ``path`` into this
    layout's shards: (elements that differ from the golden, elements compared, error or None).
    Only fc1: it is stored with the same global shape at A and B, so nothing stops the read."""
    from megatron.core import dist_checkpointing

    gold = goldens(model, cfg)
    wanted = {k: v for k, v in model.module.sharded_state_dict().items()
              if ".local_experts." in k and k.endswith("linear_fc1.weight")}
    try:
        loaded = dist_checkpointing.load(wanted, str(path), strict="assume_ok_unexpected")
    except BaseException as exc:  # noqa: BLE001 - torch's CheckpointException is one
        return 0, 0, f"{type(exc).__name__}: {exc}"[:300]
    wrong = total = 0
    for name, (p, want, _, _) in gold.items():
        if name in wanted:
            s, r, L = p.shape[0], p.group.rank(), int(p._unsharded_shape[0])
            rows = slice(0, max(0, min(s, L - r * s)))  # the shard's logical rows only
            wrong += int((loaded[name][rows] != want[rows]).sum())
            total += want[rows].numel()
    return wrong, total, None


def _world(root: str, cfgs: dict) -> dict:
    from ckpt import io as checkpoint
    from ckpt.format import logical_format

    root = Path(root)
    out = {"loads": {}, "garbage_rows": {}}
    for name in ("A", "B"):
        model, opt, sched, record, cfg = _build(cfgs[name])
        assert not logical_format.is_installed(), "checkpoint.format=stock must write stock"
        set_golden(model, opt, cfg)
        out["garbage_rows"][name] = _garbage_padding(model, opt)
        checkpoint.save_checkpoint(root / name, 1, model, opt, sched, {"consumed_samples": 0},
                                   record)
    # still at B (stock): its own file, read as is (ckpt.stock.prepare_load: same layout)
    fill_sentinel(model, opt)
    checkpoint.load_checkpoint(root / "B", model, opt, sched, record)
    out["B_as_is"] = (not (root / "B" / "gtp_converted").exists(),
                      _padding_was_garbage_then_zero(model, opt))
    out["loads"][("B", "B")] = check_goldens(model, opt, cfg)
    # megatron's own read of A; then ckpt.stock's, into the same model in
    # the logical format (a stock run loads only its own layout: recipes.checkpoint.policy refuses)
    out["naive"] = _naive_stock_read(model, root / "A" / "iter_0000001", cfg)
    logical_format.configure("logical")
    fill_sentinel(model, opt)
    checkpoint.load_checkpoint(root / "A", model, opt, sched, record)
    out["loads"][("A", "B")] = check_goldens(model, opt, cfg)
    model, opt, sched, record, cfg = _build(cfgs["C"])
    assert logical_format.is_installed()
    for src in ("A", "B"):
        fill_sentinel(model, opt)
        checkpoint.load_checkpoint(root / src, model, opt, sched, record)
        out["loads"][(src, "C")] = check_goldens(model, opt, cfg)
    # the full logical goldens' index (same at every layout), for the single-process checks
    out["index"] = {n: k for k, n in enumerate(all_logical_names(model, cfg), start=1)}
    from multiproc import reset_model_parallel

    reset_model_parallel()
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_stock")
    cfgs = {name: make_cfg(*extra) for name, extra in LAYOUTS.items()}
    from multiproc import run_distributed

    t0 = time.time()
    results = run_distributed(_world, WORLD, str(root), cfgs, timeout=900)
    print(f"\nMoE stock world: {time.time() - t0:.0f}s")
    return root, results


def _full_golden(index: dict, key: str, shape: tuple, what: str) -> torch.Tensor:
    """The full logical tensor (layers, experts, rows, cols) of a stored expert key."""
    name = key.replace("decoder.layers.", "").replace("mlp.experts.experts.", "")
    full = torch.stack([torch.stack([
        golden_full(index[f"decoder.layers.{layer}.mlp.experts.experts.{e}.{name}"], shape)
        for e in range(4)]) for layer in range(2)])
    return {"": full, "exp_avg": full + 0.5, "exp_avg_sq": full * 2}[what]


def test_stock_expert_checkpoints_load_exactly_at_other_expert_layouts(world):
    _, results = world
    # the last expert-GTP rank of each shard pair holds padding rows (now garbage)
    assert all(sum(res["garbage_rows"][name] for res in results) > 0 for name in ("A", "B"))
    for rank, res in enumerate(results):
        assert set(res["loads"]) == {("B", "B"), ("A", "B"), ("A", "C"), ("B", "C")}
        # a stock run reads its own layout's stock file as is: not converted, padding rows too
        assert res["B_as_is"] == (True, True), (rank, res["B_as_is"])
        for pair, (experts, n, problems) in res["loads"].items():
            assert not problems, (rank, pair, problems[:5])
            assert experts > 0 and n > experts, (rank, pair, experts, n)


def test_megatrons_own_read_at_another_layout_gets_expert_rows_wrong(world):
    """The bug the reader exists for: stock 0.19.2 loads A at B's layout without complaint
    (allow_shape_mismatch) and fills the expert weights with rows from the wrong offsets."""
    _, results = world
    for rank, res in enumerate(results):
        wrong, total, error = res["naive"]
        assert error is None, (rank, error)
        assert total > 0 and wrong > total // 4, (rank, wrong, total)


def test_reader_reconstructs_every_expert_row_against_the_plain_sliced_golden(world):
    from ckpt import stock

    root, results = world
    index = results[0]["index"]
    a = stock.analyze(root / "A")
    assert a.format == "stock" and a.stock
    lay = a.expert_layout
    assert (lay.tp, lay.g, lay.pad_for_alignment) == (2, 2, 16), a.describe()
    assert "sharding record" in a.layout_source and "inferred" not in a.layout_source
    common = a.common[stock.SHARDING_RECORD_KEY]
    assert (common["expert_tensor_parallel_size"], common["expert_gtp_remat_size"],
            common["pad_for_alignment"]) == (2, 2, 16)
    assert common["tensors"][FC1]["global_shape"] == [200, 72]
    fc1 = a.tensors[FC1]
    # each expert-TP rank's 100 rows padded to 128, at offsets tp_rank * 128: 256 stored rows
    assert fc1.stored_shape == (2, 4, 256, 72) and fc1.logical_shape == (2, 4, 200, 72)
    assert fc1.gtp.gated and a.tensors[FC2].stored_shape == (2, 4, 96, 100)

    _, tensors = stock.read_logical(root / "A")
    checked = 0
    for key in (FC1, FC2):
        shape = (200, 72) if key == FC1 else (72, 100)
        for what in ("", "exp_avg", "exp_avg_sq"):
            k = f"optimizer.state.{what}.{key}" if what else key
            want = _full_golden(index, key, shape, what)
            assert torch.equal(tensors[k], want), k
            checked += 1
    assert checked == 6
    # the copy the loads read (ckpt.stock.prepare_load): logical, expert saving layout recorded
    conv = stock.analyze(root / "A" / stock.CONVERTED_DIR)
    assert conv.format == "logical" and not conv.stock
    assert conv.tensors[FC1].stored_shape == (2, 4, 200, 72)
    saved = conv.common[stock.CONVERTED_KEY]["saved_layout"]
    assert (saved["expert_tensor_parallel_size"], saved["expert_gtp_remat_size"],
            saved["pad_for_alignment"]) == (2, 2, 16), saved
    assert conv.common["layout"]["expert_gtp_remat_size"] == 1


def test_stored_rows_read_as_they_lie_are_not_the_logical_rows(world):
    """Plain slicing of the stock file (what a reader unaware of the padding does) gives wrong
    rows: the golden is not a prefix of the stored rows, and padding garbage sits inside."""
    from megatron.core import dist_checkpointing

    from ckpt import stock
    from ckpt.stock.reading import ensure_dist

    root, results = world
    index = results[0]["index"]
    path = stock.resolve_iter_dir(root / "A")
    cleanup = ensure_dist()
    try:
        stored = dist_checkpointing.load_plain_tensors(str(path))
    finally:
        cleanup()
    want = _full_golden(index, FC1, (200, 72), "")
    naive = stored[FC1][:, :, :200]
    assert not torch.equal(naive, want)
    rows_wrong = int((naive != want).any(dim=-1).sum())
    assert rows_wrong > 2 * 4 * 100, rows_wrong  # more than half of the rows
    assert bool((stored[FC1] == GARBAGE).any())


def test_a_given_expert_layout_that_cannot_explain_the_stored_shapes_is_refused(world):
    from ckpt import stock

    root, _ = world
    with pytest.raises(stock.StockCheckpointError) as err:
        stock.analyze(root / "A", "etp=2,egtp=2,pad=32")
    msg = str(err.value)
    assert msg.startswith("routed-expert weights (read with tp = expert_tensor_parallel_size")
    assert f"{FC2} is stored with shape (2, 4, 96, 100)" in msg and "gives dim 0 128" in msg
