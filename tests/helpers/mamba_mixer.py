"""A megatron-core ``MambaMixer`` builder for ``tests/helpers/module_layouts.py``: the mixer
(``ColumnParallelLinear`` in_proj, ``RowParallelLinear`` out_proj) on the torch kernels
(``mcore_compat.mamba_cpu``) with the logical format of its packed ``in_proj``
(``ckpt.format.mamba_format``).

Dims (hidden 32, ``d_inner`` 64, 4 heads of 16, 2 groups of state 8): ``in_proj`` packs
``z64 | x64 | B16 | C16 | dt4`` = 164 rows (82 per TP rank at tp2). At g2/a16 (tp1) the GTP
boundary falls inside ``x`` (shards of 96: ``z + x[:32]``, then ``x[32:] + B + C + dt`` and 28
padding rows); at g4/a32 (tp1, shards of 64) GTP rank 3 holds only padding, and ``out_proj``'s
32 rows pad to 128, leaving ranks 1-3 all padding.
"""

from __future__ import annotations

import torch

HIDDEN, SEQ, BATCH = 32, 12, 2
CHUNK = 4
IN_PROJ = ("z", "x", "B", "C", "dt")


def install() -> None:
    from ckpt.format import mamba_format
    from mcore_compat import mamba_cpu

    mamba_cpu.install()
    mamba_format.install()


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


def build(tp: int):
    """The mixer at the current process groups."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    spec = ModuleSpec(module=MambaMixer, params={"chunk_size": CHUNK},
                      submodules=MambaMixerSubmodules(in_proj=ColumnParallelLinear,
                                                      out_proj=RowParallelLinear))
    return build_module(spec, config=config(tp), d_model=HIDDEN, layer_number=1,
                        pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def loss(model) -> torch.Tensor:
    """``mean(out ** 2)`` of a fixed ``[SEQ, BATCH, HIDDEN]`` input."""
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(11))
    out = model(x)
    out = out[0] if isinstance(out, tuple) else out
    return (out.float() ** 2).mean()
