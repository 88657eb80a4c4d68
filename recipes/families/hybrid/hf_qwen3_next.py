"""transformers' ``Qwen3NextForCausalLM`` both ways with the hybrid family: config.json <-> the
``model`` fields (megatron's names) and the weight table (:mod:`ckpt.hf.mapping`) from which
the import plan, the size checks and the export's state dict are derived.

A Qwen3-Next layer is a token mixer then an MLP, each a pre-norm residual block: megatron's
hybrid pattern gives each its own layer, so HF layer ``i`` is megatron's layers ``2i`` (``G``:
``linear_attention``, megatron's ``GatedDeltaNet``; ``*``: ``full_attention``, gated attention)
and ``2i + 1`` (``E``: the sparse MoE block; ``-``: a dense SwiGLU MLP, the
``mlp_only_layers`` and the layers ``decoder_sparse_step`` skips). Every norm but
GatedDeltaNet's gated one is zero-centred (``Qwen3NextRMSNorm``: ``(1 + weight)``, megatron's
``layernorm_zero_centered_gamma``; the weights are kept as they are, so an export gives the same
bits back). The tensors, under ``model.layers.<i>.`` (megatron's under ``decoder.layers.<j>.``):

* ``linear_attn.in_proj_qkvz`` rows per key head ``[q | k | v | z]`` (``v`` and ``z``: the key
  head's ``linear_num_value_heads / linear_num_key_heads`` value heads) and ``in_proj_ba`` per
  key head ``[b | a]`` <-> megatron's ``in_proj`` components ``query | key | value | z | beta |
  alpha`` (``self_attention.in_proj.weight.<c>``, the logical format's split): a permutation of
  rows; ``conv1d.weight`` ``[q | k | v]`` channels <-> ``conv1d.weight.{query,key,value}``;
  ``A_log``, ``dt_bias``, ``norm`` (``out_norm``: ``weight * x``, not zero-centred) and
  ``out_proj`` as they are;
* ``self_attn.q_proj`` rows per head ``[q | gate]`` with ``k_proj``, ``v_proj`` <-> megatron's
  ``linear_qkv`` rows per query group ``[q heads | gate heads | k | v]``
  (``attention_output_gate``); ``q_norm``/``k_norm`` -> ``q_layernorm``/``k_layernorm``;
* ``mlp.gate`` -> ``router``; the experts (saved per expert ``gate_proj``/``up_proj``/
  ``down_proj``, held fused by transformers) -> ``experts.experts.linear_fc1/2``;
  ``shared_expert`` -> ``shared_experts`` (gated fc1), ``shared_expert_gate`` ->
  ``shared_experts.gate_weight`` (``moe_shared_expert_gate``);
* ``input_layernorm`` -> layer ``2i``'s norm, ``post_attention_layernorm`` -> layer
  ``2i + 1``'s ``pre_mlp_layernorm``.

Routing is Qwen3-MoE's (softmax; ``norm_topk_prob`` -> ``not moe_router_pre_softmax``). The Hub
checkpoints' multi-token prediction weights (``mtp.*``, which transformers ignores on load) are
left out of an import. Cheap to import (no torch, no megatron at import).
"""

from __future__ import annotations

from dataclasses import dataclass

from ckpt.families import ExportError
from ckpt.hf.hf_weights import HFImportError
from ckpt.hf.mapping import Direct, Entry, Experts, GatedFC1, state_dict
from recipes.families.gpt.hf_import import rope_parameters
from recipes.families.hybrid.model import ATTENTION, GDN, MLP, MOE
from recipes.families.moe.formats import ROUTER_EXPORTABLE

MIXERS = {GDN: "linear_attention", ATTENTION: "full_attention"}
MTP_PREFIX = "mtp."  # the Hub's multi-token prediction weights: left out of an import
H, F, V = ("hidden", 1), ("ffn", 1), ("vocab", 1)
Q, G = ("heads", "head_dim"), ("groups", "head_dim")
IN_PROJ = ("query", "key", "value", "z", "beta", "alpha")
CONV = ("query", "key", "value")
SIZE_FIELDS = {
    "layers": "num_hidden_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
    "groups": "num_key_value_heads", "ffn": "intermediate_size", "vocab": "vocab_size",
    "experts": "num_experts", "expert_ffn": "moe_intermediate_size",
    "shared_ffn": "shared_expert_intermediate_size", "q_rows": "num_attention_heads x 2 x head_dim",
    "qkvz": "linear_num_key_heads x linear_key_head_dim x 2 + linear_num_value_heads x "
            "linear_value_head_dim x 2",
    "ba": "2 x linear_num_value_heads", "conv": "linear_num_key_heads x linear_key_head_dim x 2 "
                                               "+ linear_num_value_heads x linear_value_head_dim",
    "v_heads": "linear_num_value_heads", "head_v": "linear_value_head_dim",
    "kernel": "linear_conv_kernel_dim",
    "v_dim": "linear_num_value_heads x linear_value_head_dim"}


def _refuse(field: str, value, valid: str) -> HFImportError:
    return HFImportError(f"config.json {field}={value!r}: {valid}")


def _gdn(m: dict) -> tuple[int, int, int, int]:
    """(key heads, key head dim, value heads, value head dim) of ``m``."""
    return (int(m["linear_num_key_heads"]), int(m["linear_key_head_dim"]),
            int(m["linear_num_value_heads"]), int(m["linear_value_head_dim"]))


def split_in_proj(qkvz, ba, m: dict) -> dict:
    """HF's ``in_proj_qkvz`` ``[nk * (2 dk + 2 r dv), H]`` and ``in_proj_ba`` ``[nk * 2r, H]``
    (per key head: ``[q | k | v | z]``, ``[b | a]``; ``r`` = value heads per key head) ->
    ``{component: rows}`` of megatron's ``in_proj`` (:data:`IN_PROJ`: q, k ``[nk dk, H]``;
    v, z ``[nv dv, H]``; beta, alpha ``[nv, H]``), value heads in the same order."""
    nk, dk, nv, dv = _gdn(m)
    r, rest = nv // nk, qkvz.shape[1:]
    g = qkvz.reshape(nk, 2 * dk + 2 * r * dv, *rest)
    q, k, v, z = g.split([dk, dk, r * dv, r * dv], dim=1)
    b, a = ba.reshape(nk, 2 * r, *rest).split([r, r], dim=1)
    return {"query": q.reshape(nk * dk, *rest), "key": k.reshape(nk * dk, *rest),
            "value": v.reshape(nv * dv, *rest), "z": z.reshape(nv * dv, *rest),
            "beta": b.reshape(nv, *rest), "alpha": a.reshape(nv, *rest)}


def fuse_in_proj(parts: dict, m: dict) -> tuple:
    """The inverse of :func:`split_in_proj`: megatron's six components -> (``in_proj_qkvz``,
    ``in_proj_ba``)."""
    import torch

    nk = _gdn(m)[0]
    rest = parts["query"].shape[1:]
    per = [parts[c].reshape(nk, -1, *rest) for c in IN_PROJ]
    return (torch.cat(per[:4], dim=1).reshape(-1, *rest),
            torch.cat(per[4:], dim=1).reshape(-1, *rest))


def fuse_gated_qkv(q, k, v, heads: int, groups: int, d: int):
    """HF's ``q_proj`` ``[heads * 2d, H]`` (per head ``[q | gate]``), ``k_proj``, ``v_proj``
    ``[groups * d, H]`` -> megatron's ``linear_qkv`` rows per query group ``[q heads | gate
    heads | k | v]`` (``SelfAttention.get_query_key_value_tensors`` with
    ``attention_output_gate``)."""
    import torch

    rest, p = q.shape[1:], heads // groups
    qg = q.reshape(groups, p, 2, d, *rest)
    return torch.cat([qg[:, :, 0].reshape(groups, p * d, *rest),
                      qg[:, :, 1].reshape(groups, p * d, *rest),
                      k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)],
                     dim=1).reshape(-1, *rest)


def split_gated_qkv(w, heads: int, groups: int, d: int) -> tuple:
    """The inverse of :func:`fuse_gated_qkv`: (``q_proj``, ``k_proj``, ``v_proj``)."""
    import torch

    rest, p = w.shape[1:], heads // groups
    q, gate, k, v = w.reshape(groups, 2 * p * d + 2 * d, *rest).split([p * d, p * d, d, d], 1)
    q_proj = torch.stack([q.reshape(groups, p, d, *rest), gate.reshape(groups, p, d, *rest)],
                         dim=2).reshape(heads * 2 * d, *rest)
    return q_proj, k.reshape(groups * d, *rest), v.reshape(groups * d, *rest)


def _attention_dims(m: dict) -> tuple[int, int, int]:
    heads = m["num_attention_heads"]
    return heads, m.get("num_query_groups") or heads, m.get("kv_channels") or (
        m["hidden_size"] // heads)


@dataclass(frozen=True)
class GatedQKV(Entry):
    """``hf`` = (q_proj, k_proj, v_proj) <-> megatron's gated ``linear_qkv``
    (:func:`fuse_gated_qkv`)."""

    def to_megatron(self, tensors, m, loaded=False):
        return fuse_gated_qkv(*tensors, *_attention_dims(m))

    def to_hf(self, t, m, loaded=False):
        return dict(zip(self.names(m, loaded), split_gated_qkv(t, *_attention_dims(m))))


@dataclass(frozen=True)
class Part(Entry):
    """One component of megatron's (``component``) made of rows of HF tensors that hold several:
    ``in_proj`` (``hf`` = (in_proj_qkvz, in_proj_ba), :func:`split_in_proj`) or ``conv1d``
    (``hf`` = (conv1d.weight,), channels ``[q | k | v]``). Exported by :func:`build`, which
    puts an HF tensor's components together."""

    component: str = ""

    def to_megatron(self, tensors, m, loaded=False):
        if len(tensors) == 2:
            return split_in_proj(*tensors, m)[self.component]
        nk, dk, nv, dv = _gdn(m)
        return tensors[0].split([nk * dk, nk * dk, nv * dv])[CONV.index(self.component)]

    def to_hf(self, t, m, loaded=False):
        raise NotImplementedError("a Part is exported by hf_qwen3_next.build")


def pairs(pattern: str) -> list[tuple[str, str]]:
    """``hybrid_layer_pattern`` as Qwen3-Next's layers: (mixer ``G`` / ``*``, MLP ``E`` / ``-``)
    pairs.

    Raises:
        ExportError: a pattern that is not such pairs (names it).
    """
    out = [(pattern[i], pattern[i + 1]) for i in range(0, len(pattern) - 1, 2)]
    if len(pattern) % 2 or any(a not in MIXERS or b not in (MOE, MLP) for a, b in out):
        raise ExportError(f"model.hybrid_layer_pattern={pattern!r}: Qwen3NextForCausalLM's "
                          f"layers are a token mixer ('G' GatedDeltaNet or '*' attention) then "
                          f"an MLP ('E' MoE or '-' dense): exportable are patterns of such "
                          f"pairs, e.g. 'GEGEGE*E'")
    return out


def _mlp(m: dict, i: int, j: int, moe: bool) -> list:
    s, d = f"layers.{i}.mlp.", f"decoder.layers.{j}."
    out = [Direct(d + "pre_mlp_layernorm.weight", (f"layers.{i}.post_attention_layernorm.weight",),
                  ((H,),))]
    if not moe:
        return out + [GatedFC1(d + "mlp.linear_fc1.weight", (s + "gate_proj.weight",
                                                            s + "up_proj.weight"), ((F, H),) * 2),
                      Direct(d + "mlp.linear_fc2.weight", (s + "down_proj.weight",), ((H, F),))]
    f, shared, e = ("expert_ffn", 1), ("shared_ffn", 1), s + "experts.{e}."
    return out + [
        # The router first: check_sizes counts the experts from its rows before their names.
        Direct(d + "mlp.router.weight", (s + "gate.weight",), ((("experts", 1), H),)),
        Experts(d + "mlp.experts.experts.linear_fc1.weight",
                (e + "gate_proj.weight", e + "up_proj.weight"), ((f, H), (f, H)),
                loaded=(s + "experts.gate_up_proj",)),
        Experts(d + "mlp.experts.experts.linear_fc2.weight", (e + "down_proj.weight",),
                ((H, f),), loaded=(s + "experts.down_proj",)),
        GatedFC1(d + "mlp.shared_experts.linear_fc1.weight",
                 (s + "shared_expert.gate_proj.weight", s + "shared_expert.up_proj.weight"),
                 ((shared, H),) * 2),
        Direct(d + "mlp.shared_experts.linear_fc2.weight", (s + "shared_expert.down_proj.weight",),
               ((H, shared),)),
        Direct(d + "mlp.shared_experts.gate_weight", (s + "shared_expert_gate.weight",),
               ((("unit", 1), H),)),
    ]


def _mixer(i: int, j: int, symbol: str) -> list:
    d = f"decoder.layers.{j}."
    out = [Direct(d + "input_layernorm.weight", (f"layers.{i}.input_layernorm.weight",), ((H,),))]
    if symbol == ATTENTION:
        a, s = f"layers.{i}.self_attn.", d + "self_attention."
        return out + [
            GatedQKV(s + "linear_qkv.weight", (a + "q_proj.weight", a + "k_proj.weight",
                                               a + "v_proj.weight"),
                     ((("q_rows", 1), H), (G, H), (G, H))),
            Direct(s + "q_layernorm.weight", (a + "q_norm.weight",), ((("head_dim", 1),),)),
            Direct(s + "k_layernorm.weight", (a + "k_norm.weight",), ((("head_dim", 1),),)),
            Direct(s + "linear_proj.weight", (a + "o_proj.weight",), ((H, Q),)),
        ]
    a, s = f"layers.{i}.linear_attn.", d + "self_attention."
    proj = (a + "in_proj_qkvz.weight", a + "in_proj_ba.weight")
    conv = ((("conv", 1), ("unit", 1), ("kernel", 1)),)
    return out + [Part(f"{s}in_proj.weight.{c}", proj, ((("qkvz", 1), H), (("ba", 1), H)),
                       component=c) for c in IN_PROJ] + [
        Part(f"{s}conv1d.weight.{c}", (a + "conv1d.weight",), conv, component=c) for c in CONV
    ] + [
        Direct(s + "A_log", (a + "A_log",), ((("v_heads", 1),),)),
        Direct(s + "dt_bias", (a + "dt_bias",), ((("v_heads", 1),),)),
        Direct(s + "out_norm.weight", (a + "norm.weight",), ((("head_v", 1),),)),
        Direct(s + "out_proj.weight", (a + "out_proj.weight",), ((H, ("v_dim", 1)),)),
    ]


def table(m: dict) -> list:
    """Every tensor of the ``Qwen3NextForCausalLM`` of the hybrid ``model`` dict ``m`` (names
    after ``model.``; one entry per megatron key, HF layer ``i`` <-> megatron ``2i``, ``2i+1``).

    Raises:
        ExportError: a pattern that is not mixer/MLP pairs (:func:`pairs`).
    """
    out = [Direct("embedding.word_embeddings.weight", ("embed_tokens.weight",), ((V, H),),
                  vocab=True),
           Direct("decoder.final_norm.weight", ("norm.weight",), ((H,),))]
    if not m.get("share_embeddings_and_output_weights"):
        out.append(Direct("output_layer.weight", ("lm_head.weight",), ((V, H),), vocab=True,
                          prefixed=False))
    for i, (mixer, mlp) in enumerate(pairs(m["hybrid_layer_pattern"])):
        out += _mixer(i, 2 * i, mixer) + _mlp(m, i, 2 * i + 1, mlp == MOE)
    return out


def sizes(m: dict) -> dict:
    """The size keys of :data:`SIZE_FIELDS` beyond the common ones, from ``m`` (None: a part the
    model does not have); ``layers`` is Qwen3-Next's (half megatron's)."""
    pattern = m["hybrid_layer_pattern"]
    heads, _, d = _attention_dims(m)
    out = {"layers": len(pattern) // 2, "unit": 1, "q_rows": 2 * heads * d,
           "experts": m.get("num_moe_experts") if MOE in pattern else None,
           "expert_ffn": m.get("moe_ffn_hidden_size") if MOE in pattern else None,
           "shared_ffn": m.get("moe_shared_expert_intermediate_size") if MOE in pattern else None}
    gdn = dict.fromkeys(("qkvz", "ba", "conv", "v_heads", "head_v", "kernel", "v_dim"))
    if GDN in pattern:
        nk, dk, nv, dv = _gdn(m)
        gdn = {"qkvz": 2 * nk * dk + 2 * nv * dv, "ba": 2 * nv, "conv": 2 * nk * dk + nv * dv,
               "v_heads": nv, "head_v": dv, "kernel": int(m["linear_conv_kernel_dim"]),
               "v_dim": nv * dv}
    return {**out, **gdn}


def build(tensors: dict, m: dict, vocab: int, ids: dict) -> tuple:
    """(``Qwen3NextConfig``, state dict in transformers' model's names) of a hybrid model's full
    logical tensors: :func:`ckpt.hf.mapping.state_dict` of :func:`table`, the ``in_proj`` and
    ``conv1d`` components put together (:func:`fuse_in_proj`; conv1d channels ``q | k | v``).

    Raises:
        KeyError: a tensor the table names is missing (named).
    """
    import torch

    entries = table(m)
    state = state_dict([e for e in entries if not isinstance(e, Part)], tensors, m, vocab,
                       "model.")
    parts: dict = {}
    for e in (e for e in entries if isinstance(e, Part)):
        parts.setdefault(e.hf, {})[e.component] = tensors[e.megatron]
    for names, got in parts.items():
        fused = fuse_in_proj(got, m) if len(names) == 2 else (
            torch.cat([got[c] for c in CONV]),)
        state.update({"model." + n: t for n, t in zip(names, fused)})
    return config(m, vocab, ids), state


def config(m: dict, vocab: int, ids: dict):
    """The ``Qwen3NextConfig`` of the hybrid ``model`` dict ``m`` (the inverse of
    :func:`fields`), the unpadded vocabulary size and the special token ids."""
    from transformers import Qwen3NextConfig

    layers = pairs(m["hybrid_layer_pattern"])
    heads, groups, d = _attention_dims(m)
    moe = any(b == MOE for _, b in layers)
    experts = dict(num_experts=0)
    if moe:
        experts = dict(
            num_experts=int(m["num_moe_experts"]), num_experts_per_tok=int(m["moe_router_topk"]),
            moe_intermediate_size=int(m.get("moe_ffn_hidden_size") or m["ffn_hidden_size"]),
            shared_expert_intermediate_size=int(m["moe_shared_expert_intermediate_size"]),
            norm_topk_prob=not bool(m.get("moe_router_pre_softmax", False)),
            router_aux_loss_coef=float(m.get("moe_aux_loss_coeff") or 0.0))
    gdn = {}
    if any(a == GDN for a, _ in layers):
        gdn = {f: int(m[f]) for f in ("linear_conv_kernel_dim", "linear_key_head_dim",
                                      "linear_value_head_dim", "linear_num_key_heads",
                                      "linear_num_value_heads")}
    return Qwen3NextConfig(
        vocab_size=vocab, hidden_size=m["hidden_size"], num_hidden_layers=len(layers),
        num_attention_heads=heads, num_key_value_heads=groups, head_dim=d,
        intermediate_size=int(m["ffn_hidden_size"]), max_position_embeddings=m["seq_length"],
        rms_norm_eps=float(m.get("layernorm_epsilon", 1e-5)), hidden_act="silu",
        tie_word_embeddings=bool(m.get("share_embeddings_and_output_weights")),
        attention_bias=False, attention_dropout=0.0,
        layer_types=[MIXERS[a] for a, _ in layers], decoder_sparse_step=1,
        mlp_only_layers=[i for i, (_, b) in enumerate(layers) if b == MLP],
        rope_parameters={"rope_type": "default", "rope_theta": float(m.get("rotary_base", 10000)),
                         "partial_rotary_factor": float(m.get("rotary_percent", 1.0))},
        architectures=["Qwen3NextForCausalLM"], **experts, **gdn, **ids)


# Settings Qwen3NextForCausalLM computes one way: (field, default, exportable, what is).
EXPORTABLE = (
    ("normalization", "LayerNorm", lambda v: v == "RMSNorm", "'RMSNorm'"),
    ("layernorm_zero_centered_gamma", False, bool, "true (Qwen3NextRMSNorm is zero-centred)"),
    ("add_bias_linear", True, lambda v: not v, "false"),
    ("add_qkv_bias", False, lambda v: not v, "false"),
    ("swiglu", False, bool, "true"),
    ("position_embedding_type", "learned_absolute", lambda v: v == "rope", "'rope'"),
    ("rope_scaling", False, lambda v: not v, "false"),
    ("multi_latent_attention", False, lambda v: not v, "false"),
)
ATTENTION_EXPORTABLE = (
    ("qk_layernorm", False, bool, "true (q_norm, k_norm)"),
    ("attention_output_gate", False, bool, "true (q_proj's gate rows)"),
)
MOE_EXPORTABLE = ROUTER_EXPORTABLE + (
    ("moe_shared_expert_intermediate_size", None, bool,
     "a width (Qwen3NextSparseMoeBlock always has a shared expert)"),
    ("moe_shared_expert_gate", False, bool, "true (shared_expert_gate)"),
)


def check_export(model: dict) -> None:
    """Refuse a hybrid ``model`` dict that ``Qwen3NextForCausalLM`` does not compute exactly.

    Raises:
        ExportError: the pattern (:func:`pairs`: Mamba layers included) or a setting, named
            with its value and what is exportable.
    """
    layers = pairs(model["hybrid_layer_pattern"])
    checks = EXPORTABLE + (ATTENTION_EXPORTABLE if any(a == ATTENTION for a, _ in layers)
                           else ()) + (MOE_EXPORTABLE if any(b == MOE for _, b in layers) else ())
    for field, default, exportable, valid in checks:
        value = model.get(field, default)
        if not exportable(value):
            raise ExportError(f"model.{field}={value!r}: Qwen3NextForCausalLM has no "
                              f"equivalent (exportable: {valid})")


def fields(c) -> dict:
    """The hybrid family's ``model`` fields of a ``Qwen3NextConfig`` ``c``.

    Raises:
        HFImportError: a setting megatron-core 0.19.2's hybrid model here does not compute
            exactly (names the config field, its value and what is importable).
    """
    if c.hidden_act != "silu":
        raise _refuse("hidden_act", c.hidden_act, "only 'silu' (SwiGLU; GatedDeltaNet's "
                                                  "conv1d and gate)")
    if getattr(c, "attention_bias", False):
        raise _refuse("attention_bias", True, "megatron's hybrid model here has no attention "
                                              "biases (only false)")
    rope = rope_parameters(c)
    if rope.get("rope_type", "default") != "default":
        raise _refuse("rope_parameters.rope_type", rope["rope_type"], "only 'default'")
    theta = float(rope.get("rope_theta", 10000.0))
    if theta != int(theta):
        raise _refuse("rope_theta", theta, "model.rotary_base is an integer")
    kinds = list(c.layer_types)
    if len(kinds) != c.num_hidden_layers or any(k not in MIXERS.values() for k in kinds):
        raise _refuse("layer_types", kinds, f"num_hidden_layers={c.num_hidden_layers} entries "
                                            f"of {sorted(MIXERS.values())}")
    step, dense = int(c.decoder_sparse_step or 1), set(c.mlp_only_layers or [])
    sparse = [c.num_experts > 0 and i not in dense and (i + 1) % step == 0
              for i in range(c.num_hidden_layers)]
    mixer = {v: k for k, v in MIXERS.items()}
    pattern = "".join(mixer[k] + (MOE if s else MLP) for k, s in zip(kinds, sparse))
    heads = c.num_attention_heads
    out = {
        "num_layers": len(pattern), "hybrid_layer_pattern": pattern, "hidden_size": c.hidden_size,
        "num_attention_heads": heads, "num_query_groups": c.num_key_value_heads or heads,
        "kv_channels": int(c.head_dim), "ffn_hidden_size": int(c.intermediate_size),
        "seq_length": c.max_position_embeddings, "swiglu": True, "normalization": "RMSNorm",
        "layernorm_epsilon": float(c.rms_norm_eps), "layernorm_zero_centered_gamma": True,
        "add_bias_linear": False, "add_qkv_bias": False, "qk_layernorm": True,
        "attention_output_gate": ATTENTION in pattern, "position_embedding_type": "rope",
        "rotary_base": int(theta), "rope_scaling": False,
        "rotary_percent": float(rope.get("partial_rotary_factor",
                                         getattr(c, "partial_rotary_factor", 1.0)) or 1.0),
        "share_embeddings_and_output_weights": bool(c.tie_word_embeddings),
        "mtp_num_layers": None,
        **{f: int(getattr(c, f)) for f in ("linear_conv_kernel_dim", "linear_key_head_dim",
                                           "linear_value_head_dim", "linear_num_key_heads",
                                           "linear_num_value_heads")},
    }
    if MOE in pattern:
        out.update(_moe_fields(c))
    return out


def _moe_fields(c) -> dict:
    experts, topk = int(c.num_experts), int(c.num_experts_per_tok)
    if not 1 <= topk <= experts:
        raise _refuse("num_experts_per_tok", topk, f"between 1 and the {experts} experts")
    pre_softmax = not bool(c.norm_topk_prob)
    if topk == 1 and not pre_softmax:
        raise _refuse("norm_topk_prob", True, "top-1 routing with renormalised weights: "
                                              "megatron requires moe_router_pre_softmax at "
                                              "top-1, which does not renormalise (only false)")
    if not c.shared_expert_intermediate_size:
        raise _refuse("shared_expert_intermediate_size", c.shared_expert_intermediate_size,
                      "a width >= 1 (megatron's moe_shared_expert_intermediate_size; a shared "
                      "expert of width 0 is no MLP)")
    return {"num_moe_experts": experts, "moe_router_topk": topk,
            "moe_router_pre_softmax": pre_softmax,
            "moe_ffn_hidden_size": int(c.moe_intermediate_size),
            "moe_shared_expert_intermediate_size": int(c.shared_expert_intermediate_size),
            "moe_shared_expert_gate": True,
            "moe_aux_loss_coeff": float(getattr(c, "router_aux_loss_coef", 0.0) or 0.0)}


def left_out(names) -> list:
    """The weight names an import leaves out: the Hub's multi-token prediction weights
    (``mtp.*``; transformers' ``Qwen3NextPreTrainedModel`` ignores them on load)."""
    return sorted(n for n in names if n.startswith(MTP_PREFIX))
