"""The GPT family's formats as ``ckpt/`` reads and writes them (given to it by
:mod:`recipes.families.formats`): GPT-2 and Llama (also Mistral, Qwen2 and
Qwen3: Llama architectures of other names) to and from Hugging Face
(:mod:`recipes.families.gpt.hf_import`, :mod:`recipes.families.gpt.hf_export`; the weight names
both ways: :mod:`recipes.families.gpt.hf_table`) and the names of the weights GTP shards in a
stock-format checkpoint.

Cheap to import (no megatron, no Hydra, no torch): the ``gtp`` command line loads it.
"""

from __future__ import annotations

import re

from ckpt.families import FamilyFormats, HFArchitecture, HFImport
from ckpt.hf.mapping import builder
from recipes.families.gpt import hf_export, hf_import, hf_table

# GTP-sharded weights of megatron's GPT model (local spec): kind per key pattern. The MoE
# family's experts and attention carry the same names, so these cover it too.
GTP_PATTERNS = (
    (re.compile(r"(^|\.)embedding\.word_embeddings\.weight$"), "vocab"),
    (re.compile(r"(^|\.)output_layer\.weight$"), "vocab"),
    (re.compile(r"(^|\.)linear_qkv\.weight$"), "qkv"),
    (re.compile(r"(^|\.)linear_proj\.weight$"), "proj"),
    (re.compile(r"(^|\.)linear_fc1\.weight(_w|_v)?$"), "fc1"),
    (re.compile(r"(^|\.)linear_fc2\.weight$"), "fc2"),
    # A multi-token prediction layer's [embedding; hidden] -> hidden projection (column-parallel,
    # hidden rows); its transformer layer's linears match the patterns above.
    (re.compile(r"(^|\.)eh_proj\.weight$"), "eh_proj"),
)

GPT2 = HFArchitecture(
    model_type="gpt2", hf_class="GPT2LMHeadModel", embedding="transformer.wte.weight",
    build=builder(hf_export.gpt2_config, hf_table.gpt2, "transformer."),
    imports=HFImport(
        fields=hf_import.gpt2_fields, table=hf_table.gpt2,
        prefixes=("transformer.", ""),  # "": a GPT2Model saved on its own
        size_fields=hf_import.GPT2_SIZE_FIELDS, layer=r"h\.(\d+)\.",
        buffers=(".attn.bias", ".attn.masked_bias")))  # older checkpoints saved the masks

# Llama and the Llama architectures of other names (hf_import.llama_fields tells them apart).
LLAMA_IMPORT = HFImport(
    fields=hf_import.llama_fields, table=hf_table.llama, prefixes=("model.",),
    size_fields=hf_import.LLAMA_SIZE_FIELDS, layer=r"layers\.(\d+)\.",
    buffers=(".rotary_emb.inv_freq",))
LLAMAS = tuple(
    HFArchitecture(model_type=kind, hf_class=cls, embedding="model.embed_tokens.weight",
                   build=builder(hf_export.llama_config, hf_table.llama, "model."),
                   imports=LLAMA_IMPORT)
    for kind, cls in (("llama", "LlamaForCausalLM"), ("mistral", "MistralForCausalLM"),
                      ("qwen2", "Qwen2ForCausalLM"), ("qwen3", "Qwen3ForCausalLM")))

FORMATS = FamilyFormats(name="gpt", architectures=(GPT2, *LLAMAS),
                        architecture=hf_export.architecture, gtp_patterns=GTP_PATTERNS)
