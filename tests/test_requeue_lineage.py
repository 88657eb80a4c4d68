"""``checkpoint.load=auto`` follows the lineage that wrote the tracker (issue 33.2) and skips a
damaged save of it (issue 33.3), in reused gloo worlds (tests/helpers/inworld.py)."""

from __future__ import annotations

import re

import pytest

from ckpt import io as checkpoint
from recipes.metrics.logger import read_metrics

KEYS = ("lm loss", "grad-norm", "learning-rate", "consumed-samples")
# The fork: lr changed (and taken: override), so its figures differ from the original's.
FORK = ["train.train_iters=12", "optim.lr=5e-4", "optim.override_opt_param_scheduler=true",
        "checkpoint.allow_existing_save=true", "checkpoint.save_interval=3"]
# Stops the fork after iteration 7 as a SIGTERM would (a save, then exit 0); kept by the
# continue command it prints, as here.
STOP7 = "train.exit_interval=7"


def rows(out) -> dict:
    return {r["iteration"]: r for r in read_metrics(out)[0]}


def flip_a_byte(path) -> None:
    data = max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))


@pytest.mark.e2e
def test_auto_continues_its_own_lineage_and_skips_a_damaged_save(train_jobs, tmp_path):
    a, ref, fork, cont, again = (tmp_path / n for n in ("a", "ref", "fork", "cont", "again"))
    root = a / "checkpoints"
    load4 = [f"checkpoint.load={root}", "checkpoint.load_iteration=4"]
    # The original run (saves 2..12); the fork uninterrupted (the reference); the fork into the
    # original's dir, stopped at 7 (tracker back to 7; iter 8, 10, 12 are the original's); the
    # command that continues it (checkpoint.load=auto).
    jobs = train_jobs([
        (a, ["train.train_iters=12", "checkpoint.save_interval=2"]),
        (ref, [*FORK, *load4, "checkpoint.save_interval=0"]),
        (fork, [*FORK, *load4, f"checkpoint.save={root}", STOP7]),
        (cont, [*FORK, f"checkpoint.save={root}", STOP7, "checkpoint.load=auto"]),
    ])
    console = jobs[3].stdout
    assert f"resuming from {checkpoint.iter_dir(root, 7)}" in console, console[-3000:]
    for it in (8, 10, 12):
        assert f"skipped iter_{it:07d}: another run's save" in console, console[-3000:]
    want = rows(ref)
    got = rows(cont)
    assert sorted(got) == [8, 9, 10, 11, 12], console[-3000:]
    for it in got:  # same layout: bit for bit
        assert [got[it][k] for k in KEYS] == [want[it][k] for k in KEYS], it
    # The newest save of the fork's lineage (12) is damaged: auto skips it and the original's
    # 10, resumes the fork's 9, and keeps the damaged dir as it was.
    flip_a_byte(checkpoint.iter_dir(root, 12))
    damaged = {p.name: p.read_bytes() for p in checkpoint.iter_dir(root, 12).iterdir()}
    console = train_jobs([(again, [*FORK, f"checkpoint.save={root}",
                                   "checkpoint.load=auto"])])[0].stdout
    assert re.search(r"skipped iter_0000012: it is damaged \(.*CRC", console), console[-3000:]
    assert "skipped iter_0000010: another run's save" in console, console[-3000:]
    assert f"resuming from {checkpoint.iter_dir(root, 9)}" in console, console[-3000:]
    got = rows(again)
    assert sorted(got) == [10, 11, 12]
    for it in got:
        assert [got[it][k] for k in KEYS] == [want[it][k] for k in KEYS], it
    kept = root / "iter_0000012.damaged"
    assert {p.name: p.read_bytes() for p in kept.iterdir()} == damaged
    assert checkpoint.read_tracker(root) == 12 and checkpoint.check_loadable(root, 12)
