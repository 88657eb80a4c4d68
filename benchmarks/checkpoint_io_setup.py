"""The checkpoint benchmark's cases and run configs (``benchmarks.checkpoint_io``): the source,
padded-source, control and target layouts, the printed targets, and the Hydra composition of
one launch (also used by ``benchmarks.checkpoint_verify``)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# model -> config overrides ({dp} is filled in): one micro-batch per rank, seq 64.
MODELS: dict[str, list[str]] = {
    "gpt125m": ["model=gpt125m", "model.seq_length=64", "data=mock", "data.micro_batch_size=1",
                "data.global_batch_size={dp}"],
    "tiny": ["model=tiny", "data=mock", "data.micro_batch_size=1", "data.global_batch_size={dp}"],
}
# name -> (tp, gtp degree, pad_for_alignment, world size)
SOURCE = ("tp2_g2a16", (2, 2, 16, 4))
# The same save at an alignment that pads every GTP weight of gpt125m (its TP-local dims 1152,
# 768, 1536 and 160 are multiples of 32, so a16 adds no padding row): the logical format then
# writes trimmed views of the padded shards.
PADDED_SOURCE = ("tp2_g2a40", (2, 2, 40, 4))
# Control for the load to tp1 without GTP: a checkpoint saved at tp2 without GTP (world 2), whose
# load at tp1 is megatron's own cross-TP resharding, no gtp/ code on either side.
CONTROL = ("tp2_off", (2, 1, None, 2))
TARGETS: dict[str, tuple[int, int, int | None, int]] = {
    "tp1_off": (1, 1, None, 1),
    "tp1_g4a32": (1, 4, 32, 4),
}
RAW_BLOCK = 8 << 20

TARGET_SAVE_RATIO = 1.02
TARGET_PEAK_RATIO = 1.02
TARGET_SAME_LOAD_RATIO = 1.02
# extra RSS of a same-layout load of the logical file over the stock file's, as a fraction of the
# checkpoint's bytes per rank
TARGET_SAME_LOAD_EXTRA_MEMORY = 0.02
# cross-layout / same-layout load: at most this, or no worse than megatron's own cross-TP control
TARGET_LOAD_RATIO = 1.15
TARGET_THROUGHPUT_FRACTION = 0.5
# training time lost to an asynchronous save (checkpoint.async_save) / the synchronous save's time
TARGET_ASYNC_LOST_RATIO = 0.2
# Training steps run after each save of [4]'s cost measurement: enough to outlast an async
# save's write (the figures: benchmarks/README.md).
TRAIN_STEPS = 2


def describe(tp: int, g: int, pad) -> str:
    """``tp2 x g2/a16`` or ``tp1, gtp off``: a case's layout as the tables name it."""
    return f"tp{tp}" + (f" x g{g}/a{pad}" if g > 1 else ", gtp off")


def compose_config(model: str, tp: int, g: int, pad, world: int, run_dir: Path, cache: Path,
                   bench: dict):
    """The resolved run config of one launch (Hydra compose, as train.py builds it)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from recipes.config.schema import register_configs

    register_configs()
    dp = world // tp  # the data-loading group is dp x gtp: every GTP peer reads its own batch
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[
            *(o.format(dp=dp) for o in MODELS[model]),
            "gtp=off" if g == 1 else "gtp=tp2_align16",
            f"gtp.gtp_remat_size={g}", f"gtp.pad_for_alignment={'null' if pad is None else pad}",
            "checkpoint.format=logical",
            "parallelism=tp1", f"parallelism.tensor_model_parallel_size={tp}",
            f"parallelism.nproc_per_node={world}",
            "checkpoint=none", "logger=none", f"output_dir={run_dir}",
            f"data.cache_dir={cache}", "train.train_iters=10", "optim.lr_warmup_iters=0",
        ])
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain["bench"] = bench
    return OmegaConf.create(plain)

