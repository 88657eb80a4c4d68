"""A megatron-core ``GatedDeltaNet`` builder for ``tests/helpers/module_layouts.py``: the module
as the hybrid family builds it (``ColumnParallelLinear`` in_proj, the family's ``TPSummedNorm``
out_norm, ``RowParallelLinear`` out_proj) on the torch kernels (``mcore_compat.gdn_cpu``) with the logical format of its packed
``in_proj`` (``ckpt.format.gdn_format``).

Dims (hidden 32; 2 key heads of 12, 4 value heads of 8, conv kernel 4): ``in_proj`` packs
``query 24 | key 24 | value 32 | z 32 | beta 4 | alpha 4`` = 120 rows (60 per TP rank at tp2);
``conv1d`` ``query | key | value`` = 80 channels. Weights drawn with std 0.3 (megatron's 0.02
gives a loss of 2e-6, where an absolute bound of 1e-6 would say nothing). At g2/a16 the GTP boundary falls inside
``value`` (shards of 64); at tp2 x g2/a16 inside each TP rank's ``value`` (shards of 32, 4
padding rows); at g4/a32 inside ``key``, ``value`` and ``z``. The input is 70 steps long: two of
the kernel's 64-step chunks.
"""

from __future__ import annotations

import torch

HIDDEN, SEQ, BATCH = 32, 70, 2
KEY_HEADS, KEY_DIM, VALUE_HEADS, VALUE_DIM = 2, 12, 4, 8


def install() -> None:
    from ckpt.format import gdn_format
    from mcore_compat import gdn_cpu

    gdn_cpu.install()
    gdn_format.install()


def config(tp: int):
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, tensor_model_parallel_size=tp,
        normalization="RMSNorm", add_bias_linear=False, linear_conv_kernel_dim=4,
        linear_key_head_dim=KEY_DIM, linear_num_key_heads=KEY_HEADS,
        linear_value_head_dim=VALUE_DIM, linear_num_value_heads=VALUE_HEADS,
        init_method_std=0.3, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        activation_func=F.silu, bias_activation_fusion=False, bias_dropout_fusion=False,
        gradient_accumulation_fusion=False)


def build(tp: int):
    """The module at the current process groups; its packed weights carry the TP-local rows of
    their components as ``partition_sizes`` (from the dims here, for the goldens' TP cut)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    from recipes.families.hybrid.gdn_norm import TPSummedNorm

    spec = ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=TPSummedNorm, out_proj=RowParallelLinear))
    net = build_module(spec, config=config(tp), layer_number=1,
                       pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    qk, v, heads = KEY_HEADS * KEY_DIM // tp, VALUE_HEADS * VALUE_DIM // tp, VALUE_HEADS // tp
    net.in_proj.weight.partition_sizes = [qk, qk, v, v, heads, heads]
    net.conv1d.weight.partition_sizes = [qk, qk, v]
    return net


def loss(model) -> torch.Tensor:
    """``mean(out ** 2)`` of a fixed ``[SEQ, BATCH, HIDDEN]`` input."""
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(11))
    out = model(x, None)
    out = out[0] if isinstance(out, tuple) else out
    return (out.float() ** 2).mean()
