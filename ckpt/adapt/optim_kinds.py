"""Which megatron optimizer runs, and which one wrote a checkpoint's optimizer state.

Kinds (how the state is laid out): :data:`PLAIN`, megatron's ``FP32Optimizer`` /
``Float16OptimizerWithFloat16Params``, and :data:`DISTRIBUTED`, its ``DistributedOptimizer``
(``fully_reshardable`` format). Names (what the update is): ``"adam"`` and ``"muon"``
(``TensorParallelMuon`` for the 2-D weights, chained with Adam for the rest). A
``ChainedOptimizer`` of several optimizers (Muon's chain; an MoE model's dense and expert
optimizers) writes one common-state entry per optimizer, keyed by its index.
"""

from __future__ import annotations

import re

PLAIN = "adam"
DISTRIBUTED = "distributed_adam"
# megatron's ChainedOptimizer prefixes each entry's checkpoint keys with it unless told not to.
_CHAIN_PREFIX = re.compile(r"^chained_\d+\.")


def without_chain_prefix(key: str) -> str:
    """A checkpoint key without megatron's ``chained_<i>.`` prefix (the param's own name)."""
    return _CHAIN_PREFIX.sub("", key)


class OptimizerCheckpointError(RuntimeError):
    """An optimizer checkpoint this optimizer cannot take exactly."""


def leaves(optimizer) -> list:
    """The megatron optimizers under ``optimizer``, nested chained optimizers flattened
    (Muon with the distributed optimizer: ``[LayerWiseDistributedOptimizer's Muon,
    DistributedOptimizer's Adam]``)."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is None:
        return [optimizer]
    return [leaf for opt in chained for leaf in leaves(opt)]


def chain_of(optimizer) -> list:
    """The megatron optimizers a ``ChainedOptimizer`` chains (one level), or ``[optimizer]``."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def is_chain(node) -> bool:
    """Whether ``node`` is megatron's ``ChainedOptimizer`` state of several optimizers (one entry
    per optimizer, keyed by its index)."""
    return isinstance(node, dict) and bool(node) and all(isinstance(k, int) for k in node)


def entry_kind(node) -> str:
    """The kind that wrote one (not chained) optimizer's common state."""
    return DISTRIBUTED if isinstance(node, dict) and "param_state_sharding_type" in node \
        else PLAIN


def kind_of(optimizer) -> str:
    """``"distributed_adam"`` for megatron's DistributedOptimizer, else ``"adam"``."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return DISTRIBUTED if any(isinstance(o, DistributedOptimizer) for o in leaves(optimizer)) \
        else PLAIN


def saved_kind(common_optimizer) -> str:
    """The kind that wrote ``common_optimizer`` (the ``optimizer`` entry of a checkpoint's
    common state).

    Raises:
        OptimizerCheckpointError: a distributed-optimizer format that does not change layout.
    """
    if is_chain(common_optimizer):
        # Chained optimizers, one entry each: distributed when one of them is (Muon's
        # layer-wise chain is a plain Muon entry and a distributed Adam one).
        kinds = [saved_kind(node) for _, node in sorted(common_optimizer.items())]
        return DISTRIBUTED if DISTRIBUTED in kinds else PLAIN
    node = common_optimizer
    fmt = node.get("param_state_sharding_type") if isinstance(node, dict) else None
    if fmt is None:
        return PLAIN
    if fmt not in ("fully_sharded_model_space", "fully_reshardable"):
        raise OptimizerCheckpointError(
            f"the checkpoint's distributed optimizer state is in megatron's {fmt!r} format, which "
            f"cannot be loaded at another layout or optimizer; only 'fully_sharded_model_space' "
            f"and 'fully_reshardable' can")
    return DISTRIBUTED


def is_muon(opt) -> bool:
    """Whether one (not chained) megatron optimizer steps with ``TensorParallelMuon``."""
    from megatron.core.optimizer.emerging_optimizers import HAVE_EMERGING_OPTIMIZERS

    if not HAVE_EMERGING_OPTIMIZERS:
        return False
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    return isinstance(getattr(opt, "optimizer", None), TensorParallelMuon)


def is_muon_group(group: dict) -> bool:
    """Whether a saved param group is Muon's: ``momentum`` and no Adam ``betas``."""
    return "momentum" in group and "betas" not in group


def optimizer_name(optimizer) -> str:
    """``"muon"`` when a chained optimizer is megatron's ``TensorParallelMuon``, else ``"adam"``."""
    return "muon" if any(map(is_muon, leaves(optimizer))) else "adam"


def saved_optimizer_name(common_optimizer) -> str:
    """``"muon"`` when ``common_optimizer`` (a checkpoint's common ``optimizer`` entry) holds a
    Muon param group, else ``"adam"``."""
    nodes = list(common_optimizer.values()) if is_chain(common_optimizer) else [common_optimizer]
    for node in nodes:
        node = node.get("optimizer", node) if isinstance(node, dict) else {}
        if any(map(is_muon_group, node.get("param_groups", []) if isinstance(node, dict)
                   else [])):
            return "muon"
    return "adam"


def check_same_optimizer(optimizer, common_optimizer) -> None:
    """Refuse a checkpoint written by another optimizer (Adam <-> Muon): Muon keeps one momentum
    buffer per 2-D weight and Adam two moments, so neither state can continue the other's run.

    Raises:
        OptimizerCheckpointError: naming both optimizers and the ways on.
    """
    mine, saved = optimizer_name(optimizer), saved_optimizer_name(common_optimizer)
    if mine != saved:
        raise OptimizerCheckpointError(optimizer_mismatch("the checkpoint", saved, mine,
                                                          "<the checkpoint dir>"))


def optimizer_mismatch(written: str, saved: str, mine: str, root: str) -> str:
    """The message refusing a resume of ``saved``'s optimizer state (``written`` by it) as
    ``mine``, naming the two ways on (``root``: the checkpoint dir as the user would type it)."""
    state = "Muon momentum buffers" if saved == "muon" else "Adam moments"
    return (f"{written} was written by optim.optimizer={saved} and this run is "
            f"optim.optimizer={mine}: {saved}'s state ({state}) cannot continue as {mine}'s; "
            f"resume with optim={saved}, or start {mine} from these weights only with "
            f"checkpoint.pretrained={root} and checkpoint.load=null")
