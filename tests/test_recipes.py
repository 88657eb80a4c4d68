"""Model presets, named recipes (conf/experiment/) and the dry run; no processes are started."""

from __future__ import annotations

from pathlib import Path

import pytest
from compose import CONF, make_cfg

from recipes.families import parameter_shapes
from recipes.model.shapes import count
from recipes.config.validate import ConfigError, validate

EXPERIMENTS = sorted(p.stem for p in (Path(CONF) / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("preset, published", [
    ("llama3_8b", 8_030_261_248),   # Meta's Llama-3-8B model card (8.03B)
    ("llama3_70b", 70_553_706_496),  # Meta's Llama-3-70B (70.6B)
])
def test_full_size_presets_have_the_published_parameter_count(preset, published):
    cfg = make_cfg(f"model={preset}")
    # Llama-3's tokenizer: 128,256 tokens, a multiple of 128: no vocabulary padding.
    assert count(parameter_shapes(cfg.model, 128_256)) == published


def test_llama_presets_are_llama_shaped():
    for preset in ("llama_tiny", "llama3_8b", "llama3_70b"):
        m = make_cfg(f"model={preset}").model
        assert (m.normalization, m.position_embedding_type, m.swiglu, m.add_bias_linear,
                m.share_embeddings_and_output_weights) == ("RMSNorm", "rope", True, False, False)
        assert m.num_query_groups < m.num_attention_heads  # grouped-query attention
    tiny = make_cfg("model=llama_tiny").model
    assert tiny.hidden_size % 16 and tiny.ffn_hidden_size % 16
    names = [p.name for p in parameter_shapes(tiny, 320)]
    assert not [n for n in names if n.endswith(".bias")]  # RMSNorm, no linear biases
    assert "embedding.position_embeddings.weight" not in names  # RoPE


def test_qkv_rows_of_grouped_query_attention():
    m = make_cfg("model=llama_tiny").model  # 6 heads of 12 channels, 2 K/V groups
    qkv = {p.name: p.shape for p in parameter_shapes(m, 320)}[
        "decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv == ((6 + 2 * 2) * 12, 72)


def test_num_query_groups_not_divisible_by_tp_is_refused_before_launch():
    cfg = make_cfg("model=llama_tiny", "parallelism=tp4")
    with pytest.raises(ConfigError, match=r"model.num_query_groups=2 must be divisible by "
                                          r"tensor_model_parallel_size=4.*\[1, 2\]"):
        validate(cfg, 4)
    with pytest.raises(ConfigError, match="num_query_groups=4 must divide"):
        validate(make_cfg("model=llama_tiny", "model.num_query_groups=4"), 2)


def test_there_are_named_recipes():
    assert {"llama3_8b_tp4_gtp2_fp8", "cpu_llama_resume", "cpu_alignment_sweep"} <= set(EXPERIMENTS)


# Every recipe's dry run through the launcher: tests/test_dry_run.py
# (test_every_named_recipe_fits_its_own_target).


def test_dry_run_of_llama3_8b_at_tp4_gtp2(capsys):
    """Per-rank figures checked against a hand count: tp4 splits the vocabulary, QKV and fc1
    rows and the proj/fc2 columns; GTP (g2, rows padded to a multiple of 16 * 2) halves the
    TP-local rows of every weight; norms are whole on every rank."""
    from recipes.run.launch import run

    run(make_cfg("experiment=llama3_8b_tp4_gtp2_fp8", "train.dry_run=true"))
    out = capsys.readouterr().out
    vocab = 128256 // 4 // 2  # 32064 TP-local rows, a multiple of 32: no padding
    layer = (6144 // 4 // 2 * 4096        # linear_qkv: (32 + 2 * 8) * 128 rows
             + 4096 // 2 * (4096 // 4)    # linear_proj: TP splits dim 1
             + 2 * 14336 // 4 // 2 * 4096  # linear_fc1: gate and up
             + 4096 // 2 * (14336 // 4)   # linear_fc2
             + 2 * 4096)                  # input / pre-MLP RMSNorm
    per_rank = 2 * vocab * 4096 + 32 * layer + 4096
    assert f"> per rank: {per_rank:,} parameters" in out, out
    assert "8,030,261,248 parameters" in out and "tp4 x gtp2(pad 16) x dp1 (world 8)" in out, out
    # bf16 params, fp32 grads, Adam + fp32 main params: 2 + 4 + 12 bytes per parameter.
    assert f"{per_rank:,} parameters, 18 bytes each" in out, out
    assert f"optimizer state  {per_rank * 12 / 2**30:.2f} GiB" in out, out
    assert "0 padding rows" in out, out


def test_dry_run_counts_gtp_padding_rows(capsys):
    from recipes.run.launch import run

    # llama_tiny at tp1 x g2/a16: TP-local rows 320 (vocab), 120 (QKV), 72 (proj), 400 (fc1),
    # 72 (fc2), padded to multiples of 32: 0 + 8 + 24 + 16 + 24 per layer, two layers.
    run(make_cfg("model=llama_tiny", "gtp=tp2_align16", "train.dry_run=true"))
    out = capsys.readouterr().out
    assert f"{2 * (8 + 24 + 16 + 24)} padding rows" in out, out
