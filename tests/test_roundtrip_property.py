"""Property: for random small model shapes, a save at one random layout loads exactly at another.

Each example runs one 4-process gloo world: build the model at layout A, set every weight and
Adam moment to a golden computed from the full logical tensor by plain slicing (helpers of
tests/helpers/layout_goldens.py and tests/helpers/checkpoint_matrix.py), save, rebuild at layout B,
pre-fill with a sentinel, load, and compare with the golden at B (rtol=0, atol=0). Few examples
per run (each costs a process launch); hypothesis prints the failing shapes and layouts if one
is found.
"""

from __future__ import annotations

from omegaconf import OmegaConf
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from multiproc import run_distributed
from recipes.config.validate import ConfigError, validate
from layout_goldens import build as _build, make_cfg
from checkpoint_matrix import WORLD, check_goldens, fill_sentinel, set_golden

# (tensor_model_parallel_size, gtp_remat_size) that fit a world of 4 (dp fills the rest).
GRIDS = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (1, 4)]


def _roundtrip(root: str, save_yaml: str, load_yaml: str):
    from megatron.core import parallel_state

    from ckpt import io as checkpoint

    model, opt, sched, record, cfg = _build(save_yaml)
    set_golden(model, opt, cfg)
    checkpoint.save_checkpoint(root, 1, model, opt, sched, {"consumed_samples": 0}, record)
    model, opt, sched, record, cfg = _build(load_yaml)
    fill_sentinel(model, opt)
    checkpoint.load_checkpoint(root, model, opt, sched, record)
    result = check_goldens(model, opt, cfg)
    parallel_state.destroy_model_parallel()
    return result


layouts = st.tuples(st.sampled_from(GRIDS), st.sampled_from([0, 1, 3, 8, 16, 32]))


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    heads=st.sampled_from([4, 8]),
    head_dim=st.integers(3, 9),
    ffn_quarter=st.integers(5, 30),
    swiglu=st.booleans(),
    save=layouts,
    load=layouts,
)
def test_random_shapes_load_exactly_at_another_layout(tmp_path_factory, heads, head_dim,
                                                      ffn_quarter, swiglu, save, load):
    assume(save != load)
    model = "tiny_swiglu" if swiglu else "tiny"
    dims = [f"model.hidden_size={heads * head_dim}", f"model.num_attention_heads={heads}",
            f"model.ffn_hidden_size={4 * ffn_quarter}"]
    yamls = []
    for (tp, g), pad in (save, load):
        yaml = make_cfg(model, tp, g, pad if g > 1 else None, WORLD, "logical", *dims)
        try:
            validate(OmegaConf.create(yaml), WORLD)
        except ConfigError:
            assume(False)  # e.g. pad 0 with a dim 0 that gtp_remat_size does not divide
        yamls.append(yaml)
    root = tmp_path_factory.mktemp("roundtrip")
    results = run_distributed(_roundtrip, WORLD, str(root), *yamls, timeout=300)
    for rank, (checked, problems) in enumerate(results):
        assert checked > 0 and not problems, (rank, problems[:5])
