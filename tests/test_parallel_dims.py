"""recipes/config/parallel_dims.py: the one owner of the process grid.

Expected sizes are computed here by hand from megatron's definitions (dense: world = tp x pp x
cp x gtp_remat_size x dp; experts: world = etp x ep x pp x expert_gtp_remat_size x edp), not by
the code under test.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
from compose import make_cfg

from recipes.config.errors import ConfigError
from recipes.config.parallel_dims import ParallelDims

ROOT = Path(__file__).resolve().parents[1]
MOE = ("model=moe_tiny",)


def test_every_size_of_an_asymmetric_grid():
    cfg = make_cfg(*MOE, "parallelism.tensor_model_parallel_size=2",
                   "parallelism.pipeline_model_parallel_size=2", "gtp.gtp_remat_size=2",
                   "gtp.pad_for_alignment=16", "parallelism.expert_model_parallel_size=2",
                   "parallelism.expert_tensor_parallel_size=1", "gtp.expert_gtp_remat_size=2")
    dims = ParallelDims.from_config(cfg, 32)
    assert dims.data_parallel_size == 32 // (2 * 2 * 2) == 4
    assert dims.expert_data_parallel_size == 32 // (1 * 2 * 2 * 2) == 4
    assert dims.model_parallel_size == 8
    assert dims.experts_split and dims.uses_gtp and dims.pad_for_alignment == 16
    assert dims.megatron_kwargs() == {
        "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
        "virtual_pipeline_model_parallel_size": None, "context_parallel_size": 1,
        "gtp_remat_size": 2, "expert_model_parallel_size": 2, "expert_tensor_parallel_size": 1,
        "expert_gtp_remat_size": 2}


def test_megatron_kwargs_are_initialize_model_parallel_parameters():
    from megatron.core import parallel_state

    names = set(inspect.signature(parallel_state.initialize_model_parallel).parameters)
    dims = ParallelDims.from_config(make_cfg(), 2)
    assert set(dims.megatron_kwargs()) <= names, set(dims.megatron_kwargs()) - names


def test_expert_gtp_alone_sets_gtp_up_and_pads():
    dims = ParallelDims.from_config(make_cfg(*MOE, "gtp.expert_gtp_remat_size=2"), 2)
    assert dims.gtp_remat_size == 1 and dims.expert_gtp_remat_size == 2
    assert dims.uses_gtp and dims.pad_for_alignment > 0
    plain = ParallelDims.from_config(make_cfg(), 2)
    assert not plain.uses_gtp and plain.pad_for_alignment == 0 and not plain.experts_split


@pytest.mark.parametrize("overrides, world", [
    ((), 1),
    (("parallelism.tensor_model_parallel_size=2",), 2),
    (("parallelism.pipeline_model_parallel_size=2", "gtp.gtp_remat_size=2"), 4),
    ((*MOE, "parallelism.expert_model_parallel_size=4"), 4),
    ((*MOE, "parallelism.tensor_model_parallel_size=2", "parallelism.expert_model_parallel_size=2",
      "parallelism.expert_tensor_parallel_size=1", "gtp.expert_gtp_remat_size=4"), 8),
    (("parallelism.data_parallel_size=3", "gtp.gtp_remat_size=2"), 6),
])
def test_the_default_world_fills_both_grids(overrides, world):
    """``parallelism.nproc_per_node``'s default (the config resolver, here under the preset that
    leaves it unset) is the least world that the grid accepts: the dense and the expert products
    both divide it."""
    cfg = make_cfg("parallelism=tp1", *overrides)
    assert cfg.parallelism.nproc_per_node == world
    dims = ParallelDims.from_config(cfg, world)
    assert world % dims.model_parallel_size == 0
    assert dims.data_parallel_size * dims.model_parallel_size == world
    assert dims.expert_data_parallel_size * dims.expert_tensor_parallel_size * \
        dims.expert_model_parallel_size * dims.pipeline_model_parallel_size * \
        dims.expert_gtp_remat_size == world


@pytest.mark.parametrize("overrides, world, named", [
    (("parallelism=tp2",), 3, "world size 3 is not divisible by tensor_model_parallel_size=2"),
    ((*MOE, "parallelism.expert_model_parallel_size=4"), 6, "the expert grid"),
    (("parallelism.data_parallel_size=3",), 2, "parallelism.data_parallel_size=3 does not match"),
    (("gtp.gtp_remat_size=0",), 2, "gtp.gtp_remat_size=0 is invalid"),
])
def test_a_grid_that_does_not_fit_is_refused_naming_it(overrides, world, named):
    with pytest.raises(ConfigError, match=named):
        ParallelDims.from_config(make_cfg(*overrides), world)


def _divides_the_world(path: Path) -> list[str]:
    """Lines of ``path`` that divide something named ``world_size`` (``//`` or ``%``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.FloorDiv, ast.Mod)):
            names = {n.id if isinstance(n, ast.Name) else getattr(n, "attr", None)
                     for n in (node.left,)}
            if "world_size" in names:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_only_the_grid_derives_sizes_from_the_world():
    """One owner: no module of recipes/ but recipes/config/parallel_dims.py divides the world size."""
    found = [line for path in sorted((ROOT / "recipes").rglob("*.py"))
             for line in _divides_the_world(path)]
    assert found and all(line.startswith("recipes/config/parallel_dims.py:") for line in found), found
