"""Multi-latent attention in a run: the checks before launch (``docs/mla.md``).

The fields are the GPT family's (``recipes/families/gpt/schema.py``), which the MoE family
takes too; the layers are megatron's ``MLASelfAttention`` with its local spec, as
``mcore_compat.mla_local`` makes them build and train at any TP (``recipes.model.build``).
"""

from __future__ import annotations

from recipes.config.errors import ConfigError
from recipes.config.parallel_dims import check_positive
from recipes.families import family_name
from recipes.model import te

ROPE_TYPES = ("rope", "yarn")
KEY = "model.multi_latent_attention=true"
# The families whose model is megatron's GPTModel, which builds MLASelfAttention; the others
# (hybrid, llava) build SelfAttention. MLA's fields are the GPT family's, which its folder
# alone names (tests/test_model_families.py), so the refusal of the others is here.
BUILT_BY = ("gpt", "moe")


def check(cfg, parallel_dims) -> None:
    """MLA rules, before any process starts (nothing without ``multi_latent_attention``).

    Raises:
        ConfigError: one line naming the field: a family other than :data:`BUILT_BY`; a
            ``rope_type`` other than rope or yarn; a
            head width or rank < 1, an odd ``qk_pos_emb_head_dim`` (RoPE turns pairs), YaRN's
            ``beta_fast`` or ``beta_slow`` <= 0 (megatron divides by them at the first
            forward); fields
            MLA does not use or computes otherwise (``position_embedding_type`` other than
            rope, ``rope_scaling``, query groups, ``kv_channels``, ``add_qkv_bias``,
            ``attention_output_gate``);
            ``qk_layernorm`` without ``q_lora_rank`` (megatron's local spec has no norm before
            ``linear_q_proj``); ranks tensor parallelism cannot split (``q_lora_rank``,
            ``kv_lora_rank + qk_pos_emb_head_dim``); TransformerEngine layers (their MLA
            weights are not the parameter table's).
    """
    m = cfg.model
    if not m.get("multi_latent_attention", False):
        return
    if family_name(m) not in BUILT_BY:
        raise ConfigError(f"{KEY} with model.family={family_name(m)!r}: multi-latent attention "
                          f"is built by the families {BUILT_BY} (megatron's GPTModel); this "
                          f"family builds megatron's SelfAttention; use false")
    if m.get("rope_type") not in ROPE_TYPES:
        raise ConfigError(f"model.rope_type={m.get('rope_type')!r} with {KEY}: valid are "
                          f"{ROPE_TYPES}")
    for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        check_positive(f"model.{name}", m.get(name))
    q_rank = m.get("q_lora_rank")
    if q_rank is not None:
        check_positive("model.q_lora_rank", q_rank)
    if m.qk_pos_emb_head_dim % 2:
        raise ConfigError(f"model.qk_pos_emb_head_dim={m.qk_pos_emb_head_dim} must be even: "
                          f"RoPE rotates pairs of channels")
    if m.get("rope_type") == "yarn":
        check_positive("model.original_max_position_embeddings",
                       m.get("original_max_position_embeddings"))
        if not float(m.get("rotary_scaling_factor")) > 0:
            raise ConfigError(f"model.rotary_scaling_factor={m.get('rotary_scaling_factor')} "
                              f"must be > 0 (YaRN's context extension; 1: none)")
        for name in ("beta_fast", "beta_slow"):  # megatron's correction range: log(s / b)
            if not float(m.get(name)) > 0:
                raise ConfigError(f"model.{name}={m.get(name)} must be > 0 (YaRN's rotations "
                                  f"at the edges of its correction range; DeepSeek-V3: "
                                  f"beta_fast=32, beta_slow=1)")
    _check_unused_fields(m)
    if q_rank is None and m.get("qk_layernorm", False):
        raise ConfigError(f"model.q_lora_rank=null with model.qk_layernorm=true: megatron's "
                          f"local MLA spec has no norm before linear_q_proj (only the "
                          f"TransformerEngine spec fuses one); set model.q_lora_rank or "
                          f"model.qk_layernorm=false")
    tp = parallel_dims.tensor_model_parallel_size
    tp_name = f"tensor_model_parallel_size={tp}"
    if q_rank is not None and q_rank % tp:
        raise ConfigError(f"model.q_lora_rank={q_rank} must be divisible by {tp_name} "
                          f"(linear_q_down_proj's rows are split over TP ranks)")
    kv_rows = int(m.kv_lora_rank) + int(m.qk_pos_emb_head_dim)
    if kv_rows % tp:
        raise ConfigError(f"model.kv_lora_rank + model.qk_pos_emb_head_dim = {m.kv_lora_rank} + "
                          f"{m.qk_pos_emb_head_dim} = {kv_rows} must be divisible by {tp_name} "
                          f"(linear_kv_down_proj's rows are split over TP ranks)")
    if te.uses_transformer_engine(cfg):
        raise ConfigError(f"{KEY} runs megatron's local layers: set model.transformer_impl="
                          f"local (the TransformerEngine MLA spec replicates the down "
                          f"projections and fuses the norms into the up projections, weights "
                          f"other than the parameter table's)")


def _check_unused_fields(m) -> None:
    """Fields of the dense attention that MLA would ignore or compute otherwise."""
    heads = m.num_attention_heads
    groups = m.get("num_query_groups")
    refusals = (
        (m.position_embedding_type != "rope",
         f"model.position_embedding_type={m.position_embedding_type!r}: MLA applies RoPE to "
         f"its decoupled part itself (model.rope_type); set position_embedding_type=rope"),
        (bool(m.get("rope_scaling", False)),
         "model.rope_scaling=true: MLA's RoPE takes no Llama-3.1 scaling (its scaling is "
         "rope_type=yarn); set rope_scaling=false"),
        (groups not in (None, heads),
         f"model.num_query_groups={groups}: every MLA head has its own key and value "
         f"(linear_kv_up_proj); set num_query_groups=null"),
        (m.get("kv_channels") is not None,
         f"model.kv_channels={m.get('kv_channels')}: MLA's head widths are qk_head_dim, "
         f"qk_pos_emb_head_dim and v_head_dim; set kv_channels=null"),
        (bool(m.get("add_qkv_bias", False)),
         "model.add_qkv_bias=true: megatron's MLA projections have no bias; set "
         "add_qkv_bias=false"),
        (bool(m.get("attention_output_gate", False)),
         "model.attention_output_gate=true: megatron-core 0.19.2's MLATransformerConfig raises "
         "NotImplementedError (no output gate for MLA); set attention_output_gate=false"),
    )
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"{KEY} with {why}")
