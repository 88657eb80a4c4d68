"""Checkpoints written by an earlier version of this code still load exactly.

``tests/golden/compat/`` holds tiny checkpoints written once by the code of 2026-12-03
(tests/helpers/compat_checkpoint.py: fp32 with GTP; bf16 with the distributed optimizer and
GTP; bf16 with tied embeddings at tp2 x pp2) and of 2026-12-06 (fp32 with the distributed
optimizer's ``fully_reshardable`` format at dp2 x tp2). Each is loaded by today's code at the layout that
wrote it and at another, into a model and optimizer pre-filled with a sentinel, and every
weight, fp32 main param, ``exp_avg``, ``exp_avg_sq`` and ``step`` is compared with ``==`` to the
goldens it was written with (tests/helpers/layout_goldens.py: values computed from each
parameter's name and position, not read back from any checkpoint).
"""

from __future__ import annotations

import shutil

import pytest

from compat_checkpoint import CASES, FIXTURE, WORLD, case_cfg
from multiproc import run_distributed

pytestmark = pytest.mark.multiprocess

_BF16 = ("precision=bf16",)
# Layouts that did not write the checkpoint they load (same model, same precision).
OTHER = {
    "fp32_g2a16": ("fp32_tp2", (2, 1, None, ())),
    "bf16_distopt_g2a16": ("bf16_tp2", (2, 1, None, _BF16)),
    "bf16_tp2pp2_tied": ("bf16_dp4_distopt_tied", (1, 1, None, (
        *_BF16, "optim.use_distributed_optimizer=true",
        "model.share_embeddings_and_output_weights=true"))),
    # the distributed optimizer's fully_reshardable file at dp2 x tp2, read at dp2 x g2a16
    "fp32_distopt_tp2": ("fp32_distopt_g2a16",
                         (1, 2, 16, ("optim.use_distributed_optimizer=true",))),
}


def _load_worker(root: str, pairs: list) -> dict:
    """Load each (source case, target config) pair; {(source, target): (entries, tensors
    compared, problems)}."""
    from pathlib import Path

    from megatron.core import parallel_state

    from layout_goldens import build, check, fill
    from ckpt import io as checkpoint

    out = {}
    for src, target, cfg_yaml in pairs:
        model, opt, sched, record, cfg = build(cfg_yaml)
        entries = fill(model, opt, cfg, sentinel=True)
        checkpoint.load_checkpoint(Path(root) / src, model, opt, sched, record)
        out[(src, target)] = (entries, *check(model, opt, cfg))
    parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def loads(tmp_path_factory):
    root = tmp_path_factory.mktemp("compat")
    for name in CASES:
        shutil.copytree(FIXTURE / name, root / name)
    cases = {**CASES, **dict(OTHER.values())}
    pairs = [(src, src, case_cfg(src)) for src in CASES]
    pairs += [(src, target, case_cfg(target, cases)) for src, (target, _) in OTHER.items()]
    return run_distributed(_load_worker, WORLD, str(root), pairs, timeout=300)


def test_the_fixture_holds_every_case():
    for name in CASES:
        assert (FIXTURE / name / "iter_0000001" / ".metadata").is_file(), name
        assert (FIXTURE / name / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


@pytest.mark.parametrize("src", sorted(CASES))
def test_an_earlier_checkpoint_loads_exactly_at_the_layout_that_wrote_it(loads, src):
    for rank, result in enumerate(loads):
        entries, n, problems = result[(src, src)]
        assert entries > 0 and n > 0, (rank, entries, n)
        assert problems == [], (rank, problems[:5])


@pytest.mark.parametrize("src", sorted(OTHER))
def test_an_earlier_checkpoint_loads_exactly_at_another_layout(loads, src):
    target = OTHER[src][0]
    for rank, result in enumerate(loads):
        entries, n, problems = result[(src, target)]
        assert entries > 0 and n > 0, (rank, entries, n)
        assert problems == [], (rank, problems[:5])
