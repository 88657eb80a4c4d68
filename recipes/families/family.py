"""What a model family gives the rest of the project: :class:`ModelFamily`."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class ModelFamily:
    """One model family, registered once in ``recipes.families.FAMILIES``.

    Attributes:
        name: the family's folder under ``recipes/families/``.
        matches: ``(model config) -> bool``: whether a ``model`` config belongs to the family
            (the first family in ``FAMILIES`` that matches owns it).
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
    """

    name: str
    matches: Callable[[Any], bool]
    transformer_config_fields: Callable[[Any, Any], dict]
    layer_spec: Callable[[Any, Any, bool, Optional[int]], Any]
    build: Callable[..., Any]
    parameter_shapes: Callable[[Any, int], list]
    building: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    init_weights: Optional[Callable[[Any, Any, int], None]] = None
    check: Optional[Callable[[Any, Any], None]] = None
