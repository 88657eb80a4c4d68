"""The hybrid family's megatron side: config fields, the local hybrid stack spec and
``HybridModel`` (Mamba, GatedDeltaNet, attention, MLP and MoE layers mixed, as NVIDIA's
Nemotron-H and Qwen3-Next). Its MoE layers are the MoE family's (its fields, config fields,
experts and their initialization)."""

from __future__ import annotations

import contextlib

from recipes.families.gpt import model as gpt_model
from recipes.families.moe import model as moe_model

# megatron's layer symbols (megatron.core.models.hybrid.hybrid_layer_allocation.Symbols); MTP
# the separator of the multi-token prediction part ("<main>/<mtp>/<mtp>...", one per depth).
MAMBA, GDN, ATTENTION, MLP, MOE, PIPE, MTP = "M", "G", "*", "-", "E", "|", "/"
SUPPORTED = {MAMBA: "Mamba", GDN: "GatedDeltaNet", ATTENTION: "attention", MLP: "MLP",
             MOE: "MoE"}
# megatron's TransformerConfig fields of GatedDeltaNet layers (the family's schema has them).
GDN_FIELDS = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
              "linear_num_key_heads", "linear_num_value_heads")
# Other symbols megatron knows, refused here with the reason.
UNSUPPORTED = {
    "S": "DeepSeek sparse attention is not in this family",
    "D": "DeepSeek sparse attention is not in this family",
}


def is_hybrid(m) -> bool:
    """Whether a ``model`` config is a hybrid one: its ``hybrid_layer_pattern`` is not null (an
    empty one is the hybrid family's to refuse, not a transformer)."""
    return m.get("hybrid_layer_pattern") is not None


def layer_symbols(pattern: str) -> str:
    """The main decoder's layer symbols: the pattern before its first ``/`` (the MTP part),
    pipeline separators ``|`` left out (megatron's ``get_hybrid_total_layer_count``)."""
    return pattern.split(MTP)[0].replace(PIPE, "")


def mtp_parts(pattern: str) -> list[str]:
    """The pattern's MTP parts, one per depth (megatron's ``parse_hybrid_pattern``: each part
    after a ``/``; all must be alike); [] without ``/``."""
    return pattern.split(MTP)[1:]


def mtp_symbols(pattern: str) -> str:
    """The layer symbols of one MTP depth (the first MTP part; '' without MTP)."""
    parts = mtp_parts(pattern)
    return parts[0] if parts else ""


def transformer_config_fields(m, dims) -> dict:
    """The GPT fields (attention and MLP layers are GPT's), with ``E`` layers the MoE family's
    (its fields and the expert parallel sizes of ``dims``), plus megatron's Mamba fields
    ``mamba_state_dim``, ``mamba_head_dim``, ``mamba_num_groups`` and ``mamba_num_heads`` and
    its GatedDeltaNet fields (:data:`GDN_FIELDS`) and ``layernorm_zero_centered_gamma``."""
    has_moe = MOE in str(m.hybrid_layer_pattern)
    out = (moe_model if has_moe else gpt_model).transformer_config_fields(m, dims)
    out.update(mamba_state_dim=int(m.mamba_state_dim), mamba_head_dim=int(m.mamba_head_dim),
               mamba_num_groups=int(m.mamba_num_groups))
    out.update({name: int(m[name]) for name in GDN_FIELDS})
    out["layernorm_zero_centered_gamma"] = bool(m.get("layernorm_zero_centered_gamma", False))
    if m.get("mamba_num_heads"):
        out["mamba_num_heads"] = int(m.mamba_num_heads)
    return out


def layer_spec(m, config, use_te: bool, vp_stage=None):
    """The local hybrid stack spec (:func:`local_stack_spec`) whether TransformerEngine is
    there or not: megatron's TransformerEngine spec fuses the norms into ``in_proj`` and
    ``linear_qkv``, weights other than the family's parameter table (``model.transformer_impl=
    transformer_engine`` is refused)."""
    return local_stack_spec(m)


def local_stack_spec(m):
    """A ``HybridStack`` spec without TransformerEngine (megatron-core 0.19.2 has only the TE
    one): a Mamba layer is a norm (``WrappedTorchNorm``, the config's normalization) then
    ``MambaMixer`` with a ``ColumnParallelLinear`` ``in_proj`` and a ``RowParallelLinear``
    ``out_proj``; a GatedDeltaNet layer is megatron's (a ``TransformerLayer`` whose
    ``self_attention`` is ``GatedDeltaNet``) with its input norm apart, as the attention layer's,
    the same linears and as ``out_norm`` :class:`~recipes.families.hybrid.gdn_norm.TPSummedNorm`
    (megatron's TE spec fuses the input norm into ``in_proj``); an attention layer and an MLP layer are the local GPT layer's
    attention and MLP halves (``get_gpt_layer_local_spec``), each with its own input norm; an
    MoE layer is megatron's ``MoETransformerLayer`` (as its TE spec) holding the MLP half of the
    local GPT MoE layer (``get_gpt_layer_local_spec`` with ``num_moe_experts``: ``TopKRouter``,
    ``SequentialMLP`` experts, the shared expert), present with ``E`` in the pattern only.
    With an MTP part (``/``), the MTP block of :func:`local_mtp_block_spec`: megatron builds each
    depth's layers as a nested ``HybridStack`` of this spec's layers."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer,
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    from recipes.families.hybrid.gdn_norm import TPSummedNorm

    gpt = get_gpt_layer_local_spec(normalization=m.get("normalization", "LayerNorm"),
                                   qk_layernorm=bool(m.get("qk_layernorm", False))).submodules
    mamba = ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
        norm=WrappedTorchNorm,
        mixer=ModuleSpec(module=MambaMixer, params={"chunk_size": int(m.mamba_chunk_size)},
                         submodules=MambaMixerSubmodules(in_proj=ColumnParallelLinear,
                                                         out_proj=RowParallelLinear)),
        mamba_bda=get_bias_dropout_add))
    attention = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=gpt.input_layernorm, self_attention=gpt.self_attention,
        self_attn_bda=gpt.self_attn_bda))
    gdn = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=gpt.input_layernorm,
        self_attention=ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=TPSummedNorm, out_proj=RowParallelLinear)),
        self_attn_bda=gpt.self_attn_bda))
    mlp = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=gpt.pre_mlp_layernorm, mlp=gpt.mlp, mlp_bda=gpt.mlp_bda))
    layers = dict(mamba_layer=mamba, gdn_layer=gdn, attention_layer=attention, mlp_layer=mlp)
    if MOE in str(m.hybrid_layer_pattern):
        moe = get_gpt_layer_local_spec(num_experts=int(m.num_moe_experts), moe_grouped_gemm=False,
                                       normalization=m.get("normalization", "LayerNorm")).submodules
        layers["moe_layer"] = ModuleSpec(module=MoETransformerLayer,
                                         submodules=TransformerLayerSubmodules(
                                             pre_mlp_layernorm=moe.pre_mlp_layernorm,
                                             mlp=moe.mlp, mlp_bda=moe.mlp_bda))
    if mtp_parts(str(m.hybrid_layer_pattern)):
        layers["mtp_block_spec"] = local_mtp_block_spec(gpt.input_layernorm)
    return ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(**layers))


def local_mtp_block_spec(norm):
    """megatron's hybrid MTP block spec without TransformerEngine (0.19.2 has only the TE one,
    ``hybrid_layer_specs._hybrid_mtp_block_spec``): a ``MultiTokenPredictionBlock`` of
    ``MultiTokenPredictionLayer`` s with ``enorm``, ``hnorm`` and the final ``layer_norm`` the
    ``norm`` of the main stack's layers (the local spec's, the config's normalization), ``eh_proj``
    a ``ColumnParallelLinear`` (as megatron's local MTP layer, ``get_mtp_layer_spec_for_backend``)
    and ``mtp_model_layer=None``: ``HybridModel`` builds each depth's layers from the pattern's
    MTP part as a nested ``HybridStack`` of the main stack's layer specs
    (``mtp.layers.<depth>.mtp_model_layer.layers.<j>``)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlock,
        MultiTokenPredictionBlockSubmodules,
        MultiTokenPredictionLayer,
        MultiTokenPredictionLayerSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec

    layer = ModuleSpec(module=MultiTokenPredictionLayer,
                       submodules=MultiTokenPredictionLayerSubmodules(
                           enorm=norm, hnorm=norm, eh_proj=ColumnParallelLinear,
                           mtp_model_layer=None, layer_norm=norm))
    return ModuleSpec(module=MultiTokenPredictionBlock,
                      submodules=MultiTokenPredictionBlockSubmodules(layer_specs=[layer]))


def build(m, config, spec, vocab: int, pre: bool, post: bool, vp_stage, tied: bool):
    """One chunk of megatron's ``HybridModel`` (arguments as the GPT family's ``build``).

    Under pipeline parallelism, ``recipes.model.build`` first builds, and drops, the layers
    before this stage (a config of ``pipeline_model_parallel_size=1`` and ``num_layers`` those
    layers) so that every layout starts from pp1's weights: that build takes the pattern's first
    ``num_layers`` symbols (:func:`prefix_pattern`), where megatron would split the whole pattern
    by the pipeline rank and draw this stage's layers instead. With MTP layers, a chunk without
    the first layer builds megatron's copy of the word embedding drawing nothing (the GPT
    family's ``mtp_embedding_copy_draws_nothing``: ``HybridModel`` builds it as ``GPTModel``
    does)."""
    from megatron.core import parallel_state
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    pattern = str(m.hybrid_layer_pattern)
    stages = parallel_state.get_pipeline_model_parallel_world_size()
    if config.pipeline_model_parallel_size == 1 and stages > 1:
        pattern = prefix_pattern(pattern, config.num_layers,
                                 parallel_state.get_pipeline_model_parallel_rank(), stages)
    copy = not pre and bool(config.mtp_num_layers)
    with gpt_model.mtp_embedding_copy_draws_nothing() if copy else contextlib.nullcontext():
        return HybridModel(
            config=config, hybrid_stack_spec=spec, vocab_size=vocab,
            max_sequence_length=m.seq_length, hybrid_layer_pattern=pattern,
            pre_process=pre, post_process=post, share_embeddings_and_output_weights=tied,
            position_embedding_type=m.position_embedding_type,
            rotary_base=m.get("rotary_base", 10000), rotary_percent=m.get("rotary_percent", 1.0),
            vp_stage=vp_stage)


def prefix_pattern(pattern: str, num_layers: int, stage: int, stages: int) -> str:
    """The pattern that makes pipeline stage ``stage`` of ``stages`` build the first
    ``num_layers`` layers of ``pattern`` and nothing else: those symbols in the stage's own
    ``|``-delimited segment, every other segment empty (megatron's
    ``hybrid_layer_allocation.select_pipeline_segment`` picks segment ``stage``). Multi-token
    prediction layers (after ``/``) are left out, as the GPT family's prefix leaves them.

    >>> prefix_pattern("GEGE*E", 3, 1, 2)
    '|GEG'
    """
    main = layer_symbols(pattern.split("/")[0])
    return PIPE * stage + main[:num_layers] + PIPE * (stages - 1 - stage)


@contextlib.contextmanager
def building():
    """While chunks are built: megatron's ``MambaMixer`` on the torch kernels where
    ``mamba_ssm`` cannot run and ``HybridStack``'s final norm without TransformerEngine
    (``mcore_compat.mamba_cpu``), ``GatedDeltaNet`` on torch where flash-linear-attention
    cannot run (``mcore_compat.gdn_cpu``), megatron's local norm zero-centred where the config
    says so (``mcore_compat.zero_centered_norm``) and built under sequence parallelism on any
    device (``mcore_compat.moe_cpu.torch_norm_under_sequence_parallel``: the Mamba layers' norm,
    the final norm, and without apex every input and q/k norm are megatron's
    ``WrappedTorchNorm``, which refuses it), both packed ``in_proj`` weights in the logical
    checkpoint format (``ckpt.format.mamba_format``, ``ckpt.format.gdn_format``), and MoE
    layers' experts built without drawing from torch's generator (the MoE family's
    ``experts_leave_rng_alone``; ``init_experts`` gives them their weights)."""
    from ckpt.format import gdn_format, mamba_format
    from mcore_compat import gdn_cpu, mamba_cpu, moe_cpu, zero_centered_norm

    mamba_cpu.install()
    moe_cpu.torch_norm_under_sequence_parallel()
    zero_centered_norm.install()
    mamba_cpu.hybrid_stack_without_te()
    gdn_cpu.install()
    mamba_format.install()
    gdn_format.install()
    with moe_model.experts_leave_rng_alone():
        yield
