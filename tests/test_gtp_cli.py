"""``python -m gtp inspect / compare / convert`` on the checkpoints of tests/test_stock_format.py.

The checkpoints (built once per session by ``stock_goldens.stock_checkpoints``, 4 gloo ranks):
``stock`` (stock 0.19.2 writer, tp2 x gtp2, pad_for_alignment 16), ``logical_twin`` (same
model, ckpt.format.logical_format's logical writer), ``tp2`` (loaded from ``stock`` into a non-GTP tp2 model
and saved by megatron), ``perturbed`` (``tp2`` with logical fc1 row 110 of layer 1 changed), and
``stock/gtp_converted`` (written by the load path). The CLI runs in this process (it starts and
ends its own 1-process gloo group), and once as ``python -m gtp`` for the entry point and exit code.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stock_goldens import ITER, PERTURB_LAYER, PERTURB_ROW, stock_checkpoints

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory):
    return stock_checkpoints(tmp_path_factory)["root"]


def cli(*argv):
    """(exit code, stdout) of the CLI run in this process."""
    from ckpt.cli import main

    out = io.StringIO()
    rc = main([str(a) for a in argv], out=out)
    return rc, out.getvalue()


def _line(text: str, key: str) -> str:
    return next(line for line in text.splitlines() if line.split(" ", 1)[0] == key)


def test_inspect_shows_logical_shapes_and_stock_flags(ckpts):
    rc, out = cli("inspect", ckpts / "tiny" / "stock")
    assert rc == 0, out
    assert "stock padded GTP format (megatron-core 0.19.2)" in out
    assert "tp2 x gtp2 (pad_for_alignment=16)" in out
    fc1 = _line(out, "decoder.layers.mlp.linear_fc1.weight")
    assert "(2, 200, 72)" in fc1 and "column-parallel L=100" in fc1
    assert "STOCK stored (2, 256, 72)" in fc1
    proj = _line(out, "decoder.layers.self_attention.linear_proj.weight")
    assert "(2, 72, 72)" in proj and "row-parallel L=72" in proj
    assert "STOCK stored (2, 96, 72)" in proj
    moment = _line(out, "optimizer.state.exp_avg_sq.decoder.layers.mlp.linear_fc1.weight")
    assert "STOCK stored (2, 256, 72)" in moment
    # vocab rows need no padding at this layout: stock, but the same rows as logical
    assert "stock, same rows as logical" in _line(out, "embedding.word_embeddings.weight")
    bias = _line(out, "decoder.layers.mlp.linear_fc1.bias")
    assert "(2, 200)" in bias and "STOCK" not in bias
    assert "51 tensors, 12 stored in the stock padded format" in out


def test_inspect_of_logical_checkpoints_flags_nothing(ckpts):
    for name in ("logical_twin", "tp2", "stock/gtp_converted"):
        rc, out = cli("inspect", ckpts / "tiny_swiglu" / name)
        assert rc == 0, out
        assert "STOCK" not in out and "0 stored in the stock padded format" in out, name
        assert "(2, 400, 72)" in _line(out, "decoder.layers.mlp.linear_fc1.weight"), name
    rc, out = cli("inspect", ckpts / "tiny_swiglu" / "logical_twin")
    assert "logical format; saved at tp2 x gtp2 (pad_for_alignment=16)" in out
    assert "gated" in _line(out, "decoder.layers.mlp.linear_fc1.weight")


@pytest.mark.parametrize("model", ["tiny", "tiny_swiglu"])
@pytest.mark.parametrize("other", ["tp2", "logical_twin", "stock/gtp_converted"])
def test_compare_equal_whatever_the_layout(ckpts, model, other):
    rc, out = cli("compare", ckpts / model / "stock", ckpts / model / other)
    assert rc == 0, out
    assert f"EQUAL: 51 logical tensors (17 model, 34 optimizer) bit for bit; iteration {ITER}, " \
           "optimizer step 7.0" in out


@pytest.mark.parametrize("model", ["tiny", "tiny_swiglu"])
def test_compare_names_the_first_differing_tensor_and_row(ckpts, model):
    perturbed = ckpts / model / "perturbed" / f"iter_{ITER:07d}"
    rc, out = cli("compare", ckpts / model / "stock", perturbed)
    assert rc == 1, out
    assert (f"DIFFERENT: first differing tensor decoder.layers.mlp.linear_fc1.weight at layer "
            f"{PERTURB_LAYER}, row {PERTURB_ROW}: first difference at layer {PERTURB_LAYER}, row "
            f"{PERTURB_ROW}, column 0") in out
    assert "(72 elements in 1 rows differ)" in out


def test_compare_errors_exit_2(ckpts, tmp_path, capsys):
    rc, out = cli("compare", ckpts / "tiny" / "stock", tmp_path / "nothing")
    assert rc == 2
    assert "not a megatron torch_dist checkpoint" in capsys.readouterr().err
    # a given layout that does not explain the stored shapes is refused, not guessed around
    rc, out = cli("compare", ckpts / "tiny" / "stock", ckpts / "tiny" / "tp2",
                  "--layout-a", "tp=2,gtp=2,pad=32")
    err = capsys.readouterr().err
    assert rc == 2 and "StockCheckpointError" in err
    assert "linear_fc2.weight is stored with shape (2, 96, 200)" in err
    rc, _ = cli("compare", ckpts / "tiny" / "stock")  # usage error
    assert rc == 2


def test_convert_writes_a_checkpoint_equal_to_the_non_gtp_one(ckpts, tmp_path):
    rc, out = cli("convert", ckpts / "tiny_swiglu" / "stock", tmp_path / "converted")
    assert rc == 0, out
    assert (tmp_path / "converted" / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITER)
    rc, out = cli("compare", tmp_path / "converted", ckpts / "tiny_swiglu" / "tp2")
    assert rc == 0, out


def test_convert_of_a_stock_checkpoint_reads_one_weight_at_a_time(ckpts, tmp_path, monkeypatch):
    """The stock reader under ``gtp convert`` (issue 55 item 5): each read request is one key,
    or one stock GTP weight's stored group (base, ``_w``, ``_v``); a request never finds more
    than the last group still held; and the output is the non-GTP checkpoint's."""
    import re

    from test_tools_bounded import Reads

    from ckpt import stock

    src = ckpts / "tiny_swiglu" / "stock"
    stocked = {k for k, info in stock.analyze(src).tensors.items() if info.stock}
    reads = Reads(monkeypatch)
    rc, out = cli("convert", src, tmp_path / "converted")
    assert rc == 0, out
    assert stocked and stocked <= {k for keys, _, _ in reads.requests for k in keys}
    assert [keys for keys, _, _ in reads.requests
            if len({re.sub(r"_[wv]$", "", k) for k in keys}) != 1] == []
    total = sum(b for _, b, _ in reads.requests)
    assert max(held for _, _, held in reads.requests) <= reads.largest < total / 4
    rc, out = cli("compare", tmp_path / "converted", ckpts / "tiny_swiglu" / "tp2")
    assert rc == 0, out


def test_python_dash_m_gtp(ckpts):
    """The installed entry point, a fresh interpreter without torchrun: exit code 1 and the
    first differing tensor and row."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    proc = subprocess.run(
        [sys.executable, "-m", "gtp", "compare", str(ckpts / "tiny" / "stock"),
         str(ckpts / "tiny" / "perturbed")],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert "DIFFERENT: first differing tensor decoder.layers.mlp.linear_fc1.weight at layer 1, " \
           "row 110" in proc.stdout


def test_convert_refuses_its_source_and_a_newer_destination(ckpts, tmp_path, capsys):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(ckpts / "tiny" / "stock", src)
    before = sorted((p.relative_to(src), p.read_bytes()) for p in src.rglob("*") if p.is_file())
    rc, _ = cli("convert", src, src)
    assert rc == 2 and "the destination is the source" in capsys.readouterr().err
    assert sorted((p.relative_to(src), p.read_bytes()) for p in src.rglob("*") if p.is_file()) == before
    newer = tmp_path / "newer"
    newer.mkdir()
    (newer / "iter_0000099").mkdir()
    (newer / "latest_checkpointed_iteration.txt").write_text("99\n")
    rc, _ = cli("convert", src, newer)
    assert rc == 2 and "names iteration 99, newer than the converted" in capsys.readouterr().err
    assert (newer / "latest_checkpointed_iteration.txt").read_text() == "99\n"


def test_verify_passes_checkpoints_of_every_writer(ckpts):
    """Stock 0.19.2's padded GTP writer, the logical writer, megatron's non-GTP tp2 save, the
    converted copy: every chunk of every tensor stored once, every CRC-32 intact."""
    for model in ("tiny", "tiny_swiglu"):
        for name in ("stock", "logical_twin", "tp2", "perturbed", "stock/gtp_converted"):
            rc, out = cli("verify", ckpts / model / name)
            assert rc == 0 and out.startswith("OK "), (model, name, out)


def test_inspect_names_the_expert_layout_and_sequence_parallelism():
    from ckpt.cli import describe_parallelism

    dense = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1,
             "gtp_remat_size": 1, "data_parallel_size": 2, "world_size": 4}
    assert describe_parallelism(dense) == "tp2 x pp1 (vpp -) x gtp1 x dp2, world 4"
    moe = {**dense, "sequence_parallel": True, "expert_model_parallel_size": 2,
           "expert_tensor_parallel_size": 1, "expert_gtp_remat_size": 2}
    assert describe_parallelism(moe) == ("tp2+sp x pp1 (vpp -) x gtp1 x dp2, world 4; "
                                         "experts ep2 x etp1 x egtp2 (pad 0)")
    cp = {**dense, "context_parallel_size": 2, "data_parallel_size": 1}
    assert describe_parallelism(cp) == "tp2 x pp1 (vpp -) x gtp1 x cp2 x dp1, world 4"
