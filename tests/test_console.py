"""The console a run prints: the iteration line (Megatron-LM's timestamp, 160 columns by
default, MoE losses and skipped iterations on it), the closing summary, and the seconds taken by
the imports before a run (an HF model)."""

from __future__ import annotations

import re
import shlex
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from recipes.metrics.console import format_summary
from recipes.metrics.logger import CONSOLE_WIDTH, format_progress

# Megatron-LM's training_log: ' [YYYY-MM-DD hh:mm:ss] iteration ...'.
STAMPED = re.compile(r"^ \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] iteration +\d+/\d+")


def _metrics(**extra) -> dict:
    """The largest realistic figures of every field on the line."""
    return {"consumed-samples": 4_096_000_000, "iteration-time": 123.456789,
            "tokens-per-sec": 987_654_321.0, "learning-rate": 3.0e-4, "lm loss": 12.3456789,
            "grad-norm": 123456.789, "num-zeros": 123456789, "throughput": 987.654,
            "peak-memory-bytes": 141 * 2**30, "skipped-iterations": 0, **extra}


def test_the_line_starts_with_megatrons_timestamp():
    line = format_progress(7, 200, _metrics(), 1.0, 2.0, now=0)
    assert STAMPED.match(line), line
    assert line.startswith(" [" + __import__("time").strftime("%Y-%m-%d %H:%M:%S",
                                                               __import__("time").localtime(0)))
    assert STAMPED.match(format_progress(7, 200, _metrics(), full=True)), "full line too"


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("skipped", [0, 12345])
def test_the_default_line_fits_160_columns_with_the_longest_values(moe, skipped):
    extra = {"load_balancing_loss": 123.456789} if moe else {}
    line = format_progress(1_000_000, 1_000_000, _metrics(**extra, **{"skipped-iterations": skipped}),
                           3_600_000.0, 3_600_000.0, resumed_from=999_999)
    assert len(line) <= CONSOLE_WIDTH, (len(line), line)
    assert "iteration 1000000/1000000" in line and "lm loss: 1.2346E+01" in line, line
    assert "grad norm: 1.235e+05" in line, line  # still room for it
    assert ("load_balancing_loss: 1.2346E+02" in line) == moe, line
    assert (f"| skipped iterations: {skipped}" in line) == bool(skipped), line


def test_a_typical_line_keeps_every_compact_field():
    m = {"consumed-samples": 32, "iteration-time": 0.0998, "tokens-per-sec": 10258.0,
         "learning-rate": 1e-3, "lm loss": 5.545337, "grad-norm": 2.4348, "num-zeros": 0,
         "skipped-iterations": 0}
    line = format_progress(2, 200, m, 1.0, 83.0)
    for part in ("remaining: 0:01:23", "ms/iter: 99.8", "tokens/s: 10258", "lr: 1.000E-03",
                 "lm loss: 5.5453E+00", "grad norm: 2.435"):
        assert part in line, (part, line)
    assert len(line) <= CONSOLE_WIDTH and "skipped" not in line
    resumed = format_progress(2, 200, m, 1.0, 83.0, resumed_from=1)
    assert "iteration      2/200 (resumed from 1) | remaining: 0:01:23 |" in resumed, resumed
    assert len(resumed) <= CONSOLE_WIDTH


def test_the_moe_losses_are_on_the_line():
    for name in ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss"):
        line = format_progress(3, 10, _metrics(**{name: 0.25}), 1.0, 2.0)
        assert f"| {name}: 2.5000E-01 |" in line, line


def test_the_mtp_losses_are_on_the_line_after_the_moe_loss():
    m = {"consumed-samples": 32, "iteration-time": 0.0998, "tokens-per-sec": 10258.0,
         "learning-rate": 1e-3, "lm loss": 5.545337, "grad-norm": 2.4348, "num-zeros": 0,
         "skipped-iterations": 0, "load_balancing_loss": 0.25, "mtp_1 loss": 5.25}
    line = format_progress(3, 10, m, 1.0, 2.0)
    assert "| load_balancing_loss: 2.5000E-01 | mtp_1 loss: 5.2500E+00 |" in line, line
    assert len(line) <= CONSOLE_WIDTH and "grad norm: 2.435" in line, line
    assert "mtp_1 loss: 5.250000E+00 | grad norm" in format_progress(3, 10, m, full=True)
    # By layer number (10 after 2); with the longest figures the MTP losses give way before
    # grad norm does, the last layer's first.
    many = {f"mtp_{i} loss": float(i) for i in (10, 2, 1)}
    line = format_progress(3, 10, {**m, **many}, 1.0, 2.0, full=True)
    assert line.index("mtp_1 loss") < line.index("mtp_2 loss") < line.index("mtp_10 loss"), line
    longest = format_progress(1_000_000, 1_000_000, _metrics(**many, load_balancing_loss=1.5),
                              3_600_000.0, 3_600_000.0)
    assert len(longest) <= CONSOLE_WIDTH and "grad norm: 1.235e+05" in longest, longest
    assert "mtp_10 loss" not in longest and "mtp_1 loss" in longest, longest


def test_the_full_line_holds_every_figure():
    line = format_progress(3, 10, _metrics(load_balancing_loss=0.25, **{"skipped-iterations": 2}),
                           1.0, 2.0, full=True)
    for part in ("elapsed: 0:00:01", "remaining: 0:00:02", "consumed samples", "elapsed time per "
                 "iteration (ms)", "throughput per GPU (TFLOP/s/GPU)", "peak memory per rank",
                 "tokens/s (global)", "learning rate: 3.0000E-04", "lm loss: 1.234568E+01",
                 "load_balancing_loss: 2.500000E-01", "grad norm: 123456.7890", "num zeros",
                 "number of skipped iterations: 2"):
        assert part in line, (part, line)
    assert len(line) > CONSOLE_WIDTH


def _logger(offline_dir=None, validation=True):
    last = {"iteration": 8, "lm loss": 4.5}
    return SimpleNamespace(last=last, wandb_offline_dir=offline_dir,
                           last_validation=(4.75, 8) if validation else None,
                           best_validation=(4.5, 6) if validation else None)


def test_the_summary_names_losses_checkpoint_command_and_wandb_sync():
    how = "python train.py train.train_iters=8 hydra.run.dir=out checkpoint.load=auto"
    text = format_summary(_logger("out/wandb/offline-run-x"), 83.2, 8, "out/checkpoints/iter_0000008",
                          how, save_root="out/checkpoints")
    assert text.startswith("> run complete: iteration 8/8 in 0:01:23 (wall time)"), text
    assert "final lm loss: 4.500000E+00" in text
    assert "lm loss validation: final 4.750000E+00 (iteration 8), best 4.500000E+00 " \
           "(iteration 6)" in text
    assert "resume from: out/checkpoints/iter_0000008" in text
    command = text.split("train on with: ")[1].splitlines()[0]
    assert shlex.split(command) == ["python", "train.py", "hydra.run.dir=out",
                                    "checkpoint.load=auto", "train.train_iters=16"]
    assert "`wandb sync out/wandb/offline-run-x`" in text


def test_a_run_that_saved_nothing_names_the_checkpoint_it_loaded_and_no_command():
    """checkpoint.save=null after a load: the loaded checkpoint is named as such, and no
    checkpoint.load=auto command (it would find nothing and start from scratch)."""
    how = "python train.py checkpoint.save=null checkpoint.load=auto"
    text = format_summary(_logger(), 5.0, 8, "src/checkpoints/iter_0000002", how, save_root=None)
    assert ("resume from: src/checkpoints/iter_0000002 (the checkpoint this run loaded; it saved "
            "nothing: checkpoint.save=null)") in text, text
    assert "train on" not in text, text


def test_the_summary_without_validation_checkpoint_or_wandb():
    text = format_summary(_logger(validation=False), 5.0, 8, None, None)
    assert "validation" not in text and "wandb" not in text and "train on" not in text
    assert "no checkpoint to resume from (checkpoint.save=null)" in text
    text = format_summary(_logger(validation=False), 5.0, 8, None, None, save_root="out/ck")
    assert "no checkpoint to resume from (none saved into out/ck: checkpoint.save_interval, " \
           "checkpoint.save_at_end)" in text, text


def test_the_hf_import_prints_its_layers_and_seconds(tmp_path, monkeypatch, capsys):
    from ckpt.hf import hf_import
    from recipes.run import pretrained

    src = tmp_path / "hf"
    src.mkdir()
    monkeypatch.setattr(pretrained, "is_hf_dir", lambda path: True)
    monkeypatch.setattr(hf_import, "import_hf", lambda source, root: root / "iter_0000000")
    cfg = OmegaConf.create({"checkpoint": {"pretrained": str(src)}, "model": {"num_layers": 4},
                            "output_dir": str(tmp_path / "out")})
    monkeypatch.setattr(pretrained, "checkpoint_root", lambda c: str(tmp_path / "out/pretrained"))
    pretrained.prepare(cfg, is_rank0=True)
    out = capsys.readouterr().out
    assert re.search(rf"^> imported {src} into \S+: 4 layers in \d+\.\d s$", out, re.M), out
    pretrained.prepare(cfg, is_rank0=False)
    assert capsys.readouterr().out == ""  # rank 0 only
