"""The committed compatibility checkpoints: tiny checkpoints written once by the code of
2026-12-03 (main at e9dbbc3), kept in ``tests/golden/compat/`` so that every later change of
the code must still load them exactly (tests/test_checkpoint_compat.py).

Each case saves the goldens of ``layout_goldens`` (weights, fp32 main params, ``exp_avg``,
``exp_avg_sq``, ``step``: values computed from the parameter's name and position, independent
of the code under test) at iteration 1 from a 4-process gloo world.

Never regenerate these to make a test pass: a change that cannot read them breaks every user's
checkpoint. ``python tests/helpers/compat_checkpoint.py DIR`` writes a fresh set into DIR (to
compare, or to add a case: add it to :data:`CASES` and copy only the new directory).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "golden" / "compat"
WORLD = 4

# A Llama-style model small enough for a fixture of a few hundred KB: 4 query heads of 4
# channels in 2 K/V groups (QKV rows (4 + 2 * 2) * 4 = 32), SwiGLU fc1 48 rows, vocab 257
# padded to 258. At a16 x g2 the 16-row linear_proj is padded to 32: GTP rank 1 holds only
# padding; fc1's 48 rows pad to 64, the shards straddle gate and up.
MODEL = ("model=llama_tiny", "model.hidden_size=16", "model.num_attention_heads=4",
         "model.num_query_groups=2", "model.ffn_hidden_size=24",
         "model.make_vocab_size_divisible_by=2")
_BF16 = ("precision=bf16",)
_DISTOPT = ("optim.use_distributed_optimizer=true",)
_PP2 = ("parallelism.pipeline_model_parallel_size=2",)

# name: (tensor_model_parallel_size, gtp_remat_size, pad_for_alignment, other overrides); the
# data-parallel size fills the world of 4.
CASES = {
    "fp32_g2a16": (1, 2, 16, ()),
    "bf16_distopt_g2a16": (1, 2, 16, (*_BF16, *_DISTOPT)),
    # Tied embeddings: the last stage's output layer holds a copy of the embedding.
    "bf16_tp2pp2_tied": (2, 1, None,
                         (*_BF16, *_PP2, "model.share_embeddings_and_output_weights=true")),
    # Written by the code of 2026-12-06 (main at 8d3df5f): the distributed optimizer's
    # fully_reshardable format at dp2 x tp2 in fp32, before the fully_sharded_model_space one.
    "fp32_distopt_tp2": (2, 1, None, _DISTOPT),
}


def case_cfg(name: str, cases: dict = CASES) -> str:
    """The resolved run config (YAML) of case ``name`` at a world of :data:`WORLD`."""
    from layout_goldens import make_cfg

    tp, g, pad, extra = cases[name]
    return make_cfg("llama_tiny", tp, g, pad, WORLD, "logical", *MODEL[1:], *extra)


def _save_worker(root: str, cfgs: dict) -> dict:
    """Fill each case's model with the goldens and save it to ``root/<case>`` (iteration 1)."""
    from megatron.core import parallel_state

    from layout_goldens import build, fill
    from ckpt import io as checkpoint

    filled = {}
    for name, cfg_yaml in cfgs.items():
        model, opt, sched, record, cfg = build(cfg_yaml)
        filled[name] = fill(model, opt, cfg, sentinel=False)
        checkpoint.save_checkpoint(Path(root) / name, 1, model, opt, sched,
                                   {"consumed_samples": 0}, record)
    parallel_state.destroy_model_parallel()
    return filled


def write(root: Path) -> dict:
    """Write every case of :data:`CASES` under ``root``; returns {case: entries filled} of rank 0."""
    from multiproc import run_distributed

    cfgs = {name: case_cfg(name) for name in CASES}
    return run_distributed(_save_worker, WORLD, str(root), cfgs, timeout=300)[0]


if __name__ == "__main__":
    sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tests" / "helpers")]
    if len(sys.argv) != 2:
        sys.exit(f"usage: python {sys.argv[0]} DIR (a new directory; the fixture is {FIXTURE})")
    out = Path(sys.argv[1])
    if out.exists() and any(out.iterdir()):
        sys.exit(f"error: {out} is not empty; give a new directory")
    print(write(out))
