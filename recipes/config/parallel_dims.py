"""The process grid of a run: one type, :class:`ParallelDims`, derives the world size, the
data-parallel and expert data-parallel sizes, the expert grid and every megatron group size from
the config, once, and validates their products; the config resolver (``nproc_per_node``'s
default), validation, MoE, context parallelism, the dry run and the checkpoint's layout record
(``ckpt.io.layout_record``) read it. Its instance is named ``parallel_dims`` everywhere (a
"layout" is the parallel sizes themselves: ``docs/code-map.md``, "Words"). A new parallel
dimension touches this module and the code that uses the dimension.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

from gtp.alignment import RECIPE_DEFAULT_PAD, resolve_pad_for_alignment
from recipes.config.errors import ConfigError
from recipes.run.optim import distributed_optimizer


@dataclass(frozen=True)
class ParallelDims:
    """The process grid of a run, validated once (:meth:`from_config`); every other size is a
    property derived from it. A checkpoint's layout record (``ckpt.io.layout_record``)
    is what it stores of it.

    world_size = tensor_model_parallel_size * pipeline_model_parallel_size *
    context_parallel_size * gtp_remat_size * data_parallel_size (megatron's
    ``initialize_model_parallel`` order); for the routed experts, world_size =
    expert_tensor_parallel_size * expert_model_parallel_size * pipeline_model_parallel_size *
    expert_gtp_remat_size * expert_data_parallel_size (megatron's expert grid).
    """

    world_size: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    gtp_remat_size: int
    data_parallel_size: int
    pad_for_alignment: int
    # Model chunks per pipeline stage (interleaved schedule); None: one.
    virtual_pipeline_model_parallel_size: Optional[int] = None
    # megatron's DistributedOptimizer and its checkpoint format (None without it).
    use_distributed_optimizer: bool = False
    distrib_optim_sharding_type: Optional[str] = None
    # megatron's sequence parallelism (only at tp > 1) and the MoE grid: expert parallel,
    # expert tensor parallel (megatron's default: tp), expert GTP; expert data-parallel size
    # = world / (etp x ep x pp x expert_gtp_remat_size).
    sequence_parallel: bool = False
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1
    expert_gtp_remat_size: int = 1
    context_parallel_size: int = 1

    @classmethod
    def from_config(cls, cfg, world_size: int) -> "ParallelDims":
        """The grid of a composed run config for ``world_size`` processes: the data-parallel
        size derived (world / (tp x pp x cp x gtp_remat_size)), the expert grid checked
        (:func:`_expert_grid`), ``pad_for_alignment`` resolved (0 without GTP: nothing is
        padded) and the distributed optimizer's checkpoint format
        (``recipes.run.optim.distributed_optimizer``).

        Raises:
            ConfigError: a size < 1, a virtual pipeline size without pipeline parallelism,
                ``world_size`` not divisible by tp x pp x cp x gtp_remat_size or by the expert
                grid, an explicit ``data_parallel_size`` that does not match, a bad
                ``gtp.pad_for_alignment`` / ``gtp.quantization``, or a distributed-optimizer
                format that cannot change layout; the message names the value and what is valid.
        """
        par, gtp = cfg.parallelism, cfg.gtp
        tp, pp, g = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, gtp.gtp_remat_size
        cp = par.get("context_parallel_size", 1)
        for name, value in (
            ("parallelism.tensor_model_parallel_size", tp),
            ("parallelism.pipeline_model_parallel_size", pp),
            ("parallelism.context_parallel_size", cp),
            ("gtp.gtp_remat_size", g),
            ("world size", world_size),
        ):
            check_positive(name, value)
        vpp = par.get("virtual_pipeline_model_parallel_size")
        if vpp is not None:
            check_positive("parallelism.virtual_pipeline_model_parallel_size", vpp)
            if pp == 1:
                raise ConfigError(
                    f"parallelism.virtual_pipeline_model_parallel_size={vpp} needs "
                    f"parallelism.pipeline_model_parallel_size > 1 (it is 1): set "
                    f"pipeline_model_parallel_size=2 or more, or virtual_pipeline_model_parallel_size=null"
                )
            if vpp == 1:
                vpp = None  # one chunk per stage: megatron's plain 1F1B
        # The GTP fields are checked whatever gtp_remat_size is: a typo must not wait for g > 1.

        try:
            resolved_pad = resolve_pad_for_alignment(gtp.pad_for_alignment, gtp.quantization)
        except ValueError as exc:
            key = "quantization" if gtp.quantization not in RECIPE_DEFAULT_PAD else "pad_for_alignment"
            raise ConfigError(f"gtp.{key}={gtp[key]!r} is invalid: {exc}") from None
        model_parallel = tp * pp * cp * g
        # The context-parallel size is named only where it is set (CP needs TransformerEngine).
        cp_name, cp_short = (f" x context_parallel_size={cp}", f" x cp {cp}") if cp > 1 else ("", "")
        if world_size % model_parallel != 0:
            valid = sorted({d for d in range(1, world_size + 1) if world_size % d == 0})
            want_dp = par.data_parallel_size or 1
            product = "tp * pp * cp * gtp_remat_size" if cp > 1 else "tp * pp * gtp_remat_size"
            raise ConfigError(
                f"world size {world_size} is not divisible by tensor_model_parallel_size={tp} x "
                f"pipeline_model_parallel_size={pp}{cp_name} x gtp_remat_size={g} = {model_parallel}; "
                f"with {world_size} processes {product} must be one of {valid}, or run "
                f"{product} * dp processes: e.g. "
                f"parallelism.nproc_per_node={model_parallel * want_dp} (dp{want_dp})"
            )
        dp = world_size // model_parallel
        if par.data_parallel_size is not None and par.data_parallel_size != dp:
            raise ConfigError(
                f"parallelism.data_parallel_size={par.data_parallel_size} does not match world size "
                f"{world_size} / (tp {tp} x pp {pp}{cp_short} x gtp_remat_size {g}) = {dp}; set it to "
                f"{dp} or null"
            )
        experts = _expert_grid(cfg, world_size, tp, pp)
        # Without GTP nothing is padded: the layout (and the checkpoint's record of it) says 0.
        pad = resolved_pad if g > 1 or experts["expert_gtp_remat_size"] > 1 else 0
        distopt, sharding = distributed_optimizer(cfg)
        return cls(world_size, tp, pp, g, dp, pad, vpp, distopt, sharding, **experts,
                   context_parallel_size=int(cp))

    @property
    def model_parallel_size(self) -> int:
        """Ranks one copy of the dense weights spans: tp x pp x cp x gtp_remat_size."""
        return (self.tensor_model_parallel_size * self.pipeline_model_parallel_size *
                self.context_parallel_size * self.gtp_remat_size)

    @property
    def experts_split(self) -> bool:
        """Whether the routed experts are laid out otherwise than the dense weights
        (:func:`experts_split`)."""
        return experts_split(self.expert_model_parallel_size, self.expert_tensor_parallel_size,
                             self.tensor_model_parallel_size, self.expert_gtp_remat_size)

    @property
    def uses_gtp(self) -> bool:
        """Whether any weight is sharded over a GTP group: dense (``gtp_remat_size``) or routed
        experts (``expert_gtp_remat_size``). megatron's GTP backend and recipe are set up then."""
        return self.gtp_remat_size > 1 or self.expert_gtp_remat_size > 1

    def megatron_kwargs(self) -> dict:
        """Keyword arguments of megatron's ``parallel_state.initialize_model_parallel``."""
        return dict(
            tensor_model_parallel_size=self.tensor_model_parallel_size,
            pipeline_model_parallel_size=self.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=self.virtual_pipeline_model_parallel_size,
            context_parallel_size=self.context_parallel_size,
            gtp_remat_size=self.gtp_remat_size,
            expert_model_parallel_size=self.expert_model_parallel_size,
            expert_tensor_parallel_size=self.expert_tensor_parallel_size,
            expert_gtp_remat_size=self.expert_gtp_remat_size,
        )

    @property
    def expert_data_parallel_size(self) -> int:
        """Ranks holding the same expert shard: world / (etp x ep x pp x expert_gtp_remat_size)."""
        return self.world_size // (self.expert_tensor_parallel_size *
                                   self.expert_model_parallel_size *
                                   self.pipeline_model_parallel_size * self.expert_gtp_remat_size)

    def describe(self) -> str:
        """A short human-readable form, e.g. ``tp2 x pp2 x gtp2(pad 16) x dp1 (world 8)``."""
        gtp = (
            f" x gtp{self.gtp_remat_size}(pad {self.pad_for_alignment})"
            if self.gtp_remat_size > 1
            else ""
        )
        pp = ""
        if self.pipeline_model_parallel_size > 1:
            vpp = self.virtual_pipeline_model_parallel_size
            pp = f" x pp{self.pipeline_model_parallel_size}" + (f"(vpp {vpp})" if vpp else "")
        opt = (f", distributed optimizer ({self.distrib_optim_sharding_type})"
               if self.use_distributed_optimizer else "")
        sp = "+sp" if self.sequence_parallel else ""
        experts = ""
        if self.experts_split:
            egtp = (f" x egtp{self.expert_gtp_remat_size}" if self.expert_gtp_remat_size > 1 else "")
            experts = (f"; experts ep{self.expert_model_parallel_size} x "
                       f"etp{self.expert_tensor_parallel_size}{egtp} x "
                       f"edp{self.expert_data_parallel_size}")
        cp = f" x cp{self.context_parallel_size}" if self.context_parallel_size > 1 else ""
        return (
            f"tp{self.tensor_model_parallel_size}{sp}{pp}{cp}{gtp} x dp{self.data_parallel_size}"
            f" (world {self.world_size}){experts}{opt}"
        )


def experts_split(ep: int, etp: int, tp: int, egtp: int) -> bool:
    """Whether routed experts are laid out otherwise than the dense weights: expert model
    parallel > 1, expert tensor parallel != tensor parallel, or expert GTP. megatron then gives
    them their own optimizer (``get_megatron_optimizer``: params with ``allreduce = False``)."""
    return ep > 1 or etp != tp or egtp > 1



def world_size_from_env(cfg) -> int:
    """World size: ``WORLD_SIZE`` when launched by torchrun/Slurm, else ``parallelism.nproc_per_node``."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return int(cfg.parallelism.nproc_per_node)



def check_positive(name: str, value) -> None:
    """Raises ConfigError naming ``name`` unless ``value`` is an integer >= 1."""
    if value is None or int(value) < 1:
        raise ConfigError(f"{name}={value} is invalid: it must be an integer >= 1")

def _expert_grid(cfg, world_size: int, tp: int, pp: int) -> dict:
    """The expert and sequence fields of :class:`ParallelDims` for ``world_size``.

    ``sequence_parallel`` holds only at tp > 1 (megatron turns it off at tp 1, as Megatron-LM
    does); ``expert_tensor_parallel_size`` null is megatron's default, tp.

    Raises:
        ConfigError: a size < 1, or world_size not divisible by etp x ep x pp x
            expert_gtp_remat_size (megatron's expert grid), naming the valid sizes.
    """
    par = cfg.parallelism
    ep = par.get("expert_model_parallel_size", 1)
    etp = par.get("expert_tensor_parallel_size")
    etp = tp if etp is None else etp
    egtp = cfg.gtp.get("expert_gtp_remat_size", 1)
    for name, value in (("parallelism.expert_model_parallel_size", ep),
                        ("parallelism.expert_tensor_parallel_size", etp),
                        ("gtp.expert_gtp_remat_size", egtp)):
        check_positive(name, value)
    grid = etp * ep * pp * egtp
    if world_size % grid:
        fits = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ConfigError(
            f"world size {world_size} is not divisible by the expert grid "
            f"expert_tensor_parallel_size={etp} x expert_model_parallel_size={ep} x "
            f"pipeline_model_parallel_size={pp} x gtp.expert_gtp_remat_size={egtp} = {grid} "
            f"(megatron: expert data-parallel size = world / that); with {world_size} processes "
            f"the product must be one of {fits}, or run a multiple of {grid} processes "
            f"({'WORLD_SIZE' if 'WORLD_SIZE' in os.environ else 'parallelism.nproc_per_node'})")
    return {"sequence_parallel": bool(par.get("sequence_parallel", False)) and tp > 1,
            "expert_model_parallel_size": int(ep), "expert_tensor_parallel_size": int(etp),
            "expert_gtp_remat_size": int(egtp)}


def default_world_size(tp, pp, g, dp=None, ep=1, etp=None, egtp=1, cp=1) -> int:
    """``parallelism.nproc_per_node``'s default (the ``gtp_recipes_world`` resolver): tp x pp x
    cp x gtp_remat_size x dp with an explicit dp; with dp null, the least world both the dense
    grid (dp 1) and the expert grid (etp x ep x pp x expert_gtp_remat_size, etp null: tp) fill."""
    def n(d):
        return 1 if d is None else int(d)

    dense = n(tp) * n(pp) * n(cp) * n(g) * n(dp)
    if dp is not None:
        return dense
    expert = n(etp if etp is not None else tp) * n(ep) * n(pp) * n(egtp)
    return math.lcm(dense, expert)
