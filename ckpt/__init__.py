"""The checkpoint: its format (``format/``), megatron-core 0.19.2's padded files (``stock/``), one
save and one load (``io/``), what may differ between them (``adapt/``), Hugging Face import and
export (``hf/``), verification and the command line. Above ``gtp/``, below ``recipes/``, which it
never imports: the model families come in as values (:func:`ckpt.families.install`)."""
