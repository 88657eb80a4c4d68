"""Model families: one folder per family, registered once in :data:`FAMILIES`.

A family folder holds everything that makes the family: its config fields -> megatron's
``TransformerConfig``, its layer specs, the megatron module it builds, its parameter table (hence
its GTP weights and their TP-local dims), its Hugging Face mapping both ways and its stock-format
name patterns (``formats.py``, registered with ``gtp/`` under the entry-point group
``gtp.model_families``). ``docs/model-families.md`` says how to add one.
"""
