"""What a model family gives the rest of the project: :class:`ModelFamily`."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class ModelFamily:
    """One model family, registered once in ``recipes.families.FAMILIES``.

    Attributes:
        name: the family's folder under ``recipes/families/``, and the value of ``model.family``
            that chooses it.
        transformer_config_fields: ``(model config, ParallelDims) -> dict`` of megatron
            ``TransformerConfig`` keyword arguments for the family's model fields (the run-wide
            ones, parallel sizes, precision and fusions, come from ``recipes.model.build``).
        layer_spec: ``(model config, TransformerConfig, use_te, vp_stage) -> ModuleSpec``:
            megatron's layer (or decoder block) spec, local or TransformerEngine.
        build: ``(model config, TransformerConfig, spec, padded vocab, pre_process,
            post_process, vp_stage, tied) -> module``: one model chunk, a megatron module.
        parameter_shapes: ``(model config, padded vocab) -> list[recipes.model.shapes.ParamShape]``:
            every parameter the built module holds, without building it.
        building: a context manager active while chunks are built (default: none).
        init_weights: ``(chunk, TransformerConfig, seed) -> None`` after a chunk is built, for
            weights whose CPU draw would differ between layouts (default: none).
        check: ``(run config, ParallelDims) -> None``, the family's own rules before launch
            (``recipes.config.validate``; raises ``ConfigError``; default: none).
        fields: the dataclass of the family's own ``model`` fields (its ``schema.py``), merged
            into the run's ``model`` schema (``recipes.config.schema.ModelConfig``).
        requires: its fields set (not null) in each of its configs and in no other
            family's (but one that takes them, ``takes_fields_of``): a config naming another
            family with one of them set, or this family without one, is refused
            (``recipes.families.check_family_fields``).
        takes_fields_of: the names of other families whose fields this family's configs may
            set too, their ``requires`` included, because it builds their layers (the hybrid
            family takes the MoE family's: its ``E`` layers are MoE layers). Its own ``check``
            says when they must and must not be set; its ``shape_fields`` list the taken ones
            that size its parameters.
        shape_fields: its fields that size a parameter beyond the shared ones
            (``recipes.config.schema.SHAPE_FIELDS``): a resume refuses a checkpoint of the same
            family whose value differs (``recipes.config.shape_fields.changed_shape_fields``).
        formats: its Hugging Face and stock-format names (its ``formats.py``), given to ``ckpt/``.
    """

    name: str
    transformer_config_fields: Callable[[Any, Any], dict]
    layer_spec: Callable[[Any, Any, bool, Optional[int]], Any]
    build: Callable[..., Any]
    parameter_shapes: Callable[[Any, int], list]
    building: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    init_weights: Optional[Callable[[Any, Any, int], None]] = None
    check: Optional[Callable[[Any, Any], None]] = None
    fields: Optional[type] = None
    requires: tuple[str, ...] = ()
    takes_fields_of: tuple[str, ...] = ()
    shape_fields: tuple[str, ...] = ()
    formats: Any = None
