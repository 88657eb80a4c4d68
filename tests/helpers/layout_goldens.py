"""Goldens for checkpoint layout tests, built independently of the code under test.

Each parameter's *full logical* tensor holds ``k*1024 + row + col/256`` (``k``: the parameter's
index in sorted global-name order; exact in fp32), ``exp_avg = golden + 0.5``,
``exp_avg_sq = golden * 2``, ``step = 7``. A rank's expected local tensor is cut from the full
one by plain slicing: the TP chunk (gated fc1: gate rows then up rows of the TP rank; a routed
expert's: its expert-TP chunk), then megatron's GTP tail padding with zeros and the rank's shard
rows; a distributed optimizer's flat range of it. A routed expert is named by its global index
(``experts.<ep_rank * local experts + i>``), and a router's ``expert_bias`` buffer (no optimizer
state) holds ``(16 * layer + expert + 1) / 64``, exact in bf16. :func:`fill` writes them (or a
sentinel), :func:`check` compares exactly.
Used by tests/helpers/checkpoint_matrix.py, tests/test_roundtrip_property.py and
tests/test_checkpoint_compat.py (whose committed checkpoints were written with them).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from multiproc import reset_model_parallel
from optimizer_entries import main_param_entries
from recipes.config.schema import register_configs

REPO = Path(__file__).resolve().parents[2]
CONF = str(REPO / "conf")
register_configs()

SENTINEL = -999.0
STEP = 7.0
_LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")
_LAYER = re.compile(r"layers\.(\d+)\.")


def make_cfg(model: str, tp: int, g: int, pad, nproc: int, checkpoint_layout: str = "logical",
             *extra: str) -> str:
    """The composed, resolved run config (YAML) of one layout."""
    overrides = [
        "output_dir=/tmp/unused", "checkpoint.save=null", "data.cache_dir=/tmp/unused",
        f"model={model}", f"parallelism.tensor_model_parallel_size={tp}",
        f"parallelism.nproc_per_node={nproc}", f"gtp.gtp_remat_size={g}",
        f"gtp.pad_for_alignment={'null' if pad is None else pad}",
        f"gtp.checkpoint_layout={checkpoint_layout}", *extra,
    ]
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    return OmegaConf.to_yaml(OmegaConf.create(OmegaConf.to_container(cfg, resolve=True)))


# --------------------------------------------------------------------------------------------
# Helpers that run inside the worker processes (independent of ckpt/format/logical_format.py).
# --------------------------------------------------------------------------------------------
def build(cfg_yaml: str):
    """(model, optimizer, scheduler, layout record) at the config's layout, fresh groups."""
    from ckpt import io as checkpoint
    from recipes.run import worker
    from recipes.config.validate import validate

    reset_model_parallel()
    cfg = OmegaConf.create(cfg_yaml)
    parallel_dims = validate(cfg, torch.distributed.get_world_size())
    _, model, optimizer, scheduler = worker.setup(cfg, parallel_dims)
    return model, optimizer, scheduler, checkpoint.layout_record(parallel_dims), cfg


def is_gtp(p) -> bool:
    return bool(getattr(p, "is_gtp_weight_remat", False))


def gated(name: str, cfg) -> bool:
    """Whether ``name`` is a gated (SwiGLU) fc1: the run's ``model.swiglu`` applies to the
    language model's MLPs (an MoE layer's experts and shared expert included), not to a LLaVA
    model's ViT (``vision_model.``, CLIP's GeLU MLP)."""
    return (cfg is not None and bool(cfg.model.swiglu) and ".mlp." in name
            and ".linear_fc1." in name and not name.startswith("vision_model."))


def is_expert(name: str) -> bool:
    """Whether ``name`` is a routed expert's (local or global name)."""
    return ".local_experts." in name or ".experts.experts." in name


def tp_split(p, name: str) -> tuple[int, int]:
    """(size, rank) of the group that splits ``p`` along ``partition_dim``: expert tensor
    parallelism for a routed expert, tensor parallelism otherwise; (1, 0) for a whole param."""
    from megatron.core import parallel_state as ps

    if not getattr(p, "tensor_model_parallel", False):
        return 1, 0
    if is_expert(name):
        return ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


def full_shape(p, name: str = "") -> tuple:
    shape = list(p.shape)
    if is_gtp(p):
        shape[0] = p._unsharded_shape[0]
    if getattr(p, "tensor_model_parallel", False):
        shape[p.partition_dim] *= tp_split(p, name)[0]
    return tuple(shape)


def golden_full(k: int, shape: tuple) -> torch.Tensor:
    """``k * 1024 + row + (index within the row) / 256``: exact in fp32 (2-D: ``col / 256``;
    1-D: ``k * 1024 + row``)."""
    rows, rest = shape[0], int(torch.Size(shape[1:]).numel())
    assert rows < 1024 and rest <= 256, shape
    within = torch.arange(rest, dtype=torch.float32).reshape(shape[1:]) / 256
    return k * 1024 + torch.arange(rows, dtype=torch.float32).reshape(
        (rows,) + (1,) * (len(shape) - 1)) + within


def local(full: torch.Tensor, p, name: str, cfg) -> torch.Tensor:
    """This rank's piece of a full logical tensor: the TP slice (gated fc1: gate rows then up
    rows of the TP rank; a weight packing components, megatron's ``partition_sizes``: each
    component's TP chunk in turn), then GTP pad + shard. ``cfg``: the run config, or None for
    a module without gated MLPs."""
    tp, k = tp_split(p, name)
    t = full
    sizes = getattr(p, "partition_sizes", None) or gdn_partition_sizes(name, cfg, tp)
    if gated(name, cfg):
        n = t.shape[0] // 2
        h = n // tp
        t = torch.cat([t[k * h:(k + 1) * h], t[n + k * h:n + (k + 1) * h]])
    elif tp > 1 and sizes is not None:
        dim = p.partition_dim
        parts = torch.split(t, [n * tp for n in sizes], dim=dim)
        t = torch.cat([part.narrow(dim, k * n, n) for part, n in zip(parts, sizes)], dim=dim)
    elif tp > 1:
        t = t.chunk(tp, dim=p.partition_dim)[k]
    t = gtp_shard(t, p)
    assert t.shape == p.shape, (name, t.shape, p.shape)
    return t


def gdn_partition_sizes(name: str, cfg, tp: int):
    """The TP-local rows of each component a GatedDeltaNet weight packs, from the run config
    (megatron sets no ``partition_sizes`` on them): ``in_proj`` ``query | key | value | z |
    beta | alpha``, ``conv1d`` ``query | key | value``; None for any other weight."""
    if cfg is None or not name.endswith(("self_attention.in_proj.weight",
                                         "self_attention.conv1d.weight")):
        return None
    m = cfg.model
    qk = m.linear_num_key_heads * m.linear_key_head_dim // tp
    v = m.linear_num_value_heads * m.linear_value_head_dim // tp
    if name.endswith("conv1d.weight"):
        return [qk, qk, v]
    heads = m.linear_num_value_heads // tp
    return [qk, qk, v, v, heads, heads]


def gtp_shard(t: torch.Tensor, p) -> torch.Tensor:
    """This rank's GTP shard of ``t`` (rows after TP) for param ``p``: megatron's tail padding
    with zeros to ``shard rows x group size``, then the rank's rows; ``t`` itself without GTP."""
    if not is_gtp(p):
        return t
    g, r, s = p.group.size(), p.group.rank(), p.shape[0]
    padded = torch.zeros((s * g, *t.shape[1:]), dtype=t.dtype)
    padded[:t.shape[0]] = t
    return padded[r * s:(r + 1) * s]


def diff(what: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    if got.shape == want.shape and torch.equal(got, want):
        return None
    if got.shape != want.shape:
        return f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    bad = got != want
    return (f"{what}: {int(bad.sum())}/{got.numel()} elements differ, max |diff| "
            f"{(got - want).abs().max().item():g}")



# --------------------------------------------------------------------------------------------
# Pipeline parallelism and the distributed optimizer (bf16 weights, fp32 main params).
#
# Under PP a rank holds some layers under local names (decoder.layers.0 of stage 1 is layer 1);
# the golden index k comes from the *global* name (megatron's layer offset), so a layer loaded
# onto the wrong stage fails. The tied output weight on the last stage is a copy of the
# embedding (same golden; tied models only). Weights are bf16 (golden rounded); the fp32 main params, exp_avg,
# exp_avg_sq hold the exact golden. With the distributed optimizer a rank holds a flat slice of
# each param's main param and moments: the golden is cut the same way (flatten, then slice).
# --------------------------------------------------------------------------------------------
def global_names(model, buffers: bool = False) -> dict:
    """{id(param): (global name, param)} for this rank's chunks (``buffers``: of their routers'
    ``expert_bias`` buffers instead). The layer offset is computed here, not taken from
    megatron: chunk v of stage p holds layers from (v * pp + p) * num_layers / (pp * vpp); a
    routed expert ``local_experts.<i>`` is ``experts.<ep_rank * local experts + i>``."""
    from megatron.core import parallel_state as ps

    from recipes.model.build import model_chunks

    out = {}
    chunks = model_chunks(model)
    pp, p_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    for v, chunk in enumerate(chunks):
        gpt = chunk.module
        gpt = getattr(gpt, "module", gpt)  # Float16Module
        offset = (v * pp + p_rank) * (gpt.config.num_layers // (pp * len(chunks)))
        first = ps.get_expert_model_parallel_rank() * (
            (gpt.config.num_moe_experts or 0) // ps.get_expert_model_parallel_world_size())
        named = gpt.named_buffers() if buffers else gpt.named_parameters()
        for name, p in named:
            if buffers and not name.endswith(".router.expert_bias"):
                continue
            if name.startswith("decoder.layers."):
                parts = name.split(".")
                parts[2] = str(int(parts[2]) + offset)
                name = ".".join(parts)
            elif name == "output_layer.weight" and gpt.share_embeddings_and_output_weights:
                name = "embedding.word_embeddings.weight"
            name = _LOCAL_EXPERT.sub(lambda m: f".experts.{first + int(m.group(1))}.", name)
            out[id(p)] = (name, p)
    return out


def bias_golden(name: str, experts: int) -> torch.Tensor:
    """The golden of the router ``expert_bias`` of global ``name``: ``(16 layer + e + 1) / 64``."""
    layer = int(_LAYER.search(name).group(1))
    return (16 * layer + torch.arange(experts, dtype=torch.float32) + 1) / 64


def layout_goldens(model, cfg) -> dict:
    """{id(param): (param, global name, (weight, exp_avg, exp_avg_sq) goldens local to this
    rank)} (exact fp32; padding rows zero)."""
    names = global_names(model)
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, sorted({n for n, _ in names.values()}))
    index = {n: k for k, n in enumerate(sorted(set().union(*every)), start=1)}
    assert len(index) < 64, len(index)  # k * 1024 + 1023 + 255/256 exact in fp32
    out = {}
    for pid, (name, p) in names.items():
        full = golden_full(index[name], full_shape(p, name))
        out[pid] = (p, name, tuple(local(t, p, name, cfg) for t in (full, full + 0.5, full * 2)))
    return out


def cut(t: torch.Tensor, sl) -> torch.Tensor:
    return t if sl is None else t.reshape(-1)[sl]


@torch.no_grad()
def fill(model, optimizer, cfg, sentinel: bool) -> int:
    gold = layout_goldens(model, cfg)
    for p, _, (want, _, _) in gold.values():
        p.copy_(torch.full_like(p, SENTINEL) if sentinel else want)
    for name, buf in global_names(model, buffers=True).values():
        buf.copy_(torch.full_like(buf, SENTINEL) if sentinel else bias_golden(name, buf.numel()))
    n = 0
    for opt, p, main, sl in main_param_entries(optimizer):
        want, m, v = gold[id(p)][2]
        st = opt.state[main]
        for key, value in (("main", want), ("exp_avg", m), ("exp_avg_sq", v)):
            dst = main if key == "main" else st[key]
            dst.copy_(torch.full_like(dst, SENTINEL) if sentinel else cut(value, sl))
        st["step"] = torch.tensor(SENTINEL if sentinel else STEP)
        n += 1
    return n


@torch.no_grad()
def check(model, optimizer, cfg) -> tuple[int, list[str]]:
    gold = layout_goldens(model, cfg)
    problems, n = [], 0
    for p, name, (want, _, _) in gold.values():
        problems.append(diff(f"{name} weight", p.detach(), want.to(p.dtype)))
        n += 1
    for name, buf in global_names(model, buffers=True).values():  # fp32 under bf16 weights
        problems.append(diff(name, buf, bias_golden(name, buf.numel())))
        n += 1
    for opt, p, main, sl in main_param_entries(optimizer):
        _, name, (want, m, v) = gold[id(p)]
        st = opt.state[main]
        problems.append(diff(f"{name} fp32 main param", main.detach(), cut(want, sl)))
        problems.append(diff(f"{name} exp_avg", st["exp_avg"], cut(m, sl)))
        problems.append(diff(f"{name} exp_avg_sq", st["exp_avg_sq"], cut(v, sl)))
        if float(st["step"]) != STEP:
            problems.append(f"{name} step {float(st['step'])}")
        n += 4
    return n, [x for x in problems if x]


def save_and_load_pairs(root: str, cfgs: dict, inspect=None) -> dict:
    """In a worker of a gloo world: build each layout of ``cfgs`` (name -> :func:`make_cfg`
    YAML), fill it with the goldens and save it under ``root/name`` through
    ``ckpt.io``; then load every save into every layout pre-filled with a sentinel.
    ``inspect``: ``(model, cfg) -> value`` called on each layout's built model first.

    Returns:
        ``{"filled": {name: tensors filled}, "loads": {(source, target): check()},
        "inspected": {name: inspect's value}}``.
    """
    from ckpt import io as checkpoint

    out = {"filled": {}, "loads": {}, "inspected": {}}
    for name, cfg_yaml in cfgs.items():
        built = build(cfg_yaml)
        model, opt, sched, record, cfg = built
        if inspect is not None:
            out["inspected"][name] = inspect(model, cfg)
        out["filled"][name] = fill(model, opt, cfg, sentinel=False)
        checkpoint.save_checkpoint(Path(root) / name, 1, model, opt, sched,
                                   {"consumed_samples": 0}, record)
    # Targets last-saved first: the last layout's build serves as its own target (every load
    # starts from a sentinel fill of every tensor check() reads).
    for i, (name, cfg_yaml) in enumerate(reversed(cfgs.items())):
        model, opt, sched, record, cfg = built if i == 0 else build(cfg_yaml)
        for source in cfgs:
            fill(model, opt, cfg, sentinel=True)
            checkpoint.load_checkpoint(Path(root) / source, model, opt, sched, record)
            out["loads"][(source, name)] = check(model, opt, cfg)
    return out


def pair_problems(results: list) -> list[str]:
    """Every difference :func:`save_and_load_pairs` found on any rank (asserting each layout
    filled and each load checked some tensors)."""
    problems = []
    for rank, res in enumerate(results):
        assert all(n > 0 for n in res["filled"].values()), res["filled"]
        for (source, target), (n, found) in res["loads"].items():
            assert n > 0, (source, target)
            problems += [f"rank {rank} {source} -> {target}: {p}" for p in found]
    return problems
