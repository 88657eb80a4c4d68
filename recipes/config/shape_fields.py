"""Which recorded model fields shape parameters: what a resume checks against the checkpoint's
tensors (``recipes.config.prelaunch``) and what its change table says of each field
(``recipes.checkpoint.policy``)."""

from __future__ import annotations

from recipes.config.schema import SHAPE_FIELDS
from recipes.families import FAMILIES, family_name


def changed_shape_fields(saved: dict, now: dict) -> list[str]:
    """The model fields that shape parameters and differ between ``saved`` (a checkpoint's
    recorded model config) and ``now``, as the families declare them: ``family`` first (a saved
    config without it: the family its fields imply, ``recipes.families.family_name``), then the
    fields each family requires (absent from the record: null), then the shared
    :data:`recipes.config.schema.SHAPE_FIELDS`, then the shape fields of the family both sides
    are of."""
    mine, theirs = family_name(now), family_name(saved)
    kinds = [f for family in FAMILIES for f in family.requires if saved.get(f) != now.get(f)]
    kinds = (["family"] if mine != theirs else []) + kinds
    fields = [f for f in SHAPE_FIELDS if f in saved and saved.get(f) != now.get(f)]
    for family in FAMILIES:
        if family.name == mine == theirs:
            fields += [f for f in family.shape_fields
                       if f in saved and f not in kinds and saved.get(f) != now.get(f)]
    return kinds + fields
