"""Names of what a checkpoint records, in one light module (no torch, no megatron import).

* :data:`TRACKER` - megatron's tracker file in a checkpoint root: the latest complete iteration.
* :data:`METADATA_KEY` - the common-state key of :mod:`gtp.checkpoint`'s ``gtp_layout`` record,
  and its format tags :data:`GTP_FORMAT_LOGICAL` / :data:`GTP_FORMAT_STOCK`.
* :data:`CHECKPOINT_LAYOUTS` - the values of ``gtp.checkpoint_layout``.

``docs/checkpoint-format.md`` describes the records.
"""

TRACKER = "latest_checkpointed_iteration.txt"
METADATA_KEY = "gtp_layout"
GTP_FORMAT_LOGICAL = "logical-v1"
GTP_FORMAT_STOCK = "stock-0.19.2"
CHECKPOINT_LAYOUTS = ("logical", "stock")
