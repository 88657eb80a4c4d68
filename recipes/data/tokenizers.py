"""Tokenizers of the data pipeline: what megatron's ``GPTDataset`` reads from one.

* :class:`ByteTokenizer`: ids 0..255 are bytes (UTF-8 for text), 256 is ``<eod>``; 257 ids.
* :class:`ExternalTokenizer`: stands in for the tokenizer that made ``source=indexed`` data.
* :func:`build_tokenizer`: the tokenizer of a ``data`` config.
"""

from __future__ import annotations

from typing import Any, Iterable, Union

import numpy

SOURCES = ("pydoc", "text", "indexed", "mock")
TOKENIZERS = ("byte", "external")
# Megatron's "no pad token" id (megatron.core.datasets.megatron_dataset._PAD_TOKEN_ID,
# NullTokenizer's default pad_id): outside every vocabulary, so it never occurs in a corpus.
NO_PAD_ID = -1


class _TokenizerBase:
    """What megatron's GPTDataset reads from a tokenizer: ``vocab_size``, ``eod``, ``pad`` and a
    ``unique_identifiers`` dict (part of its index-cache key)."""

    vocab_size: int
    eod: int
    pad: int = NO_PAD_ID

    @property
    def unique_identifiers(self) -> dict:
        return {"class": type(self).__name__, "vocab_size": self.vocab_size, "eod": self.eod,
                "pad": self.pad}

    @property
    def eos(self) -> int:
        """Alias of ``eod`` (some megatron code asks for ``eos``)."""
        return self.eod


class ByteTokenizer(_TokenizerBase):
    """Bytes as tokens: ids 0..255 are the bytes of the UTF-8 text, ``eod`` = 256.

    ``vocab_size`` = 257 (the model pads it to ``make_vocab_size_divisible_by``).

    ``pad`` = -1 (megatron's "no pad token", as its ``NullTokenizer``), not ``eod``: megatron's
    ``GPTDataset`` zeroes the loss where ``labels == pad`` and rewrites ``tokens == pad`` to 0, so a pad
    equal to ``eod`` would hide every document end from the model (megatron detects that collision,
    warns and disables pad masking). Pretraining samples are never padded (the last partial sample is
    dropped); megatron's padding-only sample (index ``None``) gets an all-zero loss mask. So pad is
    excluded from the loss and never collides with data.
    """

    vocab_size: int = 257
    eod: int = 256

    def tokenize(self, text: Union[str, bytes]) -> list[int]:
        """UTF-8 bytes of ``text`` (or the given bytes) as ids in [0, 255]; no ``eod`` is added."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return list(data)

    def detokenize(self, ids: Iterable[int]) -> str:
        """The text of ``ids``: byte ids are decoded as UTF-8 (invalid sequences, e.g. a character
        cut at a sample boundary, become U+FFFD); ``eod`` and ``pad`` ids are dropped.

        Raises:
            ValueError: an id outside [0, 256] other than ``pad``.
        """
        out = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                out.append(i)
            elif i in (self.eod, self.pad):
                continue
            else:
                raise ValueError(f"id {i} is not a byte-tokenizer id: valid are 0..255 and eod=256")
        return out.decode("utf-8", errors="replace")

    def encode_bytes(self, data: bytes) -> numpy.ndarray:
        """``data`` as a uint16 id array (no ``eod``); the fast path used to write corpora."""
        return numpy.frombuffer(data, dtype=numpy.uint8).astype(numpy.uint16)


class ExternalTokenizer(_TokenizerBase):
    """Stand-in for the tokenizer that made ``source=indexed`` data: only what megatron's GPTDataset
    reads (``vocab_size``, ``eod``, ``pad`` = -1, ``unique_identifiers``). It cannot (de)tokenize."""

    def __init__(self, vocab_size: int, eod: int) -> None:
        if vocab_size < 1 or not 0 <= eod < vocab_size:
            raise ValueError(
                f"data.eod_id={eod} must lie in [0, data.vocab_size={vocab_size})"
            )
        self.vocab_size = int(vocab_size)
        self.eod = int(eod)

    def tokenize(self, text: str) -> list[int]:
        """Not available: raises NotImplementedError."""
        raise NotImplementedError("source=indexed data was tokenized outside gtp-recipes")

    def detokenize(self, ids: Iterable[int]) -> str:
        """Not available: raises NotImplementedError."""
        raise NotImplementedError("source=indexed data was tokenized outside gtp-recipes")


Tokenizer = Union[ByteTokenizer, ExternalTokenizer]


def build_tokenizer(data_cfg: Any) -> Tokenizer:
    """The tokenizer of ``data_cfg``: :class:`ByteTokenizer` for pydoc/text/mock, an
    :class:`ExternalTokenizer` from ``data.vocab_size`` / ``data.eod_id`` for indexed.

    Raises:
        ValueError: unknown ``data.source`` or ``data.tokenizer``; ``source=indexed`` with a null
            ``data.vocab_size`` or ``data.eod_id``; pydoc/text with ``tokenizer`` other than byte.
    """
    source = check_source(data_cfg)
    if source == "indexed":
        vocab_size, eod_id = data_cfg.vocab_size, data_cfg.eod_id
        for name, value in (("vocab_size", vocab_size), ("eod_id", eod_id)):
            if value is None:
                raise ValueError(
                    f"data.{name} is null: source=indexed needs data.vocab_size and data.eod_id "
                    f"of the tokenizer that made {list(data_cfg.paths)} (for data made with the "
                    f"byte tokenizer: vocab_size=257, eod_id=256)"
                )
        return ExternalTokenizer(int(vocab_size), int(eod_id))
    if source in ("pydoc", "text") and data_cfg.tokenizer != "byte":
        raise ValueError(
            f"data.tokenizer={data_cfg.tokenizer!r} with data.source={source!r}: gtp-recipes "
            f"converts text with the byte tokenizer only (valid: 'byte'); tokenize with your own "
            f"tokenizer into Megatron .bin/.idx files and use data=indexed instead"
        )
    return ByteTokenizer()


def check_source(data_cfg: Any) -> str:
    """``data.source``, after checking it and ``data.tokenizer`` against :data:`SOURCES` and
    :data:`TOKENIZERS` (ValueError naming the bad value and the valid ones)."""
    source = data_cfg.source
    if source not in SOURCES:
        raise ValueError(f"data.source={source!r}: valid are {SOURCES}")
    if data_cfg.tokenizer not in TOKENIZERS:
        raise ValueError(f"data.tokenizer={data_cfg.tokenizer!r}: valid are {TOKENIZERS}")
    return source
