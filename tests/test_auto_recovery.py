"""``checkpoint.load=auto`` without a usable tracker, and with a torn newest save (issue 33
review): it follows the newest complete save's lineage, loads any iteration without a tracker,
and skips (keeps) a save whose metadata cannot be read."""

from __future__ import annotations

import shutil

import pytest

from ckpt import io as checkpoint
from ckpt.io import CheckpointError, lineage
from ckpt.io.manager import ResumePlan
from test_preemption import fake_save
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
    shutil.copy(root / lineage.RECORD, single / lineage.RECORD)
    return root, single


def _copy(src, dst, its=None):
    """The iter dirs of ``src`` (those of ``its``) and its lineage record; no tracker."""
    for p in src.iterdir():
        if p.is_dir() and (its is None or int(p.name[5:]) in its):
            shutil.copytree(p, dst / p.name)
    shutil.copy(src / lineage.RECORD, dst / lineage.RECORD)
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
    # The tracked save (the fork's 5) torn: its recorded lineage is followed, to the fork's 3;
    # without the record (a dir saved before it) refused, naming iteration 5.
    for record in (True, False):
        root = _copy(mixed, tmp_path / f"mixed{record}")
        (root / checkpoint.TRACKER).write_text("5\n")
        meta = checkpoint.iter_dir(root, 5) / ".metadata"
        meta.write_bytes(meta.read_bytes()[:20])
        if record:
            it, notes = ResumePlan.auto(root, repair=True)
            assert it == 3 and (root / "iter_0000005.damaged").is_dir(), notes
            assert any("skipped iter_0000006: another run's save" in n for n in notes), notes
            continue
        (root / lineage.RECORD).unlink()
        with pytest.raises(CheckpointError, match="continue iteration 5 \\(the tracker names\\): "
                                                  "iter_0000005 cannot be read"):
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


def test_a_forks_damaged_save_sends_auto_back_to_its_branch_point(tmp_path, monkeypatch):
    """Issue 59.1: run A saves 2, 4, 6, 8; a fork loads A's 4 and saves 5 into the same dir (the
    tracker moves back to 5); 5's ``.metadata`` is torn. ``auto`` follows the fork's lineage as
    recorded beside the tracker (back to its branch point, A's 4), never A's 8, and keeps 5 as
    ``.damaged``; without that record it refuses, naming iteration 5 and the way on."""
    from ckpt.io import lineage, manager

    chains = {2: [["a", 0]], 4: [["a", 0]], 6: [["a", 0]], 8: [["a", 0]],
              5: [["a", 0], ["f", 4]]}

    def load_common(root, it):  # stand-in saves; 5's common state cannot be read
        if it == 5:
            raise CheckpointError(f"{checkpoint.iter_dir(root, 5)}/.metadata: truncated")
        return None, {"train_state": {"lineage": chains[it]}}

    monkeypatch.setattr(manager, "load_common", load_common)
    for name in ("ck", "old"):
        for it in (2, 4, 6, 8, 5):  # as the saves finalize them, the fork's 5 last
            staged = checkpoint.staging_dir(tmp_path / name, it)
            fake_save(tmp_path / name, it).rename(staged)
            checkpoint.finalize_save(tmp_path / name, it, staged, chain=chains[it])
    root = tmp_path / "ck"
    assert checkpoint.read_tracker(root) == 5
    it, notes = ResumePlan.auto(root, verify=False, repair=True)
    assert it == 4, notes
    assert "iter_0000005 cannot be read; following its lineage as recorded in .lineage.json " \
           "(run f, from iteration 4)" in notes[0], notes
    for other in (8, 6):
        assert any(f"skipped iter_{other:07d}: another run's save" in n for n in notes), notes
    assert any("skipped iter_0000005: it is damaged" in n for n in notes), notes
    assert (root / "iter_0000005.damaged").is_dir() and checkpoint.read_tracker(root) == 4
    # A dir saved before the record existed (or with it lost): refused, nothing moved.
    old = tmp_path / "old"
    (old / lineage.RECORD).unlink()
    with pytest.raises(CheckpointError, match=r"cannot tell which saves of .* continue iteration "
                                              r"5 \(the tracker names\).*checkpoint.load_iteration"):
        ResumePlan.auto(old, verify=False, repair=True)
    assert checkpoint.read_tracker(old) == 5 and checkpoint.saved_iterations(old) == [2, 4, 5, 6, 8]
