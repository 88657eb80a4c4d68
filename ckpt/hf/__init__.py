"""Hugging Face model dirs to logical checkpoints and back, by the families' formats (:mod:`ckpt.families`)."""
