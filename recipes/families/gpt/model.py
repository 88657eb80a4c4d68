"""The GPT family's megatron side: config fields, layer spec and ``GPTModel``."""

from __future__ import annotations

import contextlib
import importlib

from mcore_compat.patches import megatron_patch


def transformer_config_fields(m, dims) -> dict:
    """megatron ``TransformerConfig`` keyword arguments of a dense GPT/Llama ``model`` config.

    Args:
        m: the ``model`` config (``recipes.config.schema.ModelConfig`` fields).
        dims: the run's ``recipes.config.parallel_dims.ParallelDims`` (unused by the dense fields;
            families with experts read their expert sizes from it).
    """
    out = dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.get("num_query_groups"),
        ffn_hidden_size=m.ffn_hidden_size,
        normalization=m.get("normalization", "LayerNorm"),
        layernorm_epsilon=m.get("layernorm_epsilon", 1e-5),
        add_bias_linear=m.get("add_bias_linear", True),
        init_method_std=m.init_method_std,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        add_qkv_bias=bool(m.get("add_qkv_bias", False)),
        gated_linear_unit=m.swiglu,
        activation_func=activation(m),
        qk_layernorm=bool(m.get("qk_layernorm", False)),
        attention_output_gate=bool(m.get("attention_output_gate", False)),
    )
    if m.get("kv_channels"):
        out["kv_channels"] = int(m.kv_channels)
    out.update(mtp_fields(m))
    out.update(mla_fields(m))
    return out


# megatron's MLATransformerConfig fields a ``model`` config sets (recipes/families/gpt/schema.py).
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
              "rope_type", "rotary_scaling_factor", "original_max_position_embeddings",
              "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def mla_fields(m) -> dict:
    """megatron ``MLATransformerConfig``'s multi-latent attention fields (``{}`` without
    ``multi_latent_attention``; ``recipes.model.build.transformer_config`` then builds a plain
    ``TransformerConfig``): the schema's fields of :data:`MLA_FIELDS`, and ``rotary_base`` /
    ``rotary_percent``, which ``MLASelfAttention`` reads from its config (``GPTModel`` builds no
    rotary embedding of its own under MLA)."""
    if not m.get("multi_latent_attention", False):
        return {}
    out = {"multi_latent_attention": True, **{name: m.get(name) for name in MLA_FIELDS}}
    out.update(rotary_base=m.get("rotary_base", 10000),
               rotary_percent=float(m.get("rotary_percent", 1.0)))
    return out


def mtp_fields(m) -> dict:
    """``TransformerConfig``'s multi-token prediction fields: ``mtp_num_layers`` (None when the
    config has none, as megatron expects) and ``mtp_loss_scaling_factor``."""
    layers = int(m.get("mtp_num_layers") or 0)
    if not layers:
        return {}
    return {"mtp_num_layers": layers,
            "mtp_loss_scaling_factor": float(m.get("mtp_loss_scaling_factor", 0.1))}


def gelu_tanh(x):
    """GeLU's tanh approximation, ``0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))``: GPT-2's
    published ``gelu_new`` and Megatron-LM's ``--openai-gelu`` (``openai_gelu``), computed by
    torch's kernel (megatron's own is wrapped in ``torch.compile``, which CPU runs cannot
    assume). Any shape and float dtype."""
    import torch.nn.functional as F  # torch on use: the family's fields load without it

    return F.gelu(x, approximate="tanh")


def activation(m):
    """The MLP's activation: SiLU under SwiGLU (``swiglu``), else GeLU, exact (erf) or, with
    ``openai_gelu``, :func:`gelu_tanh`."""
    import torch.nn.functional as F

    if m.swiglu:
        return F.silu
    return gelu_tanh if m.get("openai_gelu", False) else F.gelu


def spec_builder(m, use_te: bool) -> tuple[str, dict]:
    """``(function name in megatron.core.models.gpt.gpt_layer_specs, keyword arguments)`` of the
    layer spec. The TransformerEngine spec reads the norm from ``TransformerConfig.normalization``
    (its fused layer-norm linears); the local spec takes it as an argument. Both take
    ``qk_layernorm`` (a norm over each query and key head, Qwen3's; under multi-latent
    attention, the norms of the compressed query and key/value) and
    ``multi_latent_attention`` (megatron's ``MLASelfAttention``)."""
    qk = {"qk_layernorm": True} if m.get("qk_layernorm", False) else {}
    if m.get("multi_latent_attention", False):
        qk["multi_latent_attention"] = True
    if use_te:
        return "get_gpt_layer_with_transformer_engine_spec", qk
    return "get_gpt_layer_local_spec", {"normalization": m.get("normalization", "LayerNorm"), **qk}


def layer_spec(m, config, use_te: bool, vp_stage=None):
    """megatron's GPT layer spec (a ``ModuleSpec``) per :func:`spec_builder`; ``config`` and
    ``vp_stage`` are not needed by a dense spec."""
    name, kwargs = spec_builder(m, use_te)
    specs = importlib.import_module("megatron.core.models.gpt.gpt_layer_specs")
    return getattr(specs, name)(**kwargs)


def build(m, config, spec, vocab: int, pre: bool, post: bool, vp_stage, tied: bool):
    """One chunk of megatron's ``GPTModel``.

    Args:
        m: the ``model`` config; config: its ``TransformerConfig``; spec: from :func:`layer_spec`.
        vocab: padded vocabulary rows. pre, post: whether the chunk holds the embedding / the
            output layer and loss. vp_stage: virtual pipeline stage (None without vpp).
        tied: ``share_embeddings_and_output_weights``.
    """
    from megatron.core.models.gpt import GPTModel

    # Only for a chunk holding an embedding copy: the gated patch refuses another megatron-core.
    copy = not pre and bool(config.mtp_num_layers)
    with mtp_embedding_copy_draws_nothing() if copy else contextlib.nullcontext():
        return GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=vocab,
            max_sequence_length=m.seq_length,
            pre_process=pre,
            post_process=post,
            position_embedding_type=m.position_embedding_type,
            rotary_base=m.get("rotary_base", 10000),
            rotary_percent=m.get("rotary_percent", 1.0),
            rope_scaling=m.get("rope_scaling", False),
            rope_scaling_factor=m.get("rope_scaling_factor", 8.0),
            share_embeddings_and_output_weights=tied,
            vp_stage=vp_stage,
            mtp_block_spec=mtp_block_spec(config, spec, vp_stage),
        )


def mtp_block_spec(config, spec, vp_stage):
    """megatron's MTP block spec (``get_gpt_mtp_block_spec``, local or TransformerEngine as
    ``config.transformer_impl``), built from the decoder's last layer spec, for the chunk that
    holds the MTP layers (the last pipeline stage); None without MTP or on another chunk."""
    if not config.mtp_num_layers:
        return None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    return get_gpt_mtp_block_spec(config, spec, config.transformer_impl == "transformer_engine",
                                  vp_stage=vp_stage)


@contextlib.contextmanager
@megatron_patch("models.common.embeddings.language_model_embedding.LanguageModelEmbedding."
                "__init__ (while an MTP stage's embedding copy is built)")
def mtp_embedding_copy_draws_nothing():
    """While active (around building a chunk without the first layer, of a model with MTP
    layers), building a ``LanguageModelEmbedding`` leaves torch's CPU generator and megatron's
    RNG tracker where they were, so the chunk's layers draw the weights they draw at pp1.

    With MTP, megatron builds the word embedding again on the last pipeline stage
    (``GPTModel.__init__``: ``if self.pre_process or self.mtp_process``), zeroes the copy and
    sums it with the first stage's (``LanguageModule.setup_embeddings_and_output_layer``). Its
    random draw is thrown away but would shift every draw after it; at pp1 there is no copy.
    """
    from megatron.core.models.common.embeddings.language_model_embedding import (
        LanguageModelEmbedding)
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    import torch

    init = LanguageModelEmbedding.__init__

    def init_keeping_rng(self, *args, **kwargs):
        tracker = get_cuda_rng_tracker()
        states = tracker.get_states()
        with torch.random.fork_rng(devices=[]):
            init(self, *args, **kwargs)
        tracker.set_states(states)

    LanguageModelEmbedding.__init__ = init_keeping_rng
    try:
        yield
    finally:
        LanguageModelEmbedding.__init__ = init
