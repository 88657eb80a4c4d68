"""GatedDeltaNet's packed ``in_proj`` under GTP in the logical checkpoint format
(megatron-core 0.19.2).

``GatedDeltaNet.in_proj.weight`` is one column-parallel weight whose TP-local rows pack six
tensors, each TP-sharded on its own: ``query | key | value | z | beta | alpha`` (megatron's
``in_proj_split_names`` and ``in_proj_split_sections``: key heads x key head dim twice, value
heads x value head dim twice, value heads twice, over the TP size); its ``conv1d`` packs
``query | key | value`` channels. Without GTP megatron stores them as
``in_proj.weight.{query,key,value,z,beta,alpha}`` and ``conv1d.weight.{query,key,value}``
(``_GDNBase.sharded_state_dict``, ``ssm.utils._split_tensor_factory``). Under GTP that method
asserts that ``in_proj``'s entry holds all TP-local rows, which a GTP shard does not: megatron
cannot save the model (upstream's fix is an open pull request).

:func:`gdn_sharded_state_dict` replaces it while the logical format is installed and
``in_proj`` is a GTP param: each GTP shard's logical rows are cut into the components they meet
and written at the components' logical offsets, from the live shard
(:func:`ckpt.format.mamba_format.components_factory`, shared with Mamba's ``in_proj``); the
entry keeps its back-link, so Adam's and the distributed optimizer's moments stay mapped.
Everything else is built as megatron builds it. Without GTP, megatron's method runs. In the
stock format under GTP it raises :class:`GTPCheckpointError` naming the weight (the run is
refused before launch: ``recipes/families/hybrid/checks.py``).
"""

from __future__ import annotations

from megatron.core.ssm.gated_delta_net import common
from megatron.core.ssm.utils import _split_tensor_factory
from megatron.core.tensor_parallel.generalized_tensor_parallelism import is_gtp_param
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
    sharded_state_dict_default,
)

from ckpt.format import logical_format
from ckpt.format.logical_factory import GTPCheckpointError
from ckpt.format.mamba_format import components_factory
from mcore_compat.patches import megatron_patch

# megatron's in_proj_split_names (GatedDeltaNet._setup_variant_attrs) and conv1d's parts.
IN_PROJ_COMPONENTS = ("query", "key", "value", "z", "beta", "alpha")
CONV_COMPONENTS = ("query", "key", "value")
_ORIGINAL = {}


def _gtp_in_proj(net) -> bool:
    weight = net.in_proj.weight
    return is_gtp_param(weight) and getattr(weight, "gtp_remat_size", 1) > 1


def gdn_sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None, tp_group=None):
    """Replacement of ``megatron.core.ssm.gated_delta_net.common._GDNBase.sharded_state_dict``.

    With the logical format and a GTP ``in_proj``: the keys, shapes and offsets the non-GTP
    module writes (``in_proj.weight.<name>`` for megatron's ``in_proj_split_names``,
    ``conv1d.weight.{query,key,value}``, ``A_log`` and ``dt_bias`` TP-split, ``out_norm``,
    ``out_proj``), ``in_proj`` as one logical GTP factory over its components. Without GTP:
    megatron's method.

    Raises:
        GTPCheckpointError: a GTP ``in_proj`` in the stock format (megatron-core 0.19.2 asserts
            on it), or its rows differ from the module's split sections.
    """
    if not _gtp_in_proj(self):
        return _ORIGINAL["sharded_state_dict"](self, prefix, sharded_offsets, metadata, tp_group)
    if not logical_format.is_installed():
        raise GTPCheckpointError(
            f"{prefix}in_proj.weight: megatron-core 0.19.2's stock format cannot save "
            f"GatedDeltaNet's GTP in_proj (its sharded_state_dict asserts that the entry holds "
            f"every TP-local row); use checkpoint.format=logical")
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    tp_group = tp_group if tp_group is not None else self.pg_collection.tp
    dp_cp = metadata["dp_cp_group"]
    own = {}
    self._save_to_state_dict(own, "", keep_vars=True)
    out = make_sharded_tensors_for_checkpoint(own, prefix, {"A_log": 0, "dt_bias": 0},
                                              sharded_offsets, tp_group=tp_group,
                                              dp_cp_group=dp_cp)
    conv = self.conv1d.state_dict(prefix="", keep_vars=True)
    for name, module in self.named_children():
        if name == "conv1d":
            out.update(make_sharded_tensors_for_checkpoint(
                conv, f"{prefix}conv1d.", {k: 0 for k in conv}, sharded_offsets,
                tp_group=tp_group, dp_cp_group=dp_cp))
        else:
            out.update(sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets,
                                                  metadata, tp_group=tp_group))
    key = f"{prefix}in_proj.weight"
    out[key] = components_factory(out[key], tuple(self.in_proj_split_names),
                                  tuple(self.in_proj_split_sections))
    rows = [self.qk_dim_local_tp, self.qk_dim_local_tp, self.v_dim_local_tp]
    for name in conv:
        key = f"{prefix}conv1d.{name}"
        out[key] = _split_tensor_factory(out[key], rows, list(CONV_COMPONENTS), 0)
    return out


@megatron_patch("ssm.gated_delta_net.common._GDNBase.sharded_state_dict (its GTP in_proj)")
def install() -> None:
    """Put :func:`gdn_sharded_state_dict` on ``_GDNBase`` (idempotent). It reads at each call
    whether the logical format is installed, so one install serves both formats."""
    cls = common._GDNBase
    if cls.sharded_state_dict is gdn_sharded_state_dict:
        return
    _ORIGINAL["sharded_state_dict"] = cls.sharded_state_dict
    cls.sharded_state_dict = gdn_sharded_state_dict
