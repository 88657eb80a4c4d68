"""The hybrid family's formats as ``gtp/`` reads and writes them (registered in
``pyproject.toml`` under the entry-point group ``gtp.model_families``).

No Hugging Face mapping yet: an export is refused, naming why. No stock-format names: the stock
reader refuses a checkpoint with Mamba weights (``docs/hybrid.md``).

Cheap to import (no megatron, no Hydra, no torch): the ``gtp`` command line loads it.
"""

from __future__ import annotations

from gtp.families import ExportError, FamilyFormats

NOT_EXPORTED = ("transformers has NemotronH and Mamba2 classes, but the mapping of megatron's "
                "HybridModel weights to them (the packed in_proj z|x|B|C|dt, the conv1d, the "
                "gated norm) is not written yet")


def architecture(model: dict) -> str | None:
    """None for a model without ``hybrid_layer_pattern``.

    Raises:
        ExportError: a hybrid model (:data:`NOT_EXPORTED`).
    """
    pattern = model.get("hybrid_layer_pattern")
    if not pattern:
        return None
    raise ExportError(f"model.hybrid_layer_pattern={pattern!r}: a hybrid Mamba model cannot be "
                      f"exported to transformers: {NOT_EXPORTED}")


FORMATS = FamilyFormats(name="hybrid", architectures=(), architecture=architecture,
                        gtp_patterns=())
