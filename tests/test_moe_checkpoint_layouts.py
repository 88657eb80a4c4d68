"""MoE checkpoints across expert layouts, on CPU: every expert weight and Adam moment restored
exactly at every layout pair.

One 4-process gloo world hosts every layout in turn (megatron's process groups rebuilt for
each): moe_tiny (4 SwiGLU experts of width 100, hidden 72, 2 layers, fp32, Adam) at

* ``ep1``: tp1 x dp4, every rank holds all 4 experts (one optimizer);
* ``ep2etp2``: experts split over 2 ranks (a dense and an expert optimizer) x expert tensor
  parallel 2 (each expert's [gate | up] fc1 split by rows);
* ``ep2egtp2``: ep2 x expert GTP 2 at alignment 16 (fc1 200 -> 224 rows, fc2 72 -> 96);
* ``tp2sp_ep2``: tp2 + sequence parallelism, ep2 x etp1.

Each layout builds the model through ``recipes.worker.setup``, sets every weight and Adam
moment to a golden and saves through ``recipes.checkpoint``; then each layout loads every
checkpoint into a model pre-filled with a sentinel and compares with ``torch.equal``.

The goldens are independent of the code under test: the full logical tensor of each parameter
(an expert's: of its global index ``ep_rank * local experts + i``) holds ``k*1024 + row +
col/256`` (``k``: the parameter's index among the sorted logical names), ``exp_avg = golden +
0.5``, ``exp_avg_sq = golden * 2``, ``step = 7``. A rank's expected tensor is cut by plain
slicing: the TP chunk (experts: the expert-TP chunk; a gated fc1: gate rows then up rows of the
rank), then under expert GTP the zero tail padding and the rank's shard rows.
"""

from __future__ import annotations

import re
import time

import pytest
import torch
from hydra import compose, initialize_config_dir
from multiproc import reset_model_parallel, run_distributed
from omegaconf import OmegaConf

from recipes.config import register_configs

pytestmark = pytest.mark.multiprocess

register_configs()
WORLD = 4
SENTINEL = -999.0
STEP = 7.0
COMMON = ("model=moe_tiny", "parallelism=tp1", f"parallelism.nproc_per_node={WORLD}",
          "output_dir=/tmp/unused", "checkpoint.save=null", "data.cache_dir=/tmp/unused")
LAYOUTS = {
    "ep1": (),
    "ep2etp2": ("parallelism.expert_model_parallel_size=2",
                "parallelism.expert_tensor_parallel_size=2"),
    "ep2egtp2": ("parallelism.expert_model_parallel_size=2", "gtp.expert_gtp_remat_size=2",
                 "gtp.pad_for_alignment=16"),
    "tp2sp_ep2": ("parallelism.tensor_model_parallel_size=2", "parallelism.sequence_parallel=true",
                  "parallelism.expert_model_parallel_size=2",
                  "parallelism.expert_tensor_parallel_size=1"),
}
_LOCAL = re.compile(r"\.local_experts\.(\d+)\.")


def make_cfg(*overrides: str) -> str:
    from compose import CONF

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("config", overrides=[*COMMON, *overrides])
    return OmegaConf.to_yaml(OmegaConf.create(OmegaConf.to_container(cfg, resolve=True)))


# --------------------------------------------------------------------------------------------
# Worker-side helpers (independent of gtp/checkpoint.py and recipes/checkpoint/).
# --------------------------------------------------------------------------------------------
def _build(cfg_yaml: str):
    from recipes import checkpoint, worker
    from recipes.validate import validate

    reset_model_parallel()
    cfg = OmegaConf.create(cfg_yaml)
    layout = validate(cfg, torch.distributed.get_world_size())
    _, model, optimizer, scheduler = worker.setup(cfg, layout)
    return model, optimizer, scheduler, checkpoint.layout_record(layout), cfg


def _is_expert(name: str) -> bool:
    return ".local_experts." in name


def _logical_name(name: str, cfg) -> str:
    """``local_experts.<i>`` -> ``experts.<global index>`` (megatron's ep_rank * local + i)."""
    from megatron.core import parallel_state as ps

    local = int(cfg.model.num_moe_experts) // ps.get_expert_model_parallel_world_size()
    offset = ps.get_expert_model_parallel_rank() * local
    return _LOCAL.sub(lambda m: f".experts.{offset + int(m.group(1))}.", name)


def _all_logical_names(model, cfg) -> list:
    """Every logical name of the whole model (each expert template at every global index)."""
    names = set()
    for name, _ in model.module.named_parameters():
        if _is_expert(name):
            for e in range(int(cfg.model.num_moe_experts)):
                names.add(_LOCAL.sub(f".experts.{e}.", name))
        else:
            names.add(name)
    return sorted(names)


def _split(name, p):
    """(size, rank) of the group that splits ``p`` along ``partition_dim`` (1, 0 if none)."""
    from megatron.core import parallel_state as ps

    if not getattr(p, "tensor_model_parallel", False):
        return 1, 0
    if _is_expert(name):
        return ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


def _full_shape(name, p) -> tuple:
    shape = list(p._unsharded_shape if getattr(p, "is_gtp_weight_remat", False) else p.shape)
    size, _ = _split(name, p)
    if size > 1:
        shape[p.partition_dim] *= size
    return tuple(shape)


def _golden_full(k: int, shape: tuple) -> torch.Tensor:
    if len(shape) == 2:
        assert shape[0] < 1024 and shape[1] < 256, shape
        rows = torch.arange(shape[0], dtype=torch.float32)[:, None]
        return k * 1024 + rows + torch.arange(shape[1], dtype=torch.float32)[None, :] / 256
    assert len(shape) == 1 and shape[0] < 1024, shape
    return k * 1024 + torch.arange(shape[0], dtype=torch.float32)


def _local(full, name, p):
    size, rank = _split(name, p)
    t = full
    if size > 1 and name.endswith("linear_fc1.weight"):  # SwiGLU: [gate; up] per rank
        n = t.shape[0] // 2
        h = n // size
        t = torch.cat([t[rank * h:(rank + 1) * h], t[n + rank * h:n + (rank + 1) * h]])
    elif size > 1:
        t = t.chunk(size, dim=p.partition_dim)[rank]
    if getattr(p, "is_gtp_weight_remat", False):
        g, r, s = p.group.size(), p.group.rank(), p.shape[0]
        padded = torch.zeros((s * g, *t.shape[1:]), dtype=t.dtype)
        padded[:t.shape[0]] = t
        t = padded[r * s:(r + 1) * s]
    assert t.shape == p.shape, (name, t.shape, p.shape)
    return t


def _goldens(model, cfg) -> dict:
    """{local name: (param, weight, exp_avg, exp_avg_sq)} expected on this rank."""
    index = {n: k for k, n in enumerate(_all_logical_names(model, cfg), start=1)}
    out = {}
    for name, p in model.module.named_parameters():
        full = _golden_full(index[_logical_name(name, cfg)], _full_shape(name, p))
        out[name] = (p, *(_local(f, name, p) for f in (full, full + 0.5, full * 2)))
    return out


def _opt_states(optimizer):
    for co in getattr(optimizer, "chained_optimizers", [optimizer]):
        co.init_state_fn(co.optimizer, co.config)
        for group in co.optimizer.param_groups:
            for p in group["params"]:
                yield co.optimizer, p


@torch.no_grad()
def _set_golden(model, optimizer, cfg) -> None:
    gold = _goldens(model, cfg)
    by_id = {id(v[0]): v for v in gold.values()}
    for p, want, _, _ in gold.values():
        p.copy_(want)
    for opt, p in _opt_states(optimizer):
        _, _, m, v = by_id[id(p)]
        opt.state[p]["exp_avg"].copy_(m)
        opt.state[p]["exp_avg_sq"].copy_(v)
        opt.state[p]["step"] = torch.tensor(STEP)


@torch.no_grad()
def _fill_sentinel(model, optimizer) -> None:
    for p in model.parameters():
        p.fill_(SENTINEL)
    for opt, p in _opt_states(optimizer):
        opt.state[p]["exp_avg"].fill_(SENTINEL)
        opt.state[p]["exp_avg_sq"].fill_(SENTINEL)
        opt.state[p]["step"] = torch.tensor(SENTINEL)


def _diff(what, got, want):
    if got.shape == want.shape and torch.equal(got, want):
        return None
    if got.shape != want.shape:
        return f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    return f"{what}: {int((got != want).sum())}/{got.numel()} elements differ"


@torch.no_grad()
def _check(model, optimizer, cfg) -> tuple:
    """(expert tensors compared, all tensors compared, problems)."""
    gold = _goldens(model, cfg)
    names = {id(v[0]): n for n, v in gold.items()}
    problems, n, experts = [], 0, 0
    for name, (p, want, _, _) in gold.items():
        problems.append(_diff(f"{name} weight", p.detach(), want))
        n, experts = n + 1, experts + _is_expert(name)
    for opt, p in _opt_states(optimizer):
        name = names[id(p)]
        _, _, m, v = gold[name]
        st = opt.state[p]
        problems.append(_diff(f"{name} exp_avg", st["exp_avg"], m))
        problems.append(_diff(f"{name} exp_avg_sq", st["exp_avg_sq"], v))
        if float(st["step"]) != STEP:
            problems.append(f"{name} step {float(st['step'])}")
        n, experts = n + 2, experts + 2 * _is_expert(name)
    return experts, n, [x for x in problems if x]


def _matrix_worker(root: str, cfgs: dict) -> dict:
    from pathlib import Path

    from recipes import checkpoint

    out = {"loads": {}, "padded": {}}
    for name, cfg_yaml in cfgs.items():
        model, opt, sched, record, cfg = _build(cfg_yaml)
        out["padded"][name] = sum(getattr(p, "pad_length", 0) > 0
                                  for p in model.module.parameters())
        _set_golden(model, opt, cfg)
        checkpoint.save_checkpoint(Path(root) / name, 1, model, opt, sched,
                                   {"consumed_samples": 0}, record)
    for name, cfg_yaml in cfgs.items():
        model, opt, sched, record, cfg = _build(cfg_yaml)
        for src in cfgs:
            _fill_sentinel(model, opt)
            checkpoint.load_checkpoint(Path(root) / src, model, opt, sched, record)
            out["loads"][(src, name)] = _check(model, opt, cfg)
    reset_model_parallel()
    return out


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_layouts")
    cfgs = {name: make_cfg(*extra) for name, extra in LAYOUTS.items()}
    t0 = time.time()
    results = run_distributed(_matrix_worker, WORLD, str(root), cfgs, timeout=900)
    print(f"\nMoE matrix: {time.time() - t0:.0f}s")
    return results


def test_every_expert_layout_pair_restores_weights_and_moments_exactly(matrix):
    pairs = 0
    for rank, res in enumerate(matrix):
        for (src, dst), (experts, n, problems) in res["loads"].items():
            assert not problems, (rank, src, dst, problems[:5])
            assert experts > 0 and n > experts, (rank, src, dst, experts, n)
            pairs += 1
    assert pairs == WORLD * len(LAYOUTS) ** 2
    # Expert GTP padded every expert weight on every rank (the padded branch ran).
    assert all(res["padded"]["ep2egtp2"] > 0 for res in matrix)
