"""The reader of the padded vocab a saved run config gives, which gtp-recipes gives to ``ckpt/``
with each family's formats (``recipes/families/<name>/formats.py``; :func:`ckpt.families.install`,
called once when :mod:`recipes.families` is imported).

Cheap to import (no megatron, no Hydra, no torch): the ``gtp`` command line loads it.
"""

from __future__ import annotations

from recipes.model.shapes import padded_vocab_size


def padded_vocab_of_config(cfg, tp: int) -> int:
    """Padded vocab rows of a saved run config (a plain mapping with ``data`` and ``model``) at
    tensor-parallel size ``tp``: the tokenizer's vocab padded by :func:`padded_vocab_size`.

    Given to ``ckpt/`` as its run-config vocab reader (:func:`ckpt.families.install`), through
    which ``ckpt.stock`` learns the vocab of a checkpoint that records only its run config.

    Raises:
        KeyError, ValueError: ``cfg`` is not a gtp-recipes run config.
    """
    from omegaconf import OmegaConf

    from recipes.data import build_tokenizer

    vocab = build_tokenizer(OmegaConf.create(dict(cfg["data"]))).vocab_size
    return padded_vocab_size(vocab, int(cfg["model"]["make_vocab_size_divisible_by"]), tp)
