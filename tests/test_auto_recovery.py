"""``checkpoint.load=auto`` without a usable tracker, and with a torn newest save (issue 33
review): it follows the newest complete save's lineage, loads any iteration without a tracker,
and skips (keeps) a save whose metadata cannot be read."""

from __future__ import annotations

import shutil

import pytest

from recipes import checkpoint
from recipes.checkpoint import CheckpointError
from recipes.checkpoint.manager import ResumePlan
from test_requeue_lineage import flip_a_byte


@pytest.fixture(scope="module")
def saves(train_jobs, tmp_path_factory):
    """``(mixed, single)``: a run's saves 2, 4, 6 and a fork from its 2 into the same dir
    (saves 3, 5; the tracker names 5); ``single`` copies the original's saves alone."""
    base = tmp_path_factory.mktemp("auto")
    root = base / "a" / "checkpoints"
    train_jobs([
        (base / "a", ["train.train_iters=6", "checkpoint.save_interval=2"]),
        (base / "fork", [f"checkpoint.load={root}", "checkpoint.load_iteration=2",
                         f"checkpoint.save={root}", "checkpoint.allow_existing_save=true",
                         "train.train_iters=5", "checkpoint.save_interval=3"]),
    ])
    assert checkpoint.saved_iterations(root) == [2, 3, 4, 5, 6]
    assert checkpoint.read_tracker(root) == 5
    single = base / "single"
    for it in (2, 4, 6):
        shutil.copytree(checkpoint.iter_dir(root, it), checkpoint.iter_dir(single, it))
    return root, single


def _copy(src, dst, its=None):
    for p in src.iterdir():
        if p.is_dir() and (its is None or int(p.name[5:]) in its):
            shutil.copytree(p, dst / p.name)
    return dst


def test_auto_and_load_iteration_need_no_tracker(saves, tmp_path):
    mixed, single = saves
    # The first save's rename, then a crash before the tracker's write: one save, no tracker.
    one = _copy(single, tmp_path / "one", {2})
    it, notes = ResumePlan.auto(one)
    assert it == 2 and "no latest_checkpointed_iteration.txt; following the lineage of the " \
                       "newest complete save, iter_0000002" in notes[0], notes
    # Several saves, the tracker deleted or garbled: the newest's lineage, any iteration loads.
    for tracker in (None, b"x\x00"):
        root = _copy(single, tmp_path / f"t{tracker is None}")
        if tracker is not None:
            (root / checkpoint.TRACKER).write_bytes(tracker)
        assert ResumePlan.auto(root)[0] == 6
        for n in (2, 4, 6):
            assert checkpoint.check_loadable(root, n) == checkpoint.iter_dir(root, n)
            assert ResumePlan.open(root, n).iteration == n
    # Two lineages, no tracker, the newest save damaged: the newest save's lineage (the
    # original's), never the fork's newer save.
    root = _copy(mixed, tmp_path / "mixed")
    flip_a_byte(checkpoint.iter_dir(root, 6))
    it, notes = ResumePlan.auto(root, repair=True)
    assert it == 4, notes
    assert any("skipped iter_0000005: another run's save" in n for n in notes), notes
    assert any("skipped iter_0000006: it is damaged" in n for n in notes), notes
    assert checkpoint.read_tracker(root) == 4  # repaired
    assert (root / "iter_0000006.damaged").is_dir()
    with pytest.raises(CheckpointError, match="has no latest_checkpointed_iteration.txt"):
        checkpoint.check_loadable(tmp_path / "one")  # no iteration: the tracker is needed


def test_auto_skips_and_keeps_a_torn_newest_save(saves, tmp_path):
    mixed, single = saves
    root = _copy(single, tmp_path / "single")
    (root / checkpoint.TRACKER).write_text("6\n")
    meta = checkpoint.iter_dir(root, 6) / ".metadata"
    meta.write_bytes(meta.read_bytes()[:20])
    torn = {p.name: p.read_bytes() for p in checkpoint.iter_dir(root, 6).iterdir()}
    it, notes = ResumePlan.auto(root, repair=True)
    assert it == 4 and any("skipped iter_0000006: it is damaged" in n for n in notes), notes
    kept = root / "iter_0000006.damaged"
    assert {p.name: p.read_bytes() for p in kept.iterdir()} == torn
    assert checkpoint.read_tracker(root) == 4
    # The tracked save torn, the saves left of two lineages: refused, naming both.
    root = _copy(mixed, tmp_path / "mixed")
    (root / checkpoint.TRACKER).write_text("5\n")
    meta = checkpoint.iter_dir(root, 5) / ".metadata"
    meta.write_bytes(meta.read_bytes()[:20])
    with pytest.raises(CheckpointError, match="iter_0000005: it cannot be read.*iter_0000006 and "
                                              "iter_0000003 are not of one lineage"):
        ResumePlan.auto(root, repair=True)
    assert checkpoint.saved_iterations(root) == [2, 3, 4, 5, 6]


@pytest.mark.e2e
def test_runs_resume_from_a_dir_without_a_tracker(saves, train_jobs, tmp_path):
    """The advice auto's refusal gives (checkpoint.load_iteration=N) and auto itself, as a run:
    both resume a dir without a tracker and train on."""
    _, single = saves
    a, b = _copy(single, tmp_path / "a"), _copy(single, tmp_path / "b")
    jobs = train_jobs([
        (tmp_path / "ja", [f"checkpoint.load={a}", "checkpoint.load_iteration=6",
                           f"checkpoint.save={a}", "train.train_iters=8"]),
        (tmp_path / "jb", ["checkpoint.load=auto", f"checkpoint.save={b}",
                           "train.train_iters=8"]),
    ])
    for job, root in zip(jobs, (a, b)):
        assert "(resumed from 6)" in job.stdout, job.stdout[-3000:]
        assert checkpoint.read_tracker(root) == 8
    assert "no latest_checkpointed_iteration.txt; following the lineage" in jobs[1].stdout
