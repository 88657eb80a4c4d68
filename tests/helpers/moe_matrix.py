"""The expert layout matrix of tests/test_moe_checkpoint_layouts.py (its docstring says how the
goldens are built): the layouts and pairs, the goldens of every weight, fp32 main param, Adam
or Muon moment and router expert bias, and the worker that saves and loads every pair in one
world (:func:`matrix_worker`)."""

from __future__ import annotations

import re

import torch
from hydra import compose, initialize_config_dir
from layout_goldens import build as _build, gtp_shard
from multiproc import reset_model_parallel
from optimizer_entries import main_param_entries as _entries
from omegaconf import OmegaConf

from recipes.config.schema import register_configs


register_configs()
WORLD = 4
SENTINEL = -999.0
STEP = 7.0
COMMON = ("model=moe_tiny", "parallelism=tp1", f"parallelism.nproc_per_node={WORLD}",
          "output_dir=/tmp/unused", "checkpoint.save=null", "data.cache_dir=/tmp/unused")
EP2 = ("parallelism.expert_model_parallel_size=2",)
LAYOUTS = {
    "ep1": (),
    "ep2do_bf16": (*EP2, "optim.use_distributed_optimizer=true", "precision=bf16"),
    "ep2etp2": (*EP2, "parallelism.expert_tensor_parallel_size=2"),
    "ep2egtp2": (*EP2, "gtp.expert_gtp_remat_size=2", "gtp.pad_for_alignment=16"),
    "tp2sp_ep2": ("parallelism.tensor_model_parallel_size=2", "parallelism.sequence_parallel=true",
                  *EP2, "parallelism.expert_tensor_parallel_size=1"),
    "pp2ep2": ("parallelism.pipeline_model_parallel_size=2", *EP2),
    "ep4_bf16": ("parallelism.expert_model_parallel_size=4", "precision=bf16"),
    "egtp2do_bf16": ("gtp.expert_gtp_remat_size=2", "gtp.pad_for_alignment=16",
                     "optim.use_distributed_optimizer=true", "precision=bf16"),
}
# Layout i loads the saves of layouts i+1, i+2 and i+5 (mod 8): the differences +-1, +-2, +-5
# are six distinct residues, so no pair of layouts is loaded twice (the four pairs i, i+4 are
# not loaded); each save is read at 3 other layouts and each layout reads 3 saves. In this
# order the bf16 distributed-optimizer save (ep2do_bf16) is read at ep1 (one plain fp32
# optimizer), tp2sp_ep2 and egtp2do_bf16, and it reads ep2etp2, ep2egtp2 and ep4_bf16; the
# expert-GTP distributed-optimizer save (egtp2do_bf16: expert optimizer state sharded over
# expert data parallel 2) is read at ep2etp2, pp2ep2 and ep4_bf16, and it reads ep1,
# ep2do_bf16 and tp2sp_ep2.
_ORDER = list(LAYOUTS)
PAIRS = [(_ORDER[(i + d) % len(_ORDER)], dst) for i, dst in enumerate(_ORDER) for d in (1, 2, 5)]
# optim=muon (megatron's TensorParallelMuon for the 2-D weights, Adam for the rest): experts
# split (ep2, expert GTP) give megatron a Muon optimizer per expert kind and one Adam
# (chain entries 0, 1, 2: the keys carry no "chained_<i>." prefix), experts laid out like
# the dense weights (ep1, tp2) one Muon and one Adam ("chained_0." / "chained_1." keys).
# Each reads the saves of the three others: joins, splits, and a TP change on each side.
MUON = ("optim=muon",)
MUON_LAYOUTS = {
    "muon_ep1": MUON,
    "muon_ep2": (*MUON, *EP2),
    "muon_tp2": (*MUON, "parallelism.tensor_model_parallel_size=2",
                 "parallelism.sequence_parallel=true"),
    "muon_egtp2": (*MUON, "gtp.expert_gtp_remat_size=2", "gtp.pad_for_alignment=16"),
}
MUON_PAIRS = [(src, dst) for dst in MUON_LAYOUTS for src in MUON_LAYOUTS if src != dst]
# Layer 1 dense (moe_layer_freq 2) on pipeline stage 1: megatron builds that stage an expert
# Muon optimizer with no params, whose file entry holds no tensors; read at its own layout.
MUON_NO_EXPERTS_ON_A_STAGE = "muon_pp2ep2_freq2"
MUON_SELF = [(MUON_NO_EXPERTS_ON_A_STAGE, MUON_NO_EXPERTS_ON_A_STAGE)]
# One multi-token prediction layer (its MLP MoE, as the decoder's last layer): its experts and
# the last stage's copy of the word embedding across expert and pipeline layouts, with the
# distributed optimizer under pp2 (a grad-buffer bucket of its own for the first stage's
# embedding); each reads the saves of the two others.
MTP = ("model.mtp_num_layers=1",)
MTP_LAYOUTS = {
    "mtp_ep1": MTP,
    "mtp_pp2ep2do_bf16": (*MTP, "parallelism.pipeline_model_parallel_size=2", *EP2,
                          "optim.use_distributed_optimizer=true", "precision=bf16"),
    "mtp_ep2egtp2": (*MTP, *EP2, "gtp.expert_gtp_remat_size=2", "gtp.pad_for_alignment=16"),
}
MTP_PAIRS = [(src, dst) for dst in MTP_LAYOUTS for src in MTP_LAYOUTS if src != dst]
# DeepSeek-V3's routing on moe_tiny's dims (docs/moe.md): layer 0 dense, layer 1 MoE with 8
# experts, sigmoid scores with the expert bias, 4 groups of 2 experts of which each token
# picks 2 (node-limited routing), its top-2 scaled by 2.5, and a shared expert of width 64.
DEEPSEEK = ("model.num_moe_experts=8", "model.moe_layer_freq=[0,1]",
            "model.moe_router_score_function=sigmoid", "model.moe_router_enable_expert_bias=true",
            "model.moe_router_num_groups=4", "model.moe_router_group_topk=2",
            "model.moe_router_topk_scaling_factor=2.5",
            "model.moe_shared_expert_intermediate_size=64",
            "model.moe_router_load_balancing_type=seq_aux_loss", "model.moe_aux_loss_coeff=0.0001")
DS_LAYOUTS = {
    "ds_ep1": DEEPSEEK,
    "ds_ep2egtp2": (*DEEPSEEK, *EP2, "gtp.expert_gtp_remat_size=2", "gtp.pad_for_alignment=16"),
    "ds_etp2do_bf16": (*DEEPSEEK, "parallelism.expert_tensor_parallel_size=2",
                       "optim.use_distributed_optimizer=true", "precision=bf16"),
}
DS_PAIRS = [(src, dst) for dst in DS_LAYOUTS for src in DS_LAYOUTS if src != dst]
_LOCAL = re.compile(r"\.local_experts\.(\d+)\.")
_BIAS = re.compile(r"decoder\.layers\.(\d+)\.mlp\.router\.expert_bias$")


def make_cfg(*overrides: str) -> str:
    from compose import CONF

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("config", overrides=[*COMMON, *overrides])
    return OmegaConf.to_yaml(OmegaConf.create(OmegaConf.to_container(cfg, resolve=True)))


# --------------------------------------------------------------------------------------------
# Worker-side helpers (independent of ckpt/format/logical_format.py and ckpt/io/).
# --------------------------------------------------------------------------------------------
def _is_expert(name: str) -> bool:
    return ".local_experts." in name


def _params(model, cfg) -> list:
    """[(local name, global logical name, param)] of this rank: the layer number plus this
    pipeline stage's offset (computed here: stage p holds layers p * num_layers / pp on),
    ``local_experts.<i>`` -> ``experts.<ep_rank * local + i>`` (megatron's global index)."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import unwrap_model

    from recipes.model.build import model_chunks

    chunks = model_chunks(model)
    assert len(chunks) == 1, len(chunks)
    pp = ps.get_pipeline_model_parallel_world_size()
    offset = ps.get_pipeline_model_parallel_rank() * (int(cfg.model.num_layers) // pp)
    local = int(cfg.model.num_moe_experts) // ps.get_expert_model_parallel_world_size()
    first = ps.get_expert_model_parallel_rank() * local
    out = []
    for name, p in unwrap_model(chunks[0]).named_parameters():
        parts = name.split(".")
        if name.startswith("decoder.layers."):
            parts[2] = str(int(parts[2]) + offset)
        glob = _LOCAL.sub(lambda m: f".experts.{first + int(m.group(1))}.", ".".join(parts))
        out.append((name, glob, p))
    return out


def all_logical_names(model, cfg) -> list:
    """Every logical name of the whole model (each expert at every global index, every
    pipeline stage's layers: gathered from all ranks)."""
    names = set()
    for name, glob, _ in _params(model, cfg):
        if _is_expert(name):
            names.update(re.sub(r"\.experts\.\d+\.", f".experts.{e}.", glob)
                         for e in range(int(cfg.model.num_moe_experts)))
        else:
            names.add(glob)
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, sorted(names))
    out = sorted(set().union(*every))
    assert len(out) < 64, len(out)  # k * 1024 + 1023 + 255/256 exact in fp32
    return out


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


def golden_full(k: int, shape: tuple) -> torch.Tensor:
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
    t = gtp_shard(t, p)
    assert t.shape == p.shape, (name, t.shape, p.shape)
    return t


def _goldens_by_param(model, cfg) -> dict:
    """{id(param): (global name, param, weight, exp_avg, exp_avg_sq)} expected on this rank
    (fp32; bf16 weights hold the weight golden rounded)."""
    index = {n: k for k, n in enumerate(all_logical_names(model, cfg), start=1)}
    out = {}
    for name, glob, p in _params(model, cfg):
        full = golden_full(index[glob], _full_shape(name, p))
        out[id(p)] = (glob, p, *(_local(f, name, p) for f in (full, full + 0.5, full * 2)))
    return out


def goldens(model, cfg) -> dict:
    """{local name: (param, weight, exp_avg, exp_avg_sq)} expected on this rank (pp1;
    tests/test_moe_stock_format.py's form)."""
    gold = _goldens_by_param(model, cfg)
    return {name: gold[id(p)][1:] for name, _, p in _params(model, cfg)}


def set_golden(model, optimizer, cfg) -> None:
    _fill(model, optimizer, cfg, sentinel=False)


@torch.no_grad()
def fill_sentinel(model, optimizer) -> None:
    """Every weight, main param, moment and step the sentinel (no goldens needed)."""
    for p in model.parameters():
        p.fill_(SENTINEL)
    for opt, _, main, _ in _entries(optimizer):
        main.fill_(SENTINEL)
        for key in ("exp_avg", "exp_avg_sq"):
            opt.state[main][key].fill_(SENTINEL)
        opt.state[main]["step"] = torch.tensor(SENTINEL)


def _cut(t: torch.Tensor, sl) -> torch.Tensor:
    return t if sl is None else t.reshape(-1)[sl]


@torch.no_grad()
def _fill(model, optimizer, cfg, sentinel: bool) -> int:
    """Set every weight, main param, moment and step to its golden (or the sentinel); returns
    how many optimizer entries were set."""
    gold = _goldens_by_param(model, cfg)
    for _, p, want, _, _ in gold.values():
        p.copy_(torch.full_like(p, SENTINEL) if sentinel else want)
    n = 0
    for opt, p, main, sl in _entries(optimizer):
        _, _, want, m, v = gold[id(p)]
        st = opt.state[main]
        for dst, value in ((main, want), *_moments(st, m, v)):
            dst.copy_(torch.full_like(dst, SENTINEL) if sentinel else _cut(value, sl))
        if "momentum_buffer" not in st:  # Muon keeps no step
            st["step"] = torch.tensor(SENTINEL if sentinel else STEP)
        n += 1
    return n


def _moments(st: dict, m, v) -> list:
    """[(state tensor, its golden)] of one param's optimizer state: Adam's two moments, or
    Muon's momentum buffer (the golden of ``exp_avg``)."""
    if "momentum_buffer" in st:
        assert "exp_avg" not in st and "step" not in st, sorted(st)
        return [(st["momentum_buffer"], m)]
    return [(st["exp_avg"], m), (st["exp_avg_sq"], v)]


def _diff(what, got, want):
    if got.shape == want.shape and torch.equal(got, want):
        return None
    if got.shape != want.shape:
        return f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    return f"{what}: {int((got != want).sum())}/{got.numel()} elements differ"


@torch.no_grad()
def check_goldens(model, optimizer, cfg) -> tuple:
    """(expert tensors compared, all tensors compared, problems)."""
    gold = _goldens_by_param(model, cfg)
    problems, n, experts = [], 0, 0
    for glob, p, want, _, _ in gold.values():
        problems.append(_diff(f"{glob} weight", p.detach(), want.to(p.dtype)))
        n, experts = n + 1, experts + (".experts." in glob)
    steps = {}
    for opt, p, main, sl in _entries(optimizer):
        glob, _, want, m, v = gold[id(p)]
        st = opt.state[main]
        names = ("momentum_buffer",) if "momentum_buffer" in st else ("exp_avg", "exp_avg_sq")
        checks = [(what, got, value) for what, (got, value) in zip(names, _moments(st, m, v))]
        if main is not p:
            checks.append(("fp32 main param", main.detach(), want))
        for what, got, value in checks:
            problems.append(_diff(f"{glob} {what}", got, _cut(value, sl)))
        if "momentum_buffer" in st:
            if "step" in st:
                problems.append(f"{glob}: a Muon state with a step")
            continue
        if float(st["step"]) != STEP:
            problems.append(f"{glob} step {float(st['step'])}")
        steps.setdefault(id(opt), []).append(id(st["step"]))
        n, experts = n + len(checks), experts + len(checks) * (".experts." in glob)
    for ids in steps.values():  # a shared step tensor advances once per param per step
        if len(set(ids)) != len(ids):
            problems.append(f"{len(ids) - len(set(ids))} params share a step tensor")
    return experts, n, [x for x in problems if x]


def _biases(model, cfg) -> dict:
    """{global layer number (0-based): router ``expert_bias`` buffer} of this rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import unwrap_model

    from recipes.model.build import model_chunks

    pp = ps.get_pipeline_model_parallel_world_size()
    offset = ps.get_pipeline_model_parallel_rank() * (int(cfg.model.num_layers) // pp)
    out = {}
    for chunk in model_chunks(model):
        for name, buf in unwrap_model(chunk).named_buffers():
            if m := _BIAS.match(name):
                out[int(m.group(1)) + offset] = buf
    return out


def _bias_golden(layer: int, experts: int) -> torch.Tensor:
    return (16 * layer + torch.arange(experts, dtype=torch.float32) + 1) / 64


@torch.no_grad()
def _fill_biases(model, cfg, sentinel: bool) -> None:
    for layer, buf in _biases(model, cfg).items():
        buf.copy_(torch.full_like(buf, SENTINEL) if sentinel
                  else _bias_golden(layer, buf.numel()))


def _check_biases(model, cfg) -> tuple:
    """(expert_bias tensors compared, problems): each equals its golden, in fp32 (megatron's
    router keeps it fp32 under bf16 weights)."""
    problems = []
    biases = _biases(model, cfg)
    for layer, buf in biases.items():
        if buf.dtype != torch.float32:
            problems.append(f"layer {layer} expert_bias dtype {buf.dtype}")
        problems.append(_diff(f"layer {layer} expert_bias", buf.float(),
                              _bias_golden(layer, buf.numel())))
    return len(biases), [x for x in problems if x]


def _table_problems(model, cfg) -> list:
    """The built parameters of this rank against the family's table: every name (experts by
    global index) and full logical shape, and every table entry this rank's experts hold."""
    from megatron.core import parallel_state as ps

    from recipes.families import parameter_shapes
    from recipes.model.shapes import padded_vocab_size

    padded = padded_vocab_size(257, cfg.model.make_vocab_size_divisible_by,
                               ps.get_tensor_model_parallel_world_size())
    local = int(cfg.model.num_moe_experts) // ps.get_expert_model_parallel_world_size()
    first = ps.get_expert_model_parallel_rank() * local
    want = {}
    for entry in parameter_shapes(cfg.model, padded):
        m = re.search(r"\.local_experts\.(\d+)\.", entry.name)
        if m and not first <= int(m.group(1)) < first + local:
            continue  # another EP rank's expert
        want[entry.name.replace(".local_experts.", ".experts.")] = tuple(entry.shape)
    got = {glob: _full_shape(name, p) for name, glob, p in _params(model, cfg)}
    return [f"{n}: built {got.get(n)}, table {want.get(n)}"
            for n in sorted(got.keys() | want.keys()) if got.get(n) != want.get(n)]


def matrix_worker(root: str, cfgs: dict, pairs: list) -> dict:
    from pathlib import Path

    from ckpt import io as checkpoint

    out = {"loads": {}, "padded": {}, "kinds": {}, "shared_steps": {}, "biases": {},
           "table": {}}
    for name, cfg_yaml in cfgs.items():
        model, opt, sched, record, cfg = _build(cfg_yaml)
        out["padded"][name] = sum(getattr(p, "pad_length", 0) > 0
                                  for _, _, p in _params(model, cfg))
        out["kinds"][name] = sorted(type(o).__name__ for o in
                                    getattr(opt, "chained_optimizers", [opt]))
        if name in DS_LAYOUTS:
            out["table"][name] = _table_problems(model, cfg)
        _fill(model, opt, cfg, sentinel=False)
        _fill_biases(model, cfg, sentinel=False)
        # The run config, as recipes.run.worker saves it: its precision tells a bf16 save.
        checkpoint.save_checkpoint(Path(root) / name, 1, model, opt, sched,
                                   {"consumed_samples": 0,
                                    "config": OmegaConf.to_container(cfg, resolve=True)}, record)
    # Targets last-saved first: the last layout's build serves as its own target.
    for i, (name, cfg_yaml) in enumerate(reversed(cfgs.items())):
        sources = [src for src, dst in pairs if dst == name]
        if i > 0:
            model, opt, sched, record, cfg = _build(cfg_yaml)
        for src in sources:
            _fill(model, opt, cfg, sentinel=True)
            _fill_biases(model, cfg, sentinel=True)
            checkpoint.load_checkpoint(Path(root) / src, model, opt, sched, record)
            out["loads"][(src, name)] = check_goldens(model, opt, cfg)
            out["biases"][(src, name)] = _check_biases(model, cfg)
    reset_model_parallel()
    return out
