"""Mamba's packed ``in_proj`` under GTP in the logical checkpoint format (megatron-core 0.19.2).

``MambaMixer.in_proj.weight`` is one column-parallel weight whose TP-local rows pack five
tensors, each TP-sharded on its own: ``z | x | B | C | dt`` (``d_inner``, ``d_inner``,
``ngroups * d_state`` twice, ``nheads`` rows per TP rank). Without GTP megatron stores them
under ``in_proj.weight.{z,x,B,C,dt}`` (``ssm.utils._split_tensor_factory``). Under GTP, stock
``MambaMixer.sharded_state_dict`` all-gathers the padded shards over the ``gtp_remat`` group,
trims the padding and splits the gathered copy. So the model file is logical, but:

* the entry's data is the gathered copy, not the live param, so the optimizer cannot map
  ``in_proj``'s moments ("Param id N does not match any model sharded param");
* building the sharded state dict is a collective over the ``gtp_remat`` group (called on some
  ranks only, it hangs), and on gloo the gather of a param that requires grad fails.

:func:`mixer_sharded_state_dict` replaces it while the logical format is installed and
``in_proj`` is a GTP param: each GTP shard's logical rows are cut into the components they meet
(:func:`gtp.shards.logical_pieces` with ``components``) and written at the components' logical
offsets, from the live shard, without a gather. The entry is a :class:`LogicalGTPFactory`, so
its back-link keeps Adam's and the distributed optimizer's moments mapped
(:func:`components_factory`, also GatedDeltaNet's: :mod:`ckpt.format.gdn_format`). Everything else in
the mixer's state dict is built as megatron builds it. In the stock format, and without GTP,
megatron's method runs, without grad.
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.ssm import mamba_mixer
from megatron.core.ssm.utils import _split_tensor_factory
from megatron.core.tensor_parallel.generalized_tensor_parallelism import is_gtp_param
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
    sharded_state_dict_default,
)

from ckpt.format import logical_format
from ckpt.format.logical_factory import GTPCheckpointError, LogicalGTPFactory, make_factory
from mcore_compat.patches import megatron_patch

IN_PROJ_COMPONENTS = ("z", "x", "B", "C", "dt")
CONV_COMPONENTS = ("x", "B", "C")
_ORIGINAL = {}


def in_proj_rows(mixer) -> tuple[int, ...]:
    """TP-local rows of ``in_proj``'s components ``z, x, B, C, dt`` (megatron's split sizes)."""
    groups = mixer.ngroups_local_tp * mixer.d_state
    return (mixer.d_inner_local_tp, mixer.d_inner_local_tp, groups, groups, mixer.nheads_local_tp)


def _gtp_in_proj(mixer) -> bool:
    weight = mixer.in_proj.weight
    return (logical_format.is_installed() and is_gtp_param(weight)
            and getattr(weight, "gtp_remat_size", 1) > 1)


def mixer_sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
    """Replacement of ``megatron.core.ssm.mamba_mixer.MambaMixer.sharded_state_dict``.

    With the logical format and a GTP ``in_proj``: the same keys, shapes and offsets as the
    non-GTP mixer writes (``in_proj.weight.{z,x,B,C,dt}``, ``conv1d.{weight,bias}.{x,B,C}``,
    the plain TP tensors), ``in_proj`` as one :class:`LogicalGTPFactory` over its components.
    Not a collective. Otherwise megatron's method, run without grad (in the stock format it
    all-gathers a GTP ``in_proj``, which gloo cannot do for a tensor that requires grad; the
    model file is then logical too, but the optimizer's moments of ``in_proj`` cannot be
    mapped: megatron's "Param id N does not match any model sharded param").

    Raises:
        GTPCheckpointError: ``in_proj``'s entry is not a logical GTP factory, or its rows differ
            from the mixer's component sizes.
    """
    if not _gtp_in_proj(self):
        # Stock format: megatron's gather of a GTP in_proj, whose gloo all_gather_into_tensor
        # of a param that requires grad fails outside no_grad ("A view was created in no_grad
        # mode and is being modified inplace").
        with torch.no_grad():
            return _ORIGINAL["sharded_state_dict"](self, prefix, sharded_offsets, metadata)
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    own = {}
    self._save_to_state_dict(own, "", keep_vars=True)
    out = make_sharded_tensors_for_checkpoint(
        own, prefix,
        tensor_parallel_layers_axis_map={name: 0 for name in
                                         ("A_log", "dt_bias", "D", "conv1d_weight", "conv1d_bias")},
        sharded_offsets=sharded_offsets, tp_group=self.tp_group,
        dp_cp_group=metadata["dp_cp_group"])
    for name, module in self.named_children():
        out.update(sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets,
                                              metadata, tp_group=self.tp_group))
    key = f"{prefix}in_proj.weight"
    out[key] = components_factory(out[key], IN_PROJ_COMPONENTS, in_proj_rows(self))
    conv_rows = list(in_proj_rows(self)[1:4])
    for name in ("weight", "bias"):
        entry = out[f"{prefix}conv1d_{name}"]
        entry.key = f"{prefix}conv1d.{name}"  # megatron's stable key (not the attribute name)
        out[f"{prefix}conv1d_{name}"] = _split_tensor_factory(entry, conv_rows,
                                                              list(CONV_COMPONENTS), 0)
    return out


def components_factory(entry, names, rows) -> LogicalGTPFactory:
    """The logical factory of a GTP weight whose TP-local rows pack components, each TP-split
    on its own (Mamba's and GatedDeltaNet's ``in_proj``): ``entry`` (the weight's
    :class:`LogicalGTPFactory`) with the components ``<key>.<name>`` of ``rows`` TP-local rows
    each, in order. Each GTP shard's logical rows are cut into the components they meet
    (:func:`gtp.shards.logical_pieces`) and written at the components' logical offsets, so
    the file holds what megatron's ``_split_tensor_factory`` writes without GTP.

    Raises:
        GTPCheckpointError: ``entry`` is not a logical GTP factory, or ``rows`` do not add up
            to its TP-local dim 0 (both named).
    """
    if not isinstance(entry, LogicalGTPFactory):
        raise GTPCheckpointError(f"{getattr(entry, 'key', entry)}: a GTP in_proj without the "
                                 f"logical factory (ckpt.format.logical_format not installed first?)")
    spec = entry.spec
    if sum(rows) != spec.shard.L:
        raise GTPCheckpointError(f"{entry.key}: TP-local dim 0 is {spec.shard.L}, but the "
                                 f"components {dict(zip(names, rows))} hold {sum(rows)}")
    components = tuple((f".{name}", int(n)) for name, n in zip(names, rows))
    shard = dataclasses.replace(spec.shard, components=components)
    return make_factory(entry.live_param, entry.key, dataclasses.replace(spec, shard=shard),
                        entry.replica_id, data=entry.data)


@megatron_patch("ssm.mamba_mixer.MambaMixer.sharded_state_dict (its GTP in_proj gather)")
def install() -> None:
    """Put :func:`mixer_sharded_state_dict` on ``MambaMixer`` (idempotent). It reads at each
    call whether the logical format is installed, so one install serves both formats."""
    cls = mamba_mixer.MambaMixer
    if cls.sharded_state_dict is mixer_sharded_state_dict:
        return
    _ORIGINAL["sharded_state_dict"] = cls.sharded_state_dict
    cls.sharded_state_dict = mixer_sharded_state_dict
