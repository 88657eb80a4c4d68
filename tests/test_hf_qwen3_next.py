"""The Qwen3-Next mapping of the hybrid family (recipes/families/hybrid/hf_qwen3_next.py) by
itself: the rows of GatedDeltaNet's ``in_proj`` and of gated attention's ``q_proj`` against
transformers' own split of them (``Qwen3NextGatedDeltaNet.fix_query_key_value_ordering``,
``Qwen3NextAttention.forward``'s chunk), both ways; the config both ways; the export's refusals
by field; the zero-centred norm against transformers' ``Qwen3NextRMSNorm``. No world.
"""

from __future__ import annotations

import pytest
import torch

from ckpt.families import ExportError
from recipes.families.hybrid import hf_qwen3_next as q3
from recipes.families.hybrid.formats import architecture

GDN = {"linear_num_key_heads": 2, "linear_key_head_dim": 3, "linear_num_value_heads": 6,
       "linear_value_head_dim": 2, "linear_conv_kernel_dim": 4}


def test_in_proj_components_are_transformers_q_k_v_z_beta_alpha():
    """Projecting the identity gives the weights' rows as transformers' features: its split of
    them (per key head ``[q | k | v | z]``, ``[b | a]``) is each megatron component's rows, in
    the value heads' order; and back, bit for bit."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    net = Qwen3NextGatedDeltaNet(Qwen3NextConfig(hidden_size=8, **GDN), 0)
    qkvz, ba = torch.randn(2 * 6 + 2 * 12, 8), torch.randn(12, 8)
    eye = torch.eye(8)[None]  # [1, 8 tokens, 8]: token t's features = the weights' column t
    q, k, v, z, b, a = net.fix_query_key_value_ordering(eye @ qkvz.T, eye @ ba.T)
    got = q3.split_in_proj(qkvz, ba, GDN)
    for name, want in zip(q3.IN_PROJ, (q, k, v, z, b, a)):
        assert torch.equal(got[name].T, want.reshape(8, -1)), name
    back = q3.fuse_in_proj(got, GDN)
    assert torch.equal(back[0], qkvz) and torch.equal(back[1], ba)


def test_gated_qkv_rows_per_query_group():
    """megatron's rows per query group ``[q heads | gate heads | k | v]`` (docs/gated-attention.md)
    from transformers' ``q_proj`` (per head ``[q | gate]``, as its forward chunks it), built
    row by row here; and back."""
    heads, groups, d, h = 4, 2, 3, 5
    q_proj, k, v = torch.randn(heads * 2 * d, h), torch.randn(groups * d, h), torch.randn(
        groups * d, h)
    query, gate = q_proj.view(heads, 2 * d, h).chunk(2, dim=1)  # transformers' chunk
    rows = []
    for g in range(groups):
        members = range(g * heads // groups, (g + 1) * heads // groups)
        rows += [query[i] for i in members] + [gate[i] for i in members]
        rows += [k[g * d:(g + 1) * d], v[g * d:(g + 1) * d]]
    fused = q3.fuse_gated_qkv(q_proj, k, v, heads, groups, d)
    assert torch.equal(fused, torch.cat(rows))
    for got, want in zip(q3.split_gated_qkv(fused, heads, groups, d), (q_proj, k, v)):
        assert torch.equal(got, want)


def test_zero_centred_norm_is_transformers():
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    from mcore_compat.zero_centered_norm import ZeroCenteredRMSNorm

    ours, theirs = ZeroCenteredRMSNorm(16, eps=1e-6), Qwen3NextRMSNorm(16, eps=1e-6)
    assert torch.equal(ours.weight, torch.zeros(16))  # the identity scale, as transformers'
    with torch.no_grad():
        ours.weight.normal_(0.3, 0.2)
        theirs.weight.copy_(ours.weight)
    x = torch.randn(3, 16)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-6, atol=0)



@pytest.mark.parametrize("sp", [True, False])
def test_a_zero_centred_norm_is_tagged_for_sequence_parallelism_whatever_the_patch_order(sp):
    """On CPU the worker installs the sequence-parallel norm patch (mcore_compat.moe_cpu) before
    the hybrid family's build installs this one over it: the zero-centred norm must still carry
    megatron's ``sequence_parallel`` tag, or finalize_model_grads leaves its gradient unsummed
    over TP (a fresh train.py run at tp2+sp builds once: nothing re-wraps the patches)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mcore_compat import moe_cpu, zero_centered_norm

    moe_cpu.torch_norm_under_sequence_parallel()
    zero_centered_norm.install()
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                               normalization="RMSNorm", layernorm_zero_centered_gamma=True)
    config.sequence_parallel = sp
    norm = WrappedTorchNorm(config, 8)
    assert [getattr(p, "sequence_parallel", None) for p in norm.parameters()] == [sp]

def _config():
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        vocab_size=300, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, intermediate_size=40, moe_intermediate_size=12,
        shared_expert_intermediate_size=20, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=False, decoder_sparse_step=2, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                         "partial_rotary_factor": 0.25}, **GDN)


def test_config_both_ways():
    """``full_attention_interval`` 4 (transformers' default layer types: G G G *) and
    ``decoder_sparse_step`` 2 (every second layer MoE) give the pattern; the export's config
    names every dense layer in ``mlp_only_layers`` instead (the same layers)."""
    c = _config()
    m = q3.fields(c)
    assert m["hybrid_layer_pattern"] == "G-GEG-*E" and m["num_layers"] == 8
    assert (m["num_moe_experts"], m["moe_router_topk"], m["moe_router_pre_softmax"],
            m["moe_ffn_hidden_size"], m["moe_shared_expert_intermediate_size"]) == (
        4, 2, True, 12, 20)
    assert (m["kv_channels"], m["num_query_groups"], m["rotary_percent"], m["rotary_base"]) == (
        12, 2, 0.25, 5000)
    assert m["attention_output_gate"] and m["qk_layernorm"] and m["moe_shared_expert_gate"]
    assert {f: m[f] for f in GDN} == GDN
    back = q3.config(m, 300, {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None})
    assert back.layer_types == c.layer_types and back.mlp_only_layers == [0, 2]
    for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
                 "num_experts", "num_experts_per_tok", "norm_topk_prob", "rms_norm_eps",
                 "rope_parameters", *GDN):
        assert getattr(back, name) == getattr(c, name), name
    assert architecture(dict(m, family="hybrid")) == "qwen3_next"


def test_the_gated_shared_expert_is_in_the_parameter_table():
    from omegaconf import OmegaConf

    from recipes.families.hybrid.params import parameter_shapes

    m = OmegaConf.create(q3.fields(_config()))
    shapes = {p.name: tuple(p.shape) for p in parameter_shapes(m, 320)}
    assert shapes["decoder.layers.3.mlp.shared_experts.gate_weight"] == (1, 32)
    assert "decoder.layers.1.mlp.shared_experts.gate_weight" not in shapes  # a dense layer
    m.moe_shared_expert_gate = False
    assert not any(n.endswith("gate_weight") for n in
                   (p.name for p in parameter_shapes(m, 320)))


@pytest.mark.parametrize("change, match", [
    ({"hybrid_layer_pattern": "MG*E", "num_layers": 4},
     r"^model.hybrid_layer_pattern='MG\*E': layer symbols .* NemotronHForCausalLM .* "
     r"Qwen3NextForCausalLM takes pairs"),
    ({"layernorm_zero_centered_gamma": False},
     r"^model.layernorm_zero_centered_gamma=False: Qwen3NextForCausalLM has no equivalent"),
    ({"qk_layernorm": False}, r"^model.qk_layernorm=False: Qwen3NextForCausalLM"),
    ({"attention_output_gate": False}, r"^model.attention_output_gate=False: Qwen3Next"),
    ({"moe_shared_expert_gate": False}, r"^model.moe_shared_expert_gate=False: Qwen3Next"),
    ({"moe_shared_expert_intermediate_size": None},
     r"^model.moe_shared_expert_intermediate_size=None: .*always has a shared expert"),
    ({"moe_router_score_function": "sigmoid"}, r"^model.moe_router_score_function='sigmoid'"),
    ({"add_bias_linear": True}, r"^model.add_bias_linear=True: Qwen3NextForCausalLM"),
])
def test_the_export_refuses_what_qwen3_next_does_not_compute(change, match):
    m = dict(q3.fields(_config()), family="hybrid")
    with pytest.raises(ExportError, match=match):
        architecture({**m, **change})
