"""A megatron-core ``MambaMixer`` at one parallel layout, for tests inside a gloo world: the
project's shims, process groups, the mixer (``ColumnParallelLinear`` in_proj,
``RowParallelLinear`` out_proj), megatron's DDP and Adam, and goldens cut by hand.

Dims (hidden 32, ``d_inner`` 64, 4 heads of 16, 2 groups of state 8): ``in_proj`` packs
``z64 | x64 | B16 | C16 | dt4`` = 164 rows (82 per TP rank at tp2). At g2/a16 (tp1) the GTP
boundary falls inside ``x`` (shards of 96: ``z + x[:32]``, then ``x[32:] + B + C + dt`` and 28
padding rows); at g4/a32 (tp1, shards of 64) GTP rank 3 holds only padding, and ``out_proj``'s
32 rows pad to 128, leaving ranks 1-3 all padding.
"""

from __future__ import annotations

import torch

from multiproc import reset_model_parallel

HIDDEN, SEQ, BATCH = 32, 12, 2
CHUNK = 4
IN_PROJ = ("z", "x", "B", "C", "dt")


def setup(tp: int, g: int, pad, fmt: str = "logical") -> None:
    """The project's shims and megatron's process groups for ``tp`` x ``g`` (seed 1234)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import generalized_tensor_parallelism as gtp_impl

    from gtp import alignment, backend, grad_stats, logical_format, mamba_format
    from mcore_compat import cpu, distrib_optimizer, mamba_cpu

    cpu.install()
    distrib_optimizer.install()  # as recipes.worker
    mamba_cpu.install()
    mamba_format.install()
    logical_format.configure(fmt)
    reset_model_parallel()
    if g > 1:
        backend.install()
        grad_stats.install()
        gtp_impl.configure_gtp_remat_from_recipe(fp4=False, fp8=False, fp8_recipe=None)
        alignment.apply_pad_for_alignment(pad)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, gtp_remat_size=g)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)


def config(tp: int):
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, tensor_model_parallel_size=tp,
        normalization="RMSNorm", add_bias_linear=False, mamba_state_dim=8, mamba_head_dim=16,
        mamba_num_groups=2, init_method_std=0.02, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        activation_func=F.silu, bias_activation_fusion=False, bias_dropout_fusion=False,
        gradient_accumulation_fusion=False)


def build(tp: int, g: int, distributed_optimizer: bool = False):
    """(mixer, DDP-wrapped mixer, megatron Adam) at the layout set up by :func:`setup`."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.tensor_parallel import generalized_tensor_parallelism as gtp_impl
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    spec = ModuleSpec(module=MambaMixer, params={"chunk_size": CHUNK},
                      submodules=MambaMixerSubmodules(in_proj=ColumnParallelLinear,
                                                      out_proj=RowParallelLinear))
    cfg = config(tp)
    mixer = build_module(spec, config=cfg, d_model=HIDDEN, layer_number=1,
                         pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer), mixer)
    if g > 1:
        gtp_impl.classify_gtp_remat_chains(ddp)
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=1e-3, use_distributed_optimizer=distributed_optimizer,
        params_dtype=torch.float32), [ddp])
    return mixer, ddp, opt


def hidden_states() -> torch.Tensor:
    """``[SEQ, BATCH, HIDDEN]`` fp32, the same on every rank."""
    return torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(11))


def loss_and_grads(ddp, mixer):
    """Forward and backward of ``mean(out ** 2)``: the loss and ``{name: gradient}``."""
    out = ddp(hidden_states())
    out = out[0] if isinstance(out, tuple) else out
    loss = (out.float() ** 2).mean()
    loss.backward()
    return loss.detach(), {n: (p.main_grad if getattr(p, "main_grad", None) is not None
                               else p.grad).detach().clone() for n, p in mixer.named_parameters()}


def local(full: torch.Tensor, p) -> torch.Tensor:
    """This rank's piece of a tp1 tensor, by hand: the TP chunk (of each packed component in
    turn), then megatron's GTP tail padding with zeros and the rank's shard rows."""
    from megatron.core import parallel_state as ps

    tp, k = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    t = full
    if getattr(p, "tensor_model_parallel", False):
        dim = p.partition_dim
        sizes = getattr(p, "partition_sizes", None)
        if sizes is None:
            t = t.chunk(tp, dim=dim)[k]
        else:
            parts = torch.split(t, [n * tp for n in sizes], dim=dim)
            t = torch.cat([part.narrow(dim, k * n, n) for part, n in zip(parts, sizes)], dim=dim)
    if getattr(p, "is_gtp_weight_remat", False):
        g, r, s = p.group.size(), p.group.rank(), p.shape[0]
        padded = torch.zeros((s * g, *t.shape[1:]), dtype=t.dtype)
        padded[:t.shape[0]] = t
        t = padded[r * s:(r + 1) * s]
    assert t.shape == p.shape, (t.shape, p.shape)
    return t


def full_shape(p) -> tuple:
    from megatron.core import parallel_state as ps

    shape = list(p.shape)
    if getattr(p, "is_gtp_weight_remat", False):
        shape[0] = p._unsharded_shape[0]
    if getattr(p, "tensor_model_parallel", False):
        shape[p.partition_dim] *= ps.get_tensor_model_parallel_world_size()
    return tuple(shape)


def golden_full(k: int, shape: tuple) -> torch.Tensor:
    """``k * 1024 + row + (index within the row) / 256``: exact in fp32."""
    rows, rest = shape[0], int(torch.Size(shape[1:]).numel())
    assert rows < 1024 and rest <= 256, shape
    within = torch.arange(rest, dtype=torch.float32).reshape(shape[1:]) / 256
    return k * 1024 + torch.arange(rows, dtype=torch.float32).reshape(
        (rows,) + (1,) * (len(shape) - 1)) + within
