"""A save that fails part-way (issue 33.9): a rank killed while its background save is in flight,
a disk that fills or a file-size limit hit mid-write, a file system that turns read-only, a
symlinked save dir, dir names with spaces and non-ASCII characters.

Each faulted run is one ``train.py`` (its exit code and closing summary are the behaviour); then
one in-world ``train_jobs`` world trains the uninterrupted reference (into a symlinked save dir
under odd names) and resumes every faulted run from its last complete save, compared bit for
bit with the reference over the 4 iterations after it. A rank killed *synchronously* while it
writes is ``tests/test_reliability.py::test_kill_during_save_fails_the_job_and_keeps_the_last_complete_checkpoint``.
"""

from __future__ import annotations

import os
import re

import pytest

from recipes import checkpoint
from resume_checks import EXACT_KEYS, assert_bit_for_bit, by_iteration

COMMON = ["train.train_iters=6", "optim.lr_warmup_iters=1", "checkpoint.save_interval=2"]
# Spaces and non-ASCII characters in every save dir. Hydra's override grammar takes such a
# value only quoted (checkpoint.save="..."); run dirs (hydra.run.dir) stay plain here.
ODD = "run ü 空 x"


def save_dir(path) -> str:
    """A quoted ``checkpoint.save`` override."""
    return f'checkpoint.save="{path}"'

# name -> (fault, extra overrides, the cause each rank's closing block must give).
CASES = {
    # The kernel's own file-size limit (RLIMIT_FSIZE) hit by rank 0's data file mid-write.
    "fsize": ("fsize:write:4:0", [],
              r"rank 0: writing its files failed: \[Errno 27\] .*RLIMIT_FSIZE, ulimit -f\)"),
    # Emulated (the OSError the kernel raises): a full disk, in rank 1's background writer.
    "enospc": ("enospc:async_write:4:1", ["checkpoint.async_save=true"],
               r"rank 1: writing its files failed: \[Errno 28\] No space left on device"),
    # Emulated: the file system turned read-only while rank 1 writes its files.
    "erofs": ("erofs:write:4:1", [],
              r"rank 1: writing its files failed: \[Errno 30\] Read-only file system"),
    # A rank SIGKILLed after iteration 5 while its save of iteration 4 is in flight.
    "async_kill": ("kill:train:5:1", ["checkpoint.async_save=true"], None),
}


@pytest.fixture(scope="module")
def faulted(train_run, tmp_path_factory):
    """name -> (run dir, train.py's CompletedProcess) of each case of :data:`CASES`."""
    root = tmp_path_factory.mktemp("faulted")
    runs = {}
    for name, (fault, extra, _) in CASES.items():
        out = root / name
        runs[name] = out, train_run(out, *COMMON, *extra, save_dir(out / f"{ODD} ckpt"), rc=1,
                                    timeout=300, env={"GTP_RECIPES_FAULT": fault})
    return runs


@pytest.fixture(scope="module")
def resumed(faulted, train_jobs, tmp_path_factory):
    """In one world: the uninterrupted reference into a symlinked save dir (both names odd),
    then each faulted run resumed from its last complete save, then a resume through the
    symlink. Returns (reference dir, real save dir, link, {name: resumed dir})."""
    root = tmp_path_factory.mktemp("resumed")
    real = root / f"saves é {ODD}"
    real.mkdir()
    link = root / f"link ø {ODD}"
    link.symlink_to(real, target_is_directory=True)
    reference = root / "reference"
    jobs = [(reference, [*COMMON, save_dir(link)])]
    dirs = {}
    for name, (out, _) in faulted.items():
        dirs[name] = root / f"resumed_{name}"
        jobs.append((dirs[name], [*COMMON, f'checkpoint.load="{out}/{ODD} ckpt"',
                                  save_dir(dirs[name] / f"{ODD} ckpt")]))
    dirs["symlink"] = root / "resumed_through_the_link"
    jobs.append((dirs["symlink"], [*COMMON, f'checkpoint.load="{link}"',
                                   "checkpoint.load_iteration=2",
                                   save_dir(dirs["symlink"] / f"{ODD} ckpt")]))
    train_jobs(jobs)
    return reference, real, link, dirs


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_failed_save_ends_the_job_with_its_cause_and_keeps_the_last_checkpoint(faulted, name):
    out, proc = faulted[name]
    fault, _, cause = CASES[name]
    assert f"injected fault {fault}" in proc.stdout
    summary = proc.stdout[proc.stdout.index("\nerror: worker rank"):]
    if cause is None:  # a rank that died: the launcher names it and its signal, first
        assert re.match(r"\nerror: worker rank 1 failed \(exit code -9\)", summary), summary
    else:  # every rank ends on the same one-line cause, no megatron BaseException
        blocks = re.findall(r"\n(?:error|then): worker rank \d failed \(exit code -?\d+\):\n(.*)",
                            summary)
        assert len(blocks) == 2, summary[:3000]
        for block in blocks:
            assert re.match(rf"CheckpointError: the (background )?save of iteration 4 into .* "
                            rf"failed on rank\(s\) \[\d\]: {cause}.*Nothing was renamed into "
                            rf"place .*latest_checkpointed_iteration.txt still names iteration 2$",
                            block), block
        assert "CheckpointException" not in summary and "<class" not in summary
    save = out / f"{ODD} ckpt"
    assert checkpoint.read_tracker(save) == 2
    assert checkpoint.saved_iterations(save) == [2]
    assert not checkpoint.iter_dir(save, 4).exists()
    assert not (checkpoint.staging_dir(save, 4) / ".metadata").exists()


@pytest.mark.parametrize("name", [*sorted(CASES), "symlink"])
def test_the_resume_after_it_is_the_uninterrupted_trajectory(resumed, name):
    reference, _, _, dirs = resumed
    want, _ = by_iteration(reference)
    got, _ = by_iteration(dirs[name])
    assert sorted(got) == [3, 4, 5, 6]
    # Same layout, weights, RNG and data position: bit for bit.
    assert_bit_for_bit(got, want, got, (*EXACT_KEYS, "num-zeros"), got_dir=dirs[name],
                       want_dir=reference)
    assert checkpoint.read_tracker(dirs[name] / f"{ODD} ckpt") == 6


def test_a_symlinked_save_dir_with_odd_names_saves_through_the_link(resumed):
    _, real, link, _ = resumed
    assert os.path.islink(link)
    assert checkpoint.read_tracker(real) == 6
    assert checkpoint.saved_iterations(real) == [2, 4, 6]
    assert checkpoint.saved_iterations(link) == [2, 4, 6]
    assert not list(real.glob(".iter_*"))  # no staging or replaced dir left behind
