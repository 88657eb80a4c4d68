"""The ``gtp`` config group and GTP pre-launch validation (Hydra compose API, no processes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from compose import CONF, make_cfg

from recipes.families import gtp_weight_dims
from recipes.config.validate import ConfigError, validate

REPO = Path(__file__).resolve().parents[1]


# option -> (processes it needs, gtp_remat_size, resolved pad_for_alignment, quantization)
OPTIONS = {
    "off": (2, 1, 0, "none"),
    "tp2_align1": (2, 2, 1, "none"),
    "tp2_align16": (2, 2, 16, "none"),
    "tp2_align32": (2, 2, 32, "none"),
    "tp4_align32": (4, 4, 32, "none"),
    "tp2_fp8": (2, 2, 16, "fp8"),
    "tp2_mxfp8": (2, 2, 32, "mxfp8"),
    "tp2_nvfp4": (2, 2, 16, "nvfp4"),
}


def test_every_gtp_option_is_listed_here():
    assert sorted(p.stem for p in Path(CONF, "gtp").glob("*.yaml")) == sorted(OPTIONS)


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_gtp_option_resolves_to_its_layout(option):
    world, g, pad, quant = OPTIONS[option]
    cfg = make_cfg(f"gtp={option}", f"parallelism.nproc_per_node={world}")
    assert (cfg.gtp.name, cfg.gtp.gtp_remat_size, cfg.gtp.quantization) == (option, g, quant)
    parallel_dims = validate(cfg, world)
    assert (parallel_dims.world_size, parallel_dims.tensor_model_parallel_size,
            parallel_dims.gtp_remat_size, parallel_dims.data_parallel_size,
            parallel_dims.pad_for_alignment) == (world, 1, g, world // g, pad)


def test_tp2_align16_runs_on_the_default_two_processes():
    cfg = make_cfg("gtp=tp2_align16")
    parallel_dims = validate(cfg, cfg.parallelism.nproc_per_node)
    assert parallel_dims.describe() == "tp1 x gtp2(pad 16) x dp1 (world 2)"


def test_gtp_with_tensor_parallelism():
    parallel_dims = validate(make_cfg("gtp=tp2_align16", "parallelism=tp2dp2"), 4)
    assert parallel_dims.describe() == "tp2 x gtp2(pad 16) x dp1 (world 4)"


@pytest.mark.parametrize("quant, explicit, want", [
    ("none", None, 1), ("fp8", None, 16), ("mxfp8", None, 32), ("nvfp4", None, 16),
    ("mxfp8", 1, 1), ("none", 0, 0), ("none", 128, 128),
])
def test_explicit_alignment_wins_over_the_recipe_default(quant, explicit, want):
    value = "null" if explicit is None else explicit
    cfg = make_cfg("gtp=tp2_align16", f"gtp.quantization={quant}", f"gtp.pad_for_alignment={value}")
    assert validate(cfg, 2).pad_for_alignment == want


@pytest.mark.parametrize("overrides, world, message", [
    # gtp_remat_size that does not divide the world size: the fix is named.
    (["gtp=tp4_align32"], 2, r"world size 2 is not divisible by .*gtp_remat_size=4 = 4.*"
                             r"parallelism.nproc_per_node=4"),
    (["gtp=tp2_align16", "parallelism=tp2"], 2, r"gtp_remat_size=2 = 4.*nproc_per_node=4"),
    (["gtp.gtp_remat_size=0"], 2, r"gtp.gtp_remat_size=0 is invalid"),
    # Negative alignment, with GTP on and off.
    (["gtp=tp2_align16", "gtp.pad_for_alignment=-16"], 2, r"gtp.pad_for_alignment=-16 is invalid"),
    (["gtp.pad_for_alignment=-1"], 2, r"gtp.pad_for_alignment=-1 is invalid"),
    # Unknown quantization recipe.
    (["gtp=tp2_align16", "gtp.quantization=fp16"], 2,
     r"gtp.quantization='fp16' is invalid.*\['fp8', 'mxfp8', 'none', 'nvfp4'\]"),
    # pad 0 with a TP-local dim 0 that gtp_remat_size does not divide: fc1 at tp2 has 99 rows.
    (["gtp=tp2_align16", "gtp.pad_for_alignment=0", "parallelism=tp2dp2",
      "model.ffn_hidden_size=198"], 4,
     r"gtp.pad_for_alignment=0 with gtp_remat_size=2 at tensor_model_parallel_size=2: "
     r"linear_fc1 dim 0 = 99 .*Use pad_for_alignment >= 1"),
    # g=3: fc1 (200 rows) and the vocab (320) do not divide; proj/fc2 (72) and qkv (216) do.
    (["gtp.gtp_remat_size=3", "gtp.pad_for_alignment=0", "data.global_batch_size=24"], 3,
     r": linear_fc1 dim 0 = 200, output_layer dim 0 = 320, word_embeddings dim 0 = 320 "
     r"\(TP-local rows\) not divisible by 3"),
    # The vocab rows: 320 padded rows / tp2 = 160, not divisible by 3.
    (["gtp.gtp_remat_size=3", "gtp.pad_for_alignment=0", "parallelism=tp2",
      "model.ffn_hidden_size=210", "model.num_attention_heads=6", "data.global_batch_size=24"], 6,
     r"output_layer dim 0 = 160, word_embeddings dim 0 = 160 \(TP-local rows\)"),
    # The global batch is split over dp x gtp_remat_size, not dp alone.
    (["gtp=tp2_align16", "data.global_batch_size=12"], 2,
     r"global_batch_size=12 must be a multiple of .*data group size 2 \(dp 1 x gtp_remat_size 2"),
])
def test_bad_gtp_input_is_refused_before_launch(overrides, world, message):
    with pytest.raises(ConfigError, match=message):
        validate(make_cfg(*overrides), world)


def test_pad_zero_is_fine_when_every_dim_divides():
    parallel_dims = validate(
        make_cfg("gtp=tp2_align16", "gtp.pad_for_alignment=0", "model=tiny_swiglu"), 2)
    assert parallel_dims.pad_for_alignment == 0


def test_gtp_weight_dims_follow_megatrons_wrapped_weights():
    # Tiny at tp2: qkv 3*72/2, fc1 200/2 (x2 with SwiGLU), proj/fc2 keep 72 rows (row-parallel),
    # vocab 257 -> 320 padded rows / 2. The built model is checked against this table in every
    # GTP run (recipes.model.gtp_setup.after_model; see test_gtp_e2e).
    dims = gtp_weight_dims(make_cfg("model=tiny_swiglu"), 2)
    assert dims == {
        "embedding.word_embeddings.weight": 160,
        **{f"decoder.layers.{i}.{k}": v for i in range(2) for k, v in (
            ("self_attention.linear_qkv.weight", 108), ("self_attention.linear_proj.weight", 72),
            ("mlp.linear_fc1.weight", 200), ("mlp.linear_fc2.weight", 72))},
        "output_layer.weight": 160,
    }
    shared = gtp_weight_dims(make_cfg("model.share_embeddings_and_output_weights=true"), 1)
    assert "output_layer.weight" not in shared and shared["embedding.word_embeddings.weight"] == 320


def test_quantized_recipe_says_it_only_sets_alignment(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    validate(make_cfg("gtp=tp2_mxfp8"), 2)
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    assert "gtp.quantization=mxfp8 only sets the GTP alignment (pad_for_alignment=32)" in out
    assert "nothing is quantized" in out
    validate(make_cfg("gtp=tp2_fp8", "gtp.pad_for_alignment=1"), 2)
    assert "has no effect: gtp.pad_for_alignment=1 is explicit" in capsys.readouterr().out
    validate(make_cfg("gtp=tp2_align16"), 2)
    assert capsys.readouterr().out == ""
    # Workers (any rank but 0 here) stay quiet: the launching process already said it.
    monkeypatch.setenv("RANK", "1")
    validate(make_cfg("gtp=tp2_mxfp8"), 2)
    assert capsys.readouterr().out == ""


def test_train_py_stops_before_launch_with_a_clear_error(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "gtp=tp4_align32", "logger=none",
         f"hydra.run.dir={tmp_path}", f"data.cache_dir={tmp_path}/cache"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 2, proc.stdout[-3000:]
    assert "error: world size 2 is not divisible" in proc.stdout
    assert "parallelism.nproc_per_node=4" in proc.stdout
    assert "> layout" not in proc.stdout and not (tmp_path / "metrics.jsonl").exists()
