"""The families' two-way Hugging Face weight tables (ckpt/hf/mapping.py, recipes/families/*/
hf_table.py) at a tiny size, without a world: the names and shapes they give are those of
transformers' own model classes (held and saved), and the export's state dict read back through
the import's plan gives the megatron tensors again (and the other way round)."""

from __future__ import annotations

import pytest
import torch

from ckpt import families
from ckpt.hf import mapping

VOCAB, HIDDEN, HEADS, LAYERS, POSITIONS = 40, 16, 4, 2, 8
PAD = 3  # megatron's padded vocabulary rows, not exported

# model_type: (transformers config class, its tiny settings, the sizes they give). head_dim 8
# with 4 heads of a hidden size of 16: an explicit kv_channels.
ARCHS = {
    "gpt2": ("GPT2Config", dict(n_layer=LAYERS, n_embd=HIDDEN, n_head=HEADS, vocab_size=VOCAB,
                                n_positions=POSITIONS, n_inner=24),
             dict(ffn=24, groups=HEADS, head_dim=HIDDEN // HEADS)),
    "llama": ("LlamaConfig", dict(num_key_value_heads=2, head_dim=8, intermediate_size=24),
              dict(ffn=24, groups=2, head_dim=8)),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2, intermediate_size=24),
              dict(ffn=24, groups=2, head_dim=HIDDEN // HEADS)),
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=8, intermediate_size=24),
              dict(ffn=24, groups=2, head_dim=8)),
    "mixtral": ("MixtralConfig", dict(num_key_value_heads=2, head_dim=8, intermediate_size=12,
                                      num_local_experts=3, num_experts_per_tok=2),
                dict(ffn=12, groups=2, head_dim=8, experts=3, expert_ffn=12)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_key_value_heads=2, head_dim=8,
                                         intermediate_size=24, moe_intermediate_size=12,
                                         num_experts=3, num_experts_per_tok=2),
                  dict(ffn=24, groups=2, head_dim=8, experts=3, expert_ffn=12)),
}
LLAMA_COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                    num_attention_heads=HEADS, max_position_embeddings=POSITIONS)
CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
           "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
           "qwen3_moe": "Qwen3MoeForCausalLM"}
CASES = [(kind, tied) for kind in ARCHS for tied in (True, False)]


def _setup(kind: str, tied: bool):
    """(transformers config, model dict, table, prefix, sizes) of the tiny ``kind`` model."""
    import transformers

    cls, settings, size = ARCHS[kind]
    settings = settings if kind == "gpt2" else {**LLAMA_COMMON, **settings}
    config = getattr(transformers, cls)(tie_word_embeddings=tied, **settings)
    imports = families.for_model_type(kind).imports
    m = imports.fields(config)
    size = {"layers": LAYERS, "hidden": HIDDEN, "heads": HEADS, "vocab": VOCAB,
            "positions": POSITIONS, **size}
    return config, m, imports.table(m), imports.prefixes[0], size


def _expand(sizes: dict, size: dict) -> dict:
    """``{name: shape}`` of every layer's and expert's tensor of :func:`mapping.sizes`."""
    return {name.format(i=i, e=e): mapping.shape(dims, size)
            for name, dims in sizes.items()
            for i in (range(LAYERS) if "{i}" in name else (0,))
            for e in (range(size.get("experts", 1)) if "{e}" in name else (0,))}


@pytest.mark.parametrize("kind,tied", CASES)
def test_names_and_shapes_are_transformers(kind, tied, tmp_path):
    """The loaded names are the state dict of transformers' class (its ``lm_head`` too unless
    tied: then the export ties it), the saved ones those ``save_pretrained`` writes; each of
    the table's shapes is that tensor's."""
    import transformers
    from safetensors import safe_open

    config, m, table, prefix, size = _setup(kind, tied)
    model = getattr(transformers, CLASSES[kind])(config)
    held = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert "lm_head.weight" in held and m["share_embeddings_and_output_weights"] == tied
    if tied:
        held.pop("lm_head.weight")
    assert _expand(mapping.sizes(table, prefix, loaded=True), size) == held
    model.save_pretrained(tmp_path, safe_serialization=True)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert _expand(mapping.sizes(table, prefix), size) == saved


def _megatron(table, m: dict, size: dict, gen) -> dict:
    """Random megatron tensors of ``table`` (per-layer ones stacked, vocabulary rows padded by
    :data:`PAD`), shaped as each entry's to_megatron makes them of its HF tensors."""
    out = {}
    for e in table:
        count = size["experts"] if isinstance(e, mapping.Experts) else 1
        meta = [torch.empty(mapping.shape(d, size), device="meta")
                for _ in range(count) for d in e.dims]
        shape = tuple(e.to_megatron(meta, m).shape)
        shape = (shape[0] + PAD, *shape[1:]) if e.vocab else shape
        out[e.megatron] = torch.randn(((LAYERS,) if e.per_layer else ()) + shape, generator=gen)
    return out


def _imported(table, m: dict, prefix: str, hf: dict, loaded: bool) -> dict:
    """The megatron tensors the import's plan (or, ``loaded``, the loaded names) makes of
    ``hf``, per-layer ones stacked."""
    if not loaded:
        steps = [(key, names, per_layer, fn) for key, names, per_layer, fn
                 in mapping.plan(table, m, prefix)]
    else:
        steps = [(e.megatron, [prefix + n if e.prefixed else n for n in e.names(m, True)],
                  e.per_layer, lambda t, e=e: e.to_megatron(t, m, loaded=True)) for e in table]
    out = {}
    for key, names, per_layer, fn in steps:
        layers = range(LAYERS) if per_layer else (None,)
        made = [fn([hf[n.format(i=i)] for n in names]) for i in layers]
        out[key] = torch.stack(made) if per_layer else made[0]
    return out


@pytest.mark.parametrize("kind,tied", CASES)
@pytest.mark.parametrize("loaded", [False, True])
def test_export_then_import_is_the_identity(kind, tied, loaded):
    """megatron -> HF (the export's state dict) -> megatron (the import's plan) gives the same
    tensors (the vocabulary rows without megatron's padding), and HF -> megatron -> HF the same
    HF tensors, exactly."""
    _, m, table, prefix, size = _setup(kind, tied)
    gen = torch.Generator().manual_seed(0)
    tensors = _megatron(table, m, size, gen)
    hf = mapping.state_dict(table, tensors, m, VOCAB, prefix, loaded=loaded)
    assert {k: tuple(v.shape) for k, v in hf.items()} == _expand(
        mapping.sizes(table, prefix, loaded), size)
    back = _imported(table, m, prefix, hf, loaded)
    assert back.keys() == tensors.keys()
    vocab = {e.megatron for e in table if e.vocab}
    for key, t in tensors.items():
        assert torch.equal(back[key], t[:VOCAB] if key in vocab else t), key
    hf2 = {k: torch.randn(v.shape, generator=gen) for k, v in hf.items()}
    again = mapping.state_dict(table, _imported(table, m, prefix, hf2, loaded), m, VOCAB, prefix,
                               loaded=loaded)
    assert again.keys() == hf2.keys()
    for name, t in hf2.items():
        assert torch.equal(again[name], t), name


class _Headers:
    """A stand-in for :class:`ckpt.hf.hf_weights.Weights`: the safetensors headers
    ``{name: shape}`` only; a lookup of more names than a tiny model has fails the test (a
    count the weights do not confirm is being counted through)."""

    class _Names(set):
        def __contains__(self, name):
            self.asked = getattr(self, "asked", 0) + 1
            assert self.asked < 10_000, "names looked up past the model's tensors"
            return super().__contains__(name)

    def __init__(self, shapes: dict):
        self.shapes = shapes

    def names(self):
        return self._Names(self.shapes)

    def meta(self, name):
        return self.shapes[name], torch.float32


def _check_sizes(kind: str, headers: dict, **changed):
    """:func:`ckpt.hf.hf_weights.check_sizes` of the tiny ``kind`` model's ``headers`` with the
    ``model`` fields ``changed`` (as a config.json claiming them gives them)."""
    from ckpt.hf.hf_weights import check_sizes

    _, m, _, prefix, _ = _setup(kind, False)
    check_sizes(families.for_model_type(kind).imports, {**m, **changed}, VOCAB,
                _Headers(headers), prefix)


def _headers(kind: str) -> dict:
    _, _, table, prefix, size = _setup(kind, False)
    return _expand(mapping.sizes(table, prefix), size)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_head_width_other_than_the_weights_names_head_dim(kind):
    """A config.json ``head_dim`` (kv_channels) the q/k/v rows disagree with is named with the
    heads it multiplies: ``num_attention_heads=4 x head_dim=6``, not the heads alone."""
    from ckpt.hf.hf_weights import HFImportError

    _check_sizes(kind, _headers(kind))  # the headers as they are pass
    with pytest.raises(HFImportError, match=r"config.json num_attention_heads=4 x head_dim=6: "
                       r"tensor 'model.layers.0.self_attn.q_proj.weight' has shape \(32, 16\), "
                       r"the config implies \(24, 16\)"):
        _check_sizes(kind, _headers(kind), kv_channels=6)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_a_missing_router_is_named_before_a_crafted_expert_count_is_counted(kind):
    """No router (the tensor whose rows confirm the expert count) and a config.json claiming
    10**12 experts: the missing router is named at once, no expert name made of the count (the
    stand-in fails the test past 10,000 name look-ups)."""
    from ckpt.hf.hf_weights import HFImportError

    headers = {n: s for n, s in _headers(kind).items() if not n.endswith("gate.weight")}
    with pytest.raises(HFImportError, match=r"the weights lack tensor 'model\.layers\.0\.\w+\."
                       r"gate\.weight' \(needed for megatron's decoder\.layers\.mlp\.router"):
        _check_sizes(kind, headers, num_moe_experts=10**12)


def test_a_tensor_of_more_dims_names_no_config_field():
    """A norm weight ``[16, 1]`` where ``[16]`` is due: every size agrees, so the refusal
    blames no config.json field (it named ``hidden_size=16``, a size the tensor agrees with)."""
    from ckpt.hf.hf_weights import HFImportError

    headers = _headers("llama")
    headers["model.norm.weight"] = (HIDDEN, 1)
    with pytest.raises(HFImportError, match=r"^tensor 'model\.norm\.weight' has shape \(16, 1\), "
                       r"a 1-dim tensor \(16,\) expected$"):
        _check_sizes("llama", headers)
