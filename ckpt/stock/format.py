"""What a checkpoint records about its GTP format, and the error the stock reader raises.

:func:`checkpoint_format` is the one place that knows the format tag written by
:mod:`ckpt.format.logical_format`.
"""

from __future__ import annotations

from typing import Mapping

from ckpt.format.records import (GTP_FORMAT_LOGICAL as FORMAT_LOGICAL, GTP_FORMAT_STOCK as FORMAT_STOCK,
                         SHARDING_RECORD_KEY, TRACKER)


class StockCheckpointError(ValueError):
    """A checkpoint whose tensors cannot be read exactly; the message says what is ambiguous or
    inconsistent and how to pass the layout."""


def checkpoint_format(common: Mapping) -> str:
    """``"logical"`` or ``"stock"``: how the checkpoint's GTP weights are laid out on disk.

    Reads the ``gtp_layout`` record that :mod:`ckpt.format.logical_format` adds to the common state
    (``gtp_format``: ``"logical-v1"`` or ``"stock-0.19.2"``). A checkpoint without it predates that
    record (or was written by megatron itself): "stock". Whether a stock checkpoint is actually
    padded depends on its GTP degree (:func:`ckpt.stock.is_stock`).

    Raises:
        StockCheckpointError: an unknown ``gtp_format`` tag.
    """
    meta = common.get(SHARDING_RECORD_KEY)
    if not meta:
        return "stock"
    tag = meta.get("gtp_format")
    if tag == FORMAT_LOGICAL:
        return "logical"
    if tag == FORMAT_STOCK:
        return "stock"
    raise StockCheckpointError(
        f"unknown {SHARDING_RECORD_KEY}.gtp_format {tag!r} (known: {FORMAT_LOGICAL!r}, "
        f"{FORMAT_STOCK!r}); "
        "this checkpoint was written by a newer gtp/"
    )
