"""The hybrid family's formats as ``ckpt/`` reads and writes them (given to it
by :mod:`recipes.families.formats`): the export to
transformers' ``NemotronHForCausalLM`` (Mamba, attention and MLP layers), and both ways with
``Qwen3NextForCausalLM`` (GatedDeltaNet or gated attention, then MoE or MLP:
:mod:`recipes.families.hybrid.hf_qwen3_next`). Which class: a pattern of ``M``, ``*``, ``-``
without gated attention and zero-centred norms is NemotronH's, any other Qwen3-Next's (each
refuses what it does not compute, named).

megatron's ``HybridModel`` (the family's local stack spec) and NemotronH compute the same
function: a pre-norm residual block per layer symbol (``M`` -> ``linear_attention``, NemotronH's
Mamba-2 mixer; ``*`` -> ``full_attention``, attention without position embedding; ``-`` ->
``mlp``, a non-gated MLP), RMSNorm everywhere and a final ``norm_f``. transformers'
``Mamba2ForCausalLM`` holds Mamba layers only; NemotronH holds every pattern, so it is the
one class exported to (transformers 5.25 runs some patterns only without its cache:
:func:`cache_works`). The checkpoint's tensors map as:

* ``in_proj.weight.{z,x,B,C,dt}`` (logical, as megatron's ``MambaMixer.sharded_state_dict``
  splits them) -> ``in_proj.weight`` rows ``z | x | B | C | dt``;
* ``conv1d.{weight,bias}.{x,B,C}`` -> ``conv1d.{weight,bias}`` rows ``x | B | C``;
* ``A_log``, ``D``, ``dt_bias``, the gated norm's ``norm.weight``, ``out_proj.weight`` as they
  are; each layer's norm (``norm``, ``input_layernorm`` or ``pre_mlp_layernorm``) ->
  ``layers.<i>.norm``;
* the fused QKV split per query group (:func:`ckpt.hf.mapping.split_qkv`),
  ``linear_proj`` -> ``o_proj``, ``linear_fc1`` / ``linear_fc2`` -> ``up_proj`` / ``down_proj``.

A stock-format (0.19.2) checkpoint holds the same keys: megatron gathers ``in_proj``'s GTP
shards and drops their padding before it splits it (:data:`STORED_LOGICAL`), and pads
``out_proj`` like the GPT family's ``linear_proj`` (:data:`GTP_PATTERNS`); the attention and MLP
layers' weights are the GPT family's names, which its patterns cover. So the stock reader
(:mod:`ckpt.stock`) reads its model weights, and it exports the same way.

No megatron or Hydra at import (the ``gtp`` command line loads it); the parameter sizes come
from the family's table (``params.mamba_dims``).
"""

from __future__ import annotations

import re
from typing import Any

from ckpt.families import ExportError, FamilyFormats, HFArchitecture, HFImport
from ckpt.hf.mapping import split_qkv
from recipes.families.hybrid import hf_qwen3_next
from recipes.families.hybrid.model import ATTENTION, GDN, GDN_FIELDS, MAMBA, MLP, MTP
from recipes.families.hybrid.params import mamba_dims

# The fields that size stored tensors (ckpt.format.records.unbounded_size), with the pattern's
# length (the layers).
# GatedDeltaNet's (GDN_FIELDS) count only with G layers (their defaults size nothing otherwise).
SIZE_FIELDS = ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads")

# megatron-core 0.19.2's MambaMixer builds its gated RMSNorm with eps 1e-5 whatever the config
# says; NemotronH takes every norm's eps from layer_norm_epsilon.
MIXER_NORM_EPS = 1e-5
LAYER_TYPES = {MAMBA: "linear_attention", ATTENTION: "full_attention", MLP: "mlp"}
NO_CACHE_WHY = ("transformers 5.25's NemotronH cache reads its sequence length from layer 0 and "
                "its attention mask sizes from the first attention layer: a pattern that starts "
                "with an MLP layer ('-') or has no attention layer ('*') raises in model(ids) and "
                "generate() unless use_cache is false (the logits are the same without the "
                "cache; generation recomputes every position)")

# Mamba's and GatedDeltaNet's out_proj: row-parallel, its hidden rows GTP-sharded and padded,
# as linear_proj.
GTP_PATTERNS = ((re.compile(r"(^|\.)mixer\.out_proj\.weight$"), "proj"),
                (re.compile(r"(^|\.)self_attention\.out_proj\.weight$"), "proj"))
# Stored at their logical shape in both formats: Mamba's in_proj components (megatron gathers
# them over GTP), conv1d's (TP-split, never GTP), and A_log, D, dt_bias (per head, TP-split);
# GatedDeltaNet's in_proj and conv1d components, A_log and dt_bias (its stock format exists
# without GTP only: megatron-core 0.19.2 asserts on a GTP in_proj).
STORED_LOGICAL = (
    re.compile(r"(^|\.)mixer\.in_proj\.weight\.(z|x|B|C|dt)$"),
    re.compile(r"(^|\.)mixer\.conv1d\.(weight|bias)\.(x|B|C)$"),
    re.compile(r"(^|\.)mixer\.(A_log|D|dt_bias)$"),
    re.compile(r"(^|\.)self_attention\.in_proj\.weight\.(query|key|value|z|beta|alpha)$"),
    re.compile(r"(^|\.)self_attention\.conv1d\.(weight|bias)\.(query|key|value)$"),
    re.compile(r"(^|\.)self_attention\.(A_log|dt_bias)$"),
)


def architecture(model: dict) -> str | None:
    """``"nemotron_h"`` or ``"qwen3_next"`` for a hybrid ``model`` config dict (the module doc's
    rule), None for one without ``hybrid_layer_pattern``.

    Raises:
        ExportError: multi-token prediction layers (an MTP part after ``/``; their mapping to
            Qwen3-Next's ``mtp.*`` weights is not written), a setting Qwen3-Next does not compute
            (:func:`recipes.families.hybrid.hf_qwen3_next.check_export`), or one NemotronH does
            not compute (named with what it computes):
            normalization other than RMSNorm, linear biases, a position embedding, SwiGLU,
            q/k norms or QKV biases, ``layernorm_epsilon`` other than the mixer's 1e-5, a layer
            symbol other than ``M``, ``*``, ``-`` (GatedDeltaNet ``G`` included: NemotronH has no
            such layer).
    """
    pattern = model.get("hybrid_layer_pattern")
    if pattern is None:
        return None
    if MTP in pattern:
        raise ExportError(f"model.mtp_num_layers={model.get('mtp_num_layers')!r} "
                          f"(model.hybrid_layer_pattern={pattern!r}): a hybrid model's "
                          f"multi-token prediction layers are not exported (no mapping to "
                          f"Qwen3-Next's mtp.* weights here); export a model without them")
    if (any(s not in LAYER_TYPES for s in pattern) or model.get("attention_output_gate")
            or model.get("layernorm_zero_centered_gamma")):
        try:
            hf_qwen3_next.pairs(pattern)
        except ExportError:
            raise ExportError(
                f"model.hybrid_layer_pattern={pattern!r}: layer symbols {sorted(LAYER_TYPES)} are "
                f"exported to NemotronHForCausalLM (it has no GatedDeltaNet layer, no MoE "
                f"layer); Qwen3NextForCausalLM takes pairs of a token mixer ('G' or '*') and an "
                f"MLP ('E' or '-'), e.g. 'GEGEGE*E' (no Mamba layer)") from None
        hf_qwen3_next.check_export(model)
        return "qwen3_next"
    refusals = (  # the layers first: a model with other layers is refused for them
        (any(s not in LAYER_TYPES for s in pattern), "hybrid_layer_pattern",
         f"layer symbols {sorted(LAYER_TYPES)} are exported (NemotronH has no GatedDeltaNet "
         f"layer)"),
        (model.get("normalization", "LayerNorm") != "RMSNorm", "normalization",
         "NemotronH's norms are RMSNorm"),
        (model.get("add_bias_linear", True), "add_bias_linear",
         "this export writes no linear biases (attention, MLP or Mamba projections)"),
        (model.get("position_embedding_type", "learned_absolute") != "none",
         "position_embedding_type", "NemotronH's attention has no position embedding ('none')"),
        (model.get("swiglu", False), "swiglu", "NemotronH's MLP is not gated"),
        (model.get("qk_layernorm", False), "qk_layernorm", "NemotronH has no q/k norms"),
        (model.get("add_qkv_bias", False), "add_qkv_bias", "NemotronH has no QKV bias"),
        (float(model.get("layernorm_epsilon", 1e-5)) != MIXER_NORM_EPS, "layernorm_epsilon",
         "megatron's Mamba mixer norms with eps 1e-5 and NemotronH takes one eps for all"),
    )
    for refused, field, why in refusals:
        if field == "layernorm_epsilon" and MAMBA not in pattern:
            continue  # only the mixer's norm is fixed at 1e-5; NemotronH takes the model's eps
        if refused:
            raise ExportError(f"model.{field}={model.get(field)!r}: NemotronHForCausalLM does "
                              f"not compute this hybrid model exactly: {why}")
    return "nemotron_h"


def cache_works(pattern: str) -> bool:
    """Whether transformers 5.25's ``NemotronHModel`` runs ``pattern`` with its cache: layer 0 is
    not an MLP layer and some layer is attention (:data:`NO_CACHE_WHY`)."""
    return bool(pattern) and pattern[0] != MLP and ATTENTION in pattern


def notes(model: dict) -> dict:
    """What an export of the hybrid ``model`` config dict records beside the weights
    (``gtp_recipes_export.json``'s ``notes``): ``use_cache`` false, and why, for a pattern
    NemotronH runs only without its cache; {} otherwise."""
    pattern = model.get("hybrid_layer_pattern") or ""
    return {} if cache_works(pattern) else {"use_cache": False, "why": NO_CACHE_WHY}


def nemotron_h_build(t: dict, m: dict, vocab: int, ids: dict) -> tuple[Any, dict]:
    """(``NemotronHConfig``, state dict) of a hybrid model from its full logical tensors ``t``
    (megatron's keys ``decoder.layers.<i>....``, layer ``i`` numbered over the whole pattern),
    its recorded model config ``m``, the unpadded vocabulary size and the special token ids.

    A shared output layer is written as ``lm_head`` (a copy of the embedding's rows) with
    ``tie_word_embeddings`` false: transformers 5.25's NemotronH declares no tied weights.
    ``use_cache`` is false where :func:`cache_works` says the cache fails. The Mamba sizes are
    written only when the pattern has Mamba layers (NemotronH's defaults otherwise, unused);
    ``expand`` only when ``d_inner`` is a multiple of the hidden size (it is metadata: NemotronH
    sizes the mixer from ``mamba_num_heads * mamba_head_dim``).

    Raises:
        KeyError: a tensor the pattern needs is missing (named).
    """
    import torch
    from transformers import NemotronHConfig

    h, heads = m["hidden_size"], m["num_attention_heads"]
    groups = m.get("num_query_groups") or heads
    head_dim = m.get("kv_channels") or h // heads
    pattern = m["hybrid_layer_pattern"]
    mamba = {}
    if MAMBA in pattern:  # a pattern without Mamba layers may leave their sizes unset
        d = mamba_dims(m)
        mamba = dict(ssm_state_size=d["state"], mamba_num_heads=d["nheads"],
                     mamba_head_dim=d["head_dim"], n_groups=d["groups"],
                     chunk_size=int(m.get("mamba_chunk_size", 128)))
        if d["d_inner"] % h == 0:
            mamba["expand"] = d["d_inner"] // h
    eps = MIXER_NORM_EPS if MAMBA in pattern else float(m.get("layernorm_epsilon", 1e-5))
    act = ("gelu_pytorch_tanh" if m.get("openai_gelu") else "gelu")
    config = NemotronHConfig(
        vocab_size=vocab, hidden_size=h, layers_block_type=[LAYER_TYPES[s] for s in pattern],
        num_attention_heads=heads, num_key_value_heads=groups, head_dim=head_dim,
        max_position_embeddings=m["seq_length"], attention_bias=False,
        intermediate_size=m["ffn_hidden_size"], mlp_hidden_act=act, mlp_bias=False,
        conv_kernel=4, use_conv_bias=True, use_bias=False, mamba_proj_bias=False,
        layer_norm_epsilon=eps, residual_in_fp32=False, use_cache=cache_works(pattern),
        tie_word_embeddings=False, architectures=["NemotronHForCausalLM"], **mamba, **ids)
    sd = {"model.embeddings.weight": t["embedding.word_embeddings.weight"][:vocab],
          "model.norm_f.weight": t["decoder.final_norm.weight"]}
    out = ("embedding.word_embeddings.weight" if m.get("share_embeddings_and_output_weights")
           else "output_layer.weight")
    sd["lm_head.weight"] = t[out][:vocab]
    for i, symbol in enumerate(pattern):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        if symbol == MAMBA:
            mix = src + "mixer."
            sd.update({
                dst + "norm.weight": t[src + "norm.weight"],
                dst + "mixer.in_proj.weight": torch.cat(
                    [t[f"{mix}in_proj.weight.{c}"] for c in ("z", "x", "B", "C", "dt")]),
                dst + "mixer.conv1d.weight": torch.cat(
                    [t[f"{mix}conv1d.weight.{c}"] for c in ("x", "B", "C")]),
                dst + "mixer.conv1d.bias": torch.cat(
                    [t[f"{mix}conv1d.bias.{c}"] for c in ("x", "B", "C")]),
                **{dst + f"mixer.{n}": t[mix + n]
                   for n in ("dt_bias", "A_log", "D", "norm.weight", "out_proj.weight")},
            })
        elif symbol == ATTENTION:
            q, k, v = split_qkv(t[src + "self_attention.linear_qkv.weight"], heads, groups,
                                head_dim)
            sd.update({dst + "norm.weight": t[src + "input_layernorm.weight"],
                       dst + "mixer.q_proj.weight": q, dst + "mixer.k_proj.weight": k,
                       dst + "mixer.v_proj.weight": v,
                       dst + "mixer.o_proj.weight": t[src + "self_attention.linear_proj.weight"]})
        else:
            sd.update({dst + "norm.weight": t[src + "pre_mlp_layernorm.weight"],
                       dst + "mixer.up_proj.weight": t[src + "mlp.linear_fc1.weight"],
                       dst + "mixer.down_proj.weight": t[src + "mlp.linear_fc2.weight"]})
    return config, sd


NEMOTRON_H = HFArchitecture(model_type="nemotron_h", hf_class="NemotronHForCausalLM",
                            embedding="model.embeddings.weight", build=nemotron_h_build,
                            notes=notes)
QWEN3_NEXT = HFArchitecture(
    model_type="qwen3_next", hf_class="Qwen3NextForCausalLM",
    embedding="model.embed_tokens.weight", build=hf_qwen3_next.build, output_gate=True,
    imports=HFImport(fields=hf_qwen3_next.fields, table=hf_qwen3_next.table,
                     prefixes=("model.",), size_fields=hf_qwen3_next.SIZE_FIELDS,
                     layer=r"layers\.(\d+)\.", buffers=(".rotary_emb.inv_freq",),
                     sizes=hf_qwen3_next.sizes, left_out_names=hf_qwen3_next.left_out))

def sizes(model) -> list[tuple[str, object]]:
    """The Mamba sizes, the GatedDeltaNet sizes (with ``G`` layers) and the layer pattern's
    length of a hybrid ``model`` config dict (none without ``hybrid_layer_pattern``)."""
    pattern = model.get("hybrid_layer_pattern")
    if pattern is None:
        return []
    fields = SIZE_FIELDS + (GDN_FIELDS if isinstance(pattern, str) and GDN in pattern else ())
    out = [(f"model.{f}", model.get(f)) for f in fields]
    if isinstance(pattern, str):
        out.append(("the length of model.hybrid_layer_pattern", len(pattern)))
    return out


FORMATS = FamilyFormats(name="hybrid", architectures=(NEMOTRON_H, QWEN3_NEXT),
                        architecture=architecture,
                        gtp_patterns=GTP_PATTERNS, stored_logical=STORED_LOGICAL, sizes=sizes)
