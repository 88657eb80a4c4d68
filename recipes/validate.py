"""Check a composed config before any process starts.

Every error names the bad value and what would be valid. :func:`validate` runs in ``train.py``
(one process, before launch) and again in each worker (cheap, guards direct ``torchrun`` use).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


class ConfigError(ValueError):
    """A config value that cannot work; the message says which and what is valid."""


@dataclass(frozen=True)
class Layout:
    """The process layout a run uses (and a checkpoint records).

    world_size = tensor_model_parallel_size * pipeline_model_parallel_size * gtp_remat_size *
    data_parallel_size (megatron's ``initialize_model_parallel`` order).
    """

    world_size: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    gtp_remat_size: int
    data_parallel_size: int
    pad_for_alignment: int

    def describe(self) -> str:
        """A short human-readable form, e.g. ``tp2 x gtp2(pad 16) x dp1 (world 4)``."""
        gtp = (
            f" x gtp{self.gtp_remat_size}(pad {self.pad_for_alignment})"
            if self.gtp_remat_size > 1
            else ""
        )
        return (
            f"tp{self.tensor_model_parallel_size}{gtp} x dp{self.data_parallel_size}"
            f" (world {self.world_size})"
        )


_DTYPES = ("fp32", "bf16")
_SOURCES = ("pydoc", "text", "indexed", "mock")
_DECAY = ("cosine", "linear", "constant")
_LOGGER_MODES = ("offline", "online", "disabled")


def world_size_from_env(cfg) -> int:
    """World size: ``WORLD_SIZE`` when launched by torchrun/Slurm, else ``parallelism.nproc_per_node``."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return int(cfg.parallelism.nproc_per_node)


def _positive(name: str, value) -> None:
    if value is None or int(value) < 1:
        raise ConfigError(f"{name}={value} is invalid: it must be an integer >= 1")


def resolve_layout(cfg, world_size: int) -> Layout:
    """Derive the data-parallel size and resolved GTP alignment for ``world_size`` processes.

    Raises:
        ConfigError: pipeline parallelism requested, sizes < 1, or world_size not divisible by
            tp * pp * gtp_remat_size, or an explicit data_parallel_size that does not match.
    """
    par, gtp = cfg.parallelism, cfg.gtp
    tp, pp, g = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, gtp.gtp_remat_size
    for name, value in (
        ("parallelism.tensor_model_parallel_size", tp),
        ("parallelism.pipeline_model_parallel_size", pp),
        ("gtp.gtp_remat_size", g),
        ("world size", world_size),
    ):
        _positive(name, value)
    if pp != 1:
        raise ConfigError(
            f"parallelism.pipeline_model_parallel_size={pp} is not supported yet: use 1"
        )
    model_parallel = tp * pp * g
    if world_size % model_parallel != 0:
        valid = sorted({d for d in range(1, world_size + 1) if world_size % d == 0})
        raise ConfigError(
            f"world size {world_size} is not divisible by tensor_model_parallel_size={tp} x "
            f"pipeline_model_parallel_size={pp} x gtp_remat_size={g} = {model_parallel}; with "
            f"{world_size} processes tp * pp * gtp_remat_size must be one of {valid} (or change "
            f"parallelism.nproc_per_node)"
        )
    dp = world_size // model_parallel
    if par.data_parallel_size is not None and par.data_parallel_size != dp:
        raise ConfigError(
            f"parallelism.data_parallel_size={par.data_parallel_size} does not match world size "
            f"{world_size} / (tp {tp} x pp {pp} x gtp_remat_size {g}) = {dp}; set it to {dp} or null"
        )
    pad = 0
    if g > 1:
        from gtp.alignment import resolve_pad_for_alignment

        try:
            pad = resolve_pad_for_alignment(gtp.pad_for_alignment, gtp.quantization)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    return Layout(world_size, tp, pp, g, dp, pad)


def validate(cfg, world_size: int) -> Layout:
    """Validate the whole composed config for ``world_size`` processes.

    Returns:
        The resolved :class:`Layout`.

    Raises:
        ConfigError: the first problem found, naming the key, its value and what is valid.
    """
    layout = resolve_layout(cfg, world_size)
    m, d, o, t = cfg.model, cfg.data, cfg.optim, cfg.train
    tp = layout.tensor_model_parallel_size
    for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length"):
        _positive(f"model.{name}", m[name])
    for name, value, div in (
        ("model.num_attention_heads", m.num_attention_heads, tp),
        ("model.ffn_hidden_size", m.ffn_hidden_size, tp),
        ("model.hidden_size", m.hidden_size, m.num_attention_heads),
    ):
        if value % div != 0:
            raise ConfigError(f"{name}={value} must be divisible by {div} (tensor_model_parallel_size={tp})"
                              if div == tp else f"{name}={value} must be divisible by model.num_attention_heads={div}")
    if cfg.precision.params_dtype not in _DTYPES:
        raise ConfigError(f"precision.params_dtype={cfg.precision.params_dtype!r}: valid are {_DTYPES}")
    if d.source not in _SOURCES:
        raise ConfigError(f"data.source={d.source!r}: valid are {_SOURCES}")
    _positive("data.micro_batch_size", d.micro_batch_size)
    _positive("data.global_batch_size", d.global_batch_size)
    per_step = d.micro_batch_size * layout.data_parallel_size
    if d.global_batch_size % per_step != 0:
        raise ConfigError(
            f"data.global_batch_size={d.global_batch_size} must be a multiple of "
            f"data.micro_batch_size={d.micro_batch_size} x data-parallel size "
            f"{layout.data_parallel_size} (= {per_step}) for layout {layout.describe()}"
        )
    if o.optimizer != "adam":
        raise ConfigError(f"optim.optimizer={o.optimizer!r}: valid is 'adam'")
    if o.lr_decay_style not in _DECAY:
        raise ConfigError(f"optim.lr_decay_style={o.lr_decay_style!r}: valid are {_DECAY}")
    if not (0 <= o.min_lr <= o.lr):
        raise ConfigError(f"optim.min_lr={o.min_lr} must lie in [0, optim.lr={o.lr}]")
    _positive("train.train_iters", t.train_iters)
    if o.lr_warmup_iters < 0 or o.lr_warmup_iters > t.train_iters:
        raise ConfigError(
            f"optim.lr_warmup_iters={o.lr_warmup_iters} must lie in [0, train.train_iters={t.train_iters}]"
        )
    if cfg.logger.mode not in _LOGGER_MODES:
        raise ConfigError(f"logger.mode={cfg.logger.mode!r}: valid are {_LOGGER_MODES}")
    ck = cfg.checkpoint
    if ck.save_interval < 0:
        raise ConfigError(f"checkpoint.save_interval={ck.save_interval} must be >= 0 (0: never)")
    if ck.keep_last is not None and ck.keep_last < 1:
        raise ConfigError(f"checkpoint.keep_last={ck.keep_last} must be >= 1 or null (keep all)")
    if ck.load is not None:
        from recipes.checkpoint import check_loadable

        check_loadable(ck.load)
    return layout
