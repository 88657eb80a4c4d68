"""The MoE family's megatron side: MoE config fields, megatron's decoder block spec (MoE or
dense MLP per layer) and expert weights that are the same at every expert layout.

Experts are megatron's local ``SequentialMLP`` (``local_experts.<i>``, one ``MLP`` each) from
``get_gpt_decoder_block_spec``; the model is the GPT family's ``GPTModel``.
"""

from __future__ import annotations

import contextlib
import zlib

from mcore_compat.patches import megatron_patch
from recipes.families.gpt import model as gpt_model
from recipes.families.moe.params import layer_freq


def is_moe(m) -> bool:
    """Whether the ``model`` config has routed experts (``num_moe_experts`` set)."""
    return m.get("num_moe_experts") is not None


def transformer_config_fields(m, dims) -> dict:
    """megatron ``TransformerConfig`` keyword arguments of an MoE ``model`` config: the GPT
    family's fields, the MoE fields (routing: score function, expert bias, groups, scaling;
    ``moe_layer_freq`` an int or a list of ints) and the expert parallel sizes of ``dims`` (a
    ``recipes.config.parallel_dims.ParallelDims``)."""
    out = gpt_model.transformer_config_fields(m, dims)
    out.update(
        num_moe_experts=int(m.num_moe_experts),
        moe_router_topk=int(m.moe_router_topk),
        moe_router_pre_softmax=bool(m.get("moe_router_pre_softmax", False)),
        moe_router_score_function=str(m.get("moe_router_score_function", "softmax")),
        moe_router_topk_scaling_factor=_float_or_none(m.get("moe_router_topk_scaling_factor")),
        moe_router_enable_expert_bias=bool(m.get("moe_router_enable_expert_bias", False)),
        moe_router_bias_update_rate=float(m.get("moe_router_bias_update_rate", 1e-3)),
        moe_router_num_groups=_int_or_none(m.get("moe_router_num_groups")),
        moe_router_group_topk=_int_or_none(m.get("moe_router_group_topk")),
        moe_ffn_hidden_size=int(m.get("moe_ffn_hidden_size") or m.ffn_hidden_size),
        moe_shared_expert_intermediate_size=m.get("moe_shared_expert_intermediate_size"),
        moe_shared_expert_gate=bool(m.get("moe_shared_expert_gate", False)),
        moe_router_load_balancing_type=m.moe_router_load_balancing_type,
        moe_aux_loss_coeff=float(m.moe_aux_loss_coeff),
        moe_token_dispatcher_type=m.moe_token_dispatcher_type,
        moe_layer_freq=layer_freq(m),
        moe_grouped_gemm=False,  # SequentialMLP: the local spec's experts (no TE grouped GEMM)
        expert_model_parallel_size=dims.expert_model_parallel_size,
        expert_tensor_parallel_size=dims.expert_tensor_parallel_size,
    )
    if dims.expert_gtp_remat_size > 1:
        out["expert_gtp_weight_remat_size"] = dims.expert_gtp_remat_size
    return out


def _int_or_none(value):
    return None if value is None else int(value)


def _float_or_none(value):
    return None if value is None else float(value)


def layer_spec(m, config, use_te: bool, vp_stage):
    """megatron's decoder block spec for an MoE model (``get_gpt_decoder_block_spec``: MoE or
    dense MLP per layer from ``moe_layer_freq``, q/k norms from ``qk_layernorm``)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(config, use_transformer_engine=use_te,
                                      normalization=m.get("normalization", "LayerNorm"),
                                      vp_stage=vp_stage)


@contextlib.contextmanager
@megatron_patch("transformer.moe.experts.SequentialMLP.__init__ (while experts are built)")
def experts_leave_rng_alone():
    """While active, building a ``SequentialMLP`` draws nothing from torch's CPU generator as
    seen by the rest of the model: its state is put back after the experts are built.

    With CPU initialization each expert draws its full weight from that generator, so how many
    experts a rank builds (num_moe_experts / expert_model_parallel_size) would shift every
    later draw. :func:`init_experts` gives the experts their weights instead."""
    from megatron.core.transformer.moe.experts import SequentialMLP
    import torch

    original = SequentialMLP.__init__

    def __init__(self, *args, **kwargs):
        state = torch.get_rng_state()
        try:
            original(self, *args, **kwargs)
        finally:
            torch.set_rng_state(state)

    SequentialMLP.__init__ = __init__
    try:
        yield
    finally:
        SequentialMLP.__init__ = original


def _expert_seed(seed: int, layer: int, expert: int, name: str) -> int:
    return zlib.crc32(f"{seed}/{layer}/{expert}/{name}".encode())


def init_experts(chunk, config, seed: int) -> int:
    """Give every routed expert weight of ``chunk`` its logical value, the same at any layout.

    Expert ``g`` (global index: ``ep_rank * local experts + i``) of layer ``l`` (megatron's
    1-based ``layer_number``; MTP layer ``i``: ``num_layers + 1 + i``) draws its full weight
    with megatron's init method (``init_method`` for fc1, ``output_layer_init_method`` for
    fc2, as ``MLP`` uses them) from a generator seeded by ``(seed, l, g, name)``; this rank keeps
    its expert-TP part (``partition_dim``, stride 2 for a gated fc1: ``[gate | up]`` per rank, as
    megatron's ``_initialize_affine_weight_cpu``) and, under expert GTP, its rows of the
    zero-padded part.

    Returns:
        The number of weights set.
    """
    import torch  # torch on use: the family's fields load without it

    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.generalized_tensor_parallelism import is_gtp_param
    from megatron.core.transformer.moe.experts import SequentialMLP

    etp, etp_rank = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    ep_rank = ps.get_expert_model_parallel_rank()
    n = 0
    for layer, transformer_layer in _layers_with_numbers(chunk, config):
        # (a hybrid stack's Mamba layers have no mlp)
        module = getattr(getattr(transformer_layer, "mlp", None), "experts", None)
        if not isinstance(module, SequentialMLP):
            continue
        for i, expert in enumerate(module.local_experts):
            g = ep_rank * module.num_local_experts + i
            for lin_name, init in (("linear_fc1", config.init_method),
                                   ("linear_fc2", config.output_layer_init_method)):
                param = getattr(expert, lin_name).weight
                dim = param.partition_dim
                stride = 2 if lin_name == "linear_fc1" and config.gated_linear_unit else 1
                local = list(param._unsharded_shape if is_gtp_param(param) else param.shape)
                full = list(local)
                full[dim] *= etp
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(_expert_seed(seed, layer, g, lin_name))
                    master = torch.empty(full, dtype=torch.float32)
                    init(master)
                pieces = torch.split(master, local[dim] // stride, dim=dim)
                part = torch.cat(pieces[etp_rank::etp], dim=dim).to(param.dtype)
                if is_gtp_param(param):
                    part = torch.nn.functional.pad(part, (0, 0, 0, param.pad_length))
                    rows = param.shape[0]
                    r = param.group.rank()
                    part = part[r * rows:(r + 1) * rows]
                with torch.no_grad():
                    param.data.copy_(part)
                n += 1
    return n


def _layers_with_numbers(chunk, config):
    """``(1-based global layer number, TransformerLayer)`` of the chunk's decoder layers, then of
    its multi-token prediction layers (numbered after the decoder's, as megatron's router
    numbers them in its metrics)."""
    for transformer_layer in chunk.decoder.layers:
        yield transformer_layer.layer_number, transformer_layer
    if getattr(chunk, "mtp_process", False):
        for i, mtp_layer in enumerate(chunk.mtp.layers):
            yield config.num_layers + 1 + i, mtp_layer.mtp_model_layer
