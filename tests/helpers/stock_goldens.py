"""Stock GTP checkpoints for tests/test_stock_format.py and tests/test_gtp_cli.py (the former's
docstring says what the world writes and reloads): the goldens, by plain slicing of full logical
tensors, independently of ``gtp.shards``, and :func:`stock_checkpoints`, built once a session."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
H, F, V, SEQ = 72, 200, 320, 64
ITER = 3
STEP = 7.0
SENTINEL = -999.0
GARBAGE = -5555.0  # padding rows of params and moments in the stock writer's memory
MODELS = ("tiny", "tiny_swiglu")
# (layer 1 = second layer) logical fc1 row changed in the "perturbed" checkpoint
PERTURB_LAYER, PERTURB_ROW = 1, 110


# ------------------------------------------------------------------------------------------
# Golden values (pure torch; used by the ranks and by the single-process checks)
# ------------------------------------------------------------------------------------------
def _sub(name: str):
    """(value offset, name within its layer) of a GPTModel parameter name."""
    m = re.match(r"decoder\.layers\.(\d+)\.(.+)$", name)
    if m:
        return (int(m.group(1)) + 1) * 1_000_000, m.group(2)
    if name == "embedding.word_embeddings.weight":
        return 0, "word"
    if name == "output_layer.weight":
        return 5_000_000, "out"
    if name == "embedding.position_embeddings.weight":
        return 6_000_000, "pos"
    return 7_000_000, name  # final layernorm


def _full_shape(sub: str, swiglu: bool):
    ff = 2 * F if swiglu else F
    return {
        "word": (V, H), "out": (V, H), "pos": (SEQ, H),
        "self_attention.linear_qkv.weight": (3 * H, H), "self_attention.linear_qkv.bias": (3 * H,),
        "self_attention.linear_proj.weight": (H, H),
        "mlp.linear_fc1.weight": (ff, H), "mlp.linear_fc1.bias": (ff,),
        "mlp.linear_fc2.weight": (H, F),
    }.get(sub, (H,))  # norms, row-parallel biases


def _split(sub: str) -> str | None:
    """How TP splits it: 'rows' (column-parallel / vocab-parallel), 'cols' (row-parallel)."""
    if sub in ("word", "out") or sub.startswith(("self_attention.linear_qkv.weight",
                                                  "self_attention.linear_qkv.bias",
                                                  "mlp.linear_fc1.weight", "mlp.linear_fc1.bias")):
        return "rows"
    if sub in ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight"):
        return "cols"
    return None


def full_logical(name: str, swiglu: bool):
    """The whole logical tensor: value = offset + row * 1000 + column (1-D: offset + index).

    Exact in fp32 (< 2**23); Adam moments use -value and value + 0.5 (also exact)."""
    import torch

    off, sub = _sub(name)
    shape = _full_shape(sub, swiglu)
    rows = torch.arange(shape[0], dtype=torch.float64)
    if len(shape) == 1:
        return (off + rows).float()
    cols = torch.arange(shape[1], dtype=torch.float64)
    return (off + rows[:, None] * 1000 + cols[None, :]).float()


def tp_local(name: str, full, tp: int, k: int, swiglu: bool):
    """The TP rank's logical slice, by plain slicing (gated fc1: its gate rows, then up rows)."""
    import torch

    _, sub = _sub(name)
    how = _split(sub)
    if how is None:
        return full
    if how == "cols":
        c = full.shape[1] // tp
        return full[:, k * c:(k + 1) * c]
    if swiglu and sub.startswith("mlp.linear_fc1"):
        h = F // tp
        return torch.cat([full[k * h:(k + 1) * h], full[F + k * h:F + (k + 1) * h]])
    n = full.shape[0] // tp
    return full[k * n:(k + 1) * n]


def gtp_shard(local, shard_rows: int, g: int, r: int, fill: float):
    """GTP rank r's padded shard: the TP-local tensor with tail rows of ``fill``, split in g."""
    import torch

    pad = shard_rows * g - local.shape[0]
    assert 0 <= pad, (local.shape, shard_rows, g)
    padded = torch.cat([local, torch.full((pad, *local.shape[1:]), fill)])
    return padded[r * shard_rows:(r + 1) * shard_rows]


# ------------------------------------------------------------------------------------------
# The 4-rank run
# ------------------------------------------------------------------------------------------
def _named_params(model):
    return dict(getattr(model, "module", model).named_parameters())


def _opt_states(opt):
    """(torch optimizer state dict, param) for every param of megatron's (chained) optimizer."""
    for o in getattr(opt, "chained_optimizers", [opt]):
        for group in o.optimizer.param_groups:
            for p in group["params"]:
                yield o, p


def _expected_local(name, p, swiglu, fill=GARBAGE):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.generalized_tensor_parallelism import is_gtp_param

    tp = parallel_state.get_tensor_model_parallel_world_size()
    k = parallel_state.get_tensor_model_parallel_rank()
    local = tp_local(name, full_logical(name, swiglu), tp, k, swiglu)
    if is_gtp_param(p):
        local = gtp_shard(local, p.shape[0], p.group.size(), p.group.rank(), fill)
    return local


def _set_golden(model, opt, swiglu):
    import torch

    names = {id(p): n for n, p in _named_params(model).items()}
    with torch.no_grad():
        for name, p in _named_params(model).items():
            p.copy_(_expected_local(name, p, swiglu))
        for o in getattr(opt, "chained_optimizers", [opt]):
            o.init_state_fn(o.optimizer, o.config)  # Adam state before the first step
        for o, p in _opt_states(opt):
            st = o.optimizer.state[p]
            gold = _expected_local(names[id(p)], p, swiglu, fill=0.0)
            garbage = _expected_local(names[id(p)], p, swiglu, fill=GARBAGE) != gold
            st["exp_avg"].copy_(torch.where(garbage, -7777.0, -gold))
            st["exp_avg_sq"].copy_(torch.where(garbage, 7777.0, gold + 0.5))
            st["step"] = torch.tensor(STEP)


def _check_golden(model, opt, swiglu) -> tuple[list, int]:
    import torch

    names = {id(p): n for n, p in _named_params(model).items()}
    problems, checked = [], 0
    for name, p in _named_params(model).items():
        want = _expected_local(name, p, swiglu)
        checked += 1
        if not torch.equal(p.detach(), want):
            bad = (p.detach() != want).nonzero()[0].tolist()
            problems.append(f"{name}: first wrong element {bad}: {p.detach()[tuple(bad)].item()} "
                            f"!= {want[tuple(bad)].item()}")
    for o, p in _opt_states(opt):
        st, want = o.optimizer.state[p], _expected_local(names[id(p)], p, swiglu)
        for key, value in (("exp_avg", -want), ("exp_avg_sq", want + 0.5)):
            checked += 1
            if not torch.equal(st[key], value):
                problems.append(f"{key} of {names[id(p)]} differs")
        if float(st["step"]) != STEP:
            problems.append(f"step of {names[id(p)]}: {st['step']}")
    return problems, checked


def _write_and_reload(root: str, cfgs: dict):
    """On each of 4 ranks: the steps of the module docstring, for each model."""
    import torch
    from megatron.core import parallel_state
    from omegaconf import OmegaConf

    from ckpt.format import logical_format
    from ckpt import io as checkpoint
    from recipes.run import worker
    from recipes.config.schema import to_dict
    from recipes.config.validate import validate

    assert torch.distributed.get_world_size() == 4
    out = {}
    for model_name, paths in cfgs.items():
        swiglu = model_name.endswith("swiglu")
        base = Path(root) / model_name
        cfg = OmegaConf.load(paths["save"])
        parallel_dims = validate(cfg, 4)
        assert (parallel_dims.tensor_model_parallel_size, parallel_dims.gtp_remat_size,
                parallel_dims.pad_for_alignment) == (2, 2, 16), parallel_dims
        _, model, opt, sched = worker.setup(cfg, parallel_dims)
        assert not logical_format.is_installed(), "gtp.checkpoint_layout=stock must be stock"
        _set_golden(model, opt, swiglu)
        record = checkpoint.layout_record(parallel_dims)
        train_state = {"consumed_samples": 48, "wandb_run_id": "stock-test",
                       "config": to_dict(cfg)}
        checkpoint.save_checkpoint(base / "stock", ITER, model, opt, sched, train_state, record)
        logical_format.install()
        checkpoint.save_checkpoint(base / "logical_twin", ITER, model, opt, sched, train_state,
                                   record)
        parallel_state.destroy_model_parallel()

        results = {}
        for tp in (2, 1):
            cfg = OmegaConf.load(paths[f"tp{tp}"])
            parallel_dims = validate(cfg, 4)
            assert (parallel_dims.tensor_model_parallel_size,
                    parallel_dims.gtp_remat_size) == (tp, 1)
            _, model, opt, sched = worker.setup(cfg, parallel_dims)
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(SENTINEL)
            record = checkpoint.layout_record(parallel_dims)
            common = checkpoint.load_checkpoint(base / "stock", model, opt, sched, record)
            problems, checked = _check_golden(model, opt, swiglu)
            cache = base / "stock" / "gtp_converted" / f"iter_{ITER:07d}" / ".metadata"
            results[tp] = {"problems": problems, "checked": checked,
                           "iteration": common["iteration"],
                           "consumed": common["train_state"]["consumed_samples"],
                           "cache_mtime": cache.stat().st_mtime_ns}
            if tp == 2:
                checkpoint.save_checkpoint(base / "tp2", ITER, model, opt, sched,
                                           common["train_state"], record)
                # One logical fc1 row changed: TP rank 1 holds fc1 rows F/2.. (non-gated) or
                # gate rows F/2.. (gated) of the logical tensor; local row 10 = row 110.
                if parallel_state.get_tensor_model_parallel_rank() == 1:
                    w = _named_params(model)[f"decoder.layers.{PERTURB_LAYER}.mlp.linear_fc1.weight"]
                    with torch.no_grad():
                        w[PERTURB_ROW - F // 2] += 0.5
                checkpoint.save_checkpoint(base / "perturbed", ITER, model, opt, sched,
                                           common["train_state"], record)
            parallel_state.destroy_model_parallel()
        out[model_name] = results
    return out


# ------------------------------------------------------------------------------------------
# The world (shared by test_stock_format.py and test_gtp_cli.py; built once per session)
# ------------------------------------------------------------------------------------------
_BUILT: dict = {}


def _cfg_file(path: Path, *overrides: str) -> str:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from recipes.config.schema import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["output_dir=/tmp/unused", "checkpoint.save=null",
                                           "data.cache_dir=/tmp/unused", "data=mock",
                                           "logger=none", *overrides])
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))))
    return str(path)


def stock_checkpoints(tmp_path_factory) -> dict:
    """Build (once per session) the checkpoints of the module docstring.

    Returns ``{"root": Path, "results": {model: {tp: {...}}}}``; checkpoints under
    ``root/<model>/{stock,logical_twin,tp2,perturbed}``."""
    if "value" not in _BUILT:
        from multiproc import run_distributed

        root = tmp_path_factory.mktemp("stock_gtp")
        cfgs = {}
        for model in MODELS:
            cfgs[model] = {
                "save": _cfg_file(root / f"{model}_save.yaml", f"model={model}",
                                  "parallelism=tp2dp2", "gtp=tp2_align16",
                                  "gtp.checkpoint_layout=stock"),
                "tp2": _cfg_file(root / f"{model}_tp2.yaml", f"model={model}",
                                 "parallelism=tp2dp2", "gtp=off"),
                "tp1": _cfg_file(root / f"{model}_tp1.yaml", f"model={model}",
                                 "parallelism=tp1", "parallelism.nproc_per_node=4", "gtp=off"),
            }
        results = run_distributed(_write_and_reload, 4, str(root), cfgs, timeout=420)
        assert all(r == results[0] for r in results), "ranks disagree"
        _BUILT["value"] = {"root": root, "results": results[0]}
    return _BUILT["value"]
