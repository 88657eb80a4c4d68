"""End to end (tests/helpers/inworld.py): ``model=llava_tiny`` trained at tp2 x g2/a16 with
``checkpoint.format=stock`` (megatron-core 0.19.2's padded writer, the project's ``gtp_layout``
record tagged ``stock-0.19.2``), resumed from iteration 2 in the logical format at tp2 x g2/a32,
another padding: the load converts the stock checkpoint (``ckpt.stock.prepare_load``, each
sub-model read with its own dims) and iterations 3..5 give the original run's ``lm loss`` and
``grad-norm`` up to the order of fp32 reductions. ``gtp inspect`` describes the stock file.
megatron's own stock LLaVA checkpoints, every weight and moment: tests/test_llava_stock.py.
"""

from __future__ import annotations

import io

import pytest

from resume_checks import assert_same_step, by_iteration, resumed_rows

pytestmark = pytest.mark.e2e

# As tests/test_llava_e2e.py, without validation.
LLAVA = ["model=llava_tiny", "data=shapes", "data.micro_batch_size=2",
         "data.global_batch_size=4", "train.train_iters=5", "checkpoint.save_interval=2",
         "parallelism=tp2", "gtp=tp2_align16"]
RESUMED_AT = 2
PARAMETERS = 248_640  # llava_tiny's (tests/test_llava_config.py)


@pytest.fixture(scope="module")
def runs(train_jobs, tmp_path_factory):
    root = tmp_path_factory.mktemp("llava_stock_e2e")
    resume = [f"checkpoint.load={root / 'stock'}/checkpoints",
              f"checkpoint.load_iteration={RESUMED_AT}"]
    train_jobs([(root / "stock", [*LLAVA, "checkpoint.format=stock"]),
                (root / "a32", [*LLAVA, "gtp.pad_for_alignment=32", *resume])])
    return root


def test_a_stock_llava_checkpoint_resumes_at_another_padding(runs):
    want, _ = by_iteration(runs / "stock")
    got = resumed_rows(runs / "a32", RESUMED_AT)
    for it in (3, 4, 5):
        assert_same_step(got[it], want[it], it - RESUMED_AT, terms=PARAMETERS)
    assert (runs / "stock" / "checkpoints" / "gtp_converted" / "iter_0000002").is_dir()


def test_inspect_describes_the_runs_stock_checkpoint(runs):
    from ckpt.cli import main

    out = io.StringIO()
    assert main(["inspect", str(runs / "stock" / "checkpoints" / "iter_0000002")], out=out) == 0
    text = out.getvalue()
    assert "stock padded GTP format" in text and "tp2 x gtp2 (pad_for_alignment=16)" in text
    line = next(x for x in text.splitlines()
                if x.startswith("vision_model.decoder.layers.mlp.linear_fc1.weight "))
    assert "(2, 200, 72)" in line and "STOCK stored (2, 256, 72)" in line, line
