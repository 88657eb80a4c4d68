"""The GPT family's own ``model`` fields: none. A GPT model is the shared decoder the other
families build on (``recipes.config.schema.ModelConfig``'s shared fields, whose parameter-sizing
ones are ``recipes.config.schema.SHAPE_FIELDS``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GPTFields:
    """No field beyond the shared ones."""


# The family's fields set in every one of its configs and in no other family's: none.
REQUIRES: tuple[str, ...] = ()
# Its fields that size a parameter beyond the shared ones: none.
SHAPE_FIELDS: tuple[str, ...] = ()
