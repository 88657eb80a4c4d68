"""The model of a run around its family (``recipes/families/``): building it (``build.py``),
parameter shapes without building (``shapes.py``), TransformerEngine or not (``te.py``), GTP's
hooks (``gtp_setup.py``), MoE (``moe.py``), multi-token prediction (``mtp.py``) and context
parallelism (``context_parallel.py``)."""
