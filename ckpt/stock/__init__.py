"""Read GTP checkpoints written in megatron-core 0.19.2's padded format, the "stock" format.

Stock 0.19.2 writes every GTP-sharded weight in a padded, TP-shifted format that upstream can read
only into the exact layout that wrote it (:mod:`ckpt.stock.rowmaps`). This package reconstructs
the **logical** tensors (what the non-GTP model at the same TP writes) from the plain stored
tensors with the row arithmetic of :mod:`gtp.shards`, so a stock file loads at any layout.

Entry points:

* :func:`checkpoint_format` - "logical" or "stock" from the common state (the one place that
  knows the format tag written by :mod:`ckpt.format.logical_format`).
* :func:`analyze` - resolve the saving layout and, for every tensor, its logical shape and
  whether its stored rows differ (no tensor data is read; :mod:`ckpt.stock.analysis` says
  where the layout comes from).
* :func:`read_logical` - the logical tensors of any checkpoint (stock ones reconstructed).
* :func:`iter_logical` / :class:`LogicalReader` - the same, one tensor read at a time.
* :func:`convert` - write a stock checkpoint as a normal logical one (non-GTP layout record).
* :func:`prepare_load` - the hook of ``ckpt.io.load_checkpoint``: converts a stock
  checkpoint once into ``<root>/gtp_converted/`` and returns the directory to load.

Import from ``ckpt.stock`` only: the names above (and the record names ``CONVERTED_KEY``,
``FORMAT_STOCK``, ``SHARDING_RECORD_KEY``, and :func:`split_key`) are the package's surface. Its
modules are the implementation: ``format`` (format tag, error), ``specs`` (layout keys, tensor
specs, key and dim helpers), ``rowmaps`` (logical row -> stored row), ``messages`` (error message
pieces), ``analysis`` and ``saving_layout`` (:func:`analyze`), ``reading`` (:func:`read_logical`),
``conversion`` (:func:`convert`), ``loading`` (:func:`prepare_load`). A name with a leading
underscore is used only in the module that defines it (tests/test_import_graph.py checks this).
``docs/stock-conversion.md`` explains the reader.
"""

from ckpt.stock.analysis import analyze, is_stock, resolve_iter_dir
from ckpt.stock.conversion import CONVERTED_KEY, convert
from ckpt.stock.format import (FORMAT_STOCK, SHARDING_RECORD_KEY, StockCheckpointError,
                               checkpoint_format)
from ckpt.stock.loading import CONVERTED_DIR, prepare_load
from ckpt.stock.reading import LogicalReader, iter_logical, read_logical
from ckpt.stock.specs import LAYOUT_KEYS, Analysis, SavedLayout, TensorInfo, parse_layout, split_key

__all__ = [
    "CONVERTED_DIR",
    "LAYOUT_KEYS",
    "Analysis",
    "StockCheckpointError",
    "SavedLayout",
    "TensorInfo",
    "analyze",
    "checkpoint_format",
    "convert",
    "is_stock",
    "parse_layout",
    "prepare_load",
    "LogicalReader",
    "iter_logical",
    "read_logical",
    "resolve_iter_dir",
]
# Also re-exported (used by ckpt.cli and the tests): CONVERTED_KEY, FORMAT_STOCK,
# SHARDING_RECORD_KEY, split_key.
