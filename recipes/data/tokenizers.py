"""Tokenizers of the data pipeline: what megatron's ``GPTDataset`` reads from one.

* :class:`ByteTokenizer`: ids 0..255 are bytes (UTF-8 for text), 256 is ``<eod>``; 257 ids.
* :class:`ExternalTokenizer`: stands in for the tokenizer that made ``source=indexed`` data.
* :class:`HFTokenizer`: a local Hugging Face ``tokenizer.json`` (file, or a directory holding
  one), through the ``tokenizers`` library; the vocabulary size comes from the tokenizer.
* :func:`build_tokenizer`: the tokenizer of a ``data`` config.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Iterable, Optional, Union

import numpy

from ckpt.hf.hf_import import HFImportError, check_no_remote_code
# End-of-document tokens looked up in a Hugging Face tokenizer when data.eod_id is null.
from ckpt.hf.tokens import EOD_TOKENS
from recipes.config.errors import ConfigError

SOURCES = ("pydoc", "text", "indexed", "mock", "shapes", "chat")
# Named tokenizers; any other data.tokenizer value is a path to a Hugging Face tokenizer.json.
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
    # Short name in corpus cache folder names.
    name: str = "external"

    @property
    def dtype(self):
        """numpy dtype of token ids in a corpus: uint16 when every id fits, else int32."""
        return numpy.uint16 if self.vocab_size <= 65536 else numpy.int32

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
    name = "byte"

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


class HFTokenizer(_TokenizerBase):
    """A Hugging Face ``tokenizer.json`` read with the ``tokenizers`` library.

    ``vocab_size``: the tokenizer's, added tokens included; ``eod``: ``eod_id`` when given, else
    the first of :data:`EOD_TOKENS` the tokenizer knows. The ids of a document are its text's
    encoding without added special tokens.

    Raises:
        FileNotFoundError: ``path`` is neither a ``tokenizer.json`` nor a directory holding one.
        ValueError: the file cannot be read as a tokenizer, its dir's
            ``tokenizer_config.json`` has an ``auto_map`` (a tokenizer class in the dir's own
            code), no end-of-document token is known and ``eod_id`` is null, or ``eod_id`` lies
            outside the vocabulary.
    """

    name = "hf"

    def __init__(self, path: str, eod_id: Optional[int] = None) -> None:
        from tokenizers import Tokenizer as _HF

        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            if not os.path.exists(path) and not looks_like_path(path):
                raise FileNotFoundError(
                    f"data.tokenizer={path!r} is not a local file or directory: only local files "
                    f"work offline (nothing is downloaded). Give a Hugging Face model dir holding "
                    f"tokenizer.json, a tokenizer.json file, or one of {TOKENIZERS}")
            raise FileNotFoundError(
                f"data.tokenizer={path!r}: no such tokenizer.json file or directory holding one "
                f"(valid: {TOKENIZERS} or a path to a Hugging Face tokenizer.json)")
        self.file = os.path.abspath(file)
        try:  # a dir made for transformers' remote code: never handed on (exports copy it)
            check_no_remote_code(self.file, f"data.tokenizer={path!r}")
        except HFImportError as exc:
            raise ValueError(str(exc)) from None
        try:
            self._tok = _HF.from_file(self.file)
        except Exception as exc:  # noqa: BLE001 - the library's parse errors
            raise ValueError(f"data.tokenizer={path!r}: {self.file} is not a Hugging Face "
                             f"tokenizer.json ({exc})") from None
        with open(self.file, "rb") as f:
            self.sha256 = hashlib.sha256(f.read()).hexdigest()
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        if eod_id is None:
            known = [t for t in EOD_TOKENS if self._tok.token_to_id(t) is not None]
            if not known:
                raise ValueError(f"data.tokenizer={path!r} has none of the end-of-document "
                                 f"tokens {EOD_TOKENS}: set data.eod_id")
            eod_id = self._tok.token_to_id(known[0])
        if not 0 <= int(eod_id) < self.vocab_size:
            raise ValueError(f"data.eod_id={eod_id} must lie in [0, {self.vocab_size}) "
                             f"(the vocabulary of {self.file})")
        self.eod = int(eod_id)

    @property
    def unique_identifiers(self) -> dict:
        return {**super().unique_identifiers, "sha256": self.sha256}

    def tokenize(self, text: str) -> list[int]:
        """Ids of ``text`` (no special tokens added)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` (special tokens skipped)."""
        return self._tok.decode([int(i) for i in ids])

    def encode_bytes(self, data: bytes) -> numpy.ndarray:
        """A UTF-8 document's ids as a :attr:`dtype` array (no ``eod``)."""
        return numpy.asarray(self.tokenize(data.decode("utf-8", errors="replace")), dtype=self.dtype)


Tokenizer = Union[ByteTokenizer, ExternalTokenizer, HFTokenizer]


def looks_like_path(name: str) -> bool:
    """Whether ``name`` is written as a path (a separator, or starting with ``.`` or ``~``)
    rather than a hub name such as ``gpt2``. (``org/model`` hub names hold a separator too: an
    absent path is refused either way, this only picks the message.)"""
    return os.sep in name or name.startswith((".", "~")) or name.endswith(".json")


def check_before_launch(data_cfg: Any) -> None:
    """Build the run's tokenizer once before any process starts, so a bad ``data.tokenizer``
    (a hub name, a missing file) is one error line rather than a traceback per rank.

    Raises:
        recipes.config.validate.ConfigError: with :func:`build_tokenizer`'s message.
    """
    try:
        build_tokenizer(data_cfg)
    except (ValueError, OSError) as exc:
        raise ConfigError(str(exc)) from None


def is_tokenizer_path(name: str) -> bool:
    """Whether ``data.tokenizer`` names a file or directory rather than a named tokenizer."""
    return name not in TOKENIZERS


def build_tokenizer(data_cfg: Any) -> Tokenizer:
    """The tokenizer of ``data_cfg``: :class:`HFTokenizer` when ``data.tokenizer`` is a path (any
    source), else :class:`ByteTokenizer` for pydoc/text/mock and an :class:`ExternalTokenizer`
    from ``data.vocab_size`` / ``data.eod_id`` for indexed.

    Raises:
        ValueError: unknown ``data.source``; ``source=indexed`` with a null ``data.vocab_size``
            or ``data.eod_id``; pydoc/text with ``tokenizer=external``; a path tokenizer whose
            vocabulary differs from a set ``data.vocab_size`` (or that cannot be read).
        FileNotFoundError: ``data.tokenizer`` is neither a named tokenizer nor an existing path.
    """
    source = check_source(data_cfg)
    if is_tokenizer_path(data_cfg.tokenizer):
        tok = _hf_tokenizer(str(data_cfg.tokenizer), data_cfg.eod_id)
        if data_cfg.vocab_size is not None and int(data_cfg.vocab_size) != tok.vocab_size:
            raise ValueError(f"data.vocab_size={data_cfg.vocab_size} differs from the "
                             f"{tok.vocab_size} tokens of {tok.file}: set it to null")
        return tok
    if source == "chat":
        if data_cfg.vocab_size is not None and data_cfg.eod_id is not None:
            # A stand-in sizing the model (a recipe's dry run); reading chat data needs the
            # directory (recipes.data.chat.chat_template refuses before launch).
            return ExternalTokenizer(int(data_cfg.vocab_size), int(data_cfg.eod_id))
        raise ValueError(f"data.tokenizer={data_cfg.tokenizer!r} with data.source='chat': "
                         f"conversations are rendered with a Hugging Face tokenizer's chat "
                         f"template; set data.tokenizer=<its directory>")
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
            f"data.tokenizer={data_cfg.tokenizer!r} with data.source={source!r}: text is "
            f"tokenized with 'byte' or a Hugging Face tokenizer.json (data.tokenizer=<path>)"
        )
    return ByteTokenizer()


_HF_BUILT: dict = {}


def _hf_tokenizer(path: str, eod_id: Optional[int]) -> HFTokenizer:
    """:class:`HFTokenizer` of ``path``, read once per process while its file is unchanged: the
    launcher's checks, the host-memory check and the dry run each ask for it (a large
    ``tokenizer.json`` takes a second or more to parse)."""
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    try:
        st = os.stat(file)
    except OSError:
        return HFTokenizer(path, eod_id)  # its own message
    key = (os.path.abspath(file), st.st_mtime_ns, st.st_size, st.st_ino, eod_id)
    if key not in _HF_BUILT:
        _HF_BUILT.clear()  # one tokenizer a run: keep only the latest
        _HF_BUILT[key] = HFTokenizer(path, eod_id)
    return _HF_BUILT[key]


def check_source(data_cfg: Any) -> str:
    """``data.source``, after checking it against :data:`SOURCES` (ValueError naming the bad value
    and the valid ones); ``data.tokenizer`` is checked by :func:`build_tokenizer`."""
    source = data_cfg.source
    if source not in SOURCES:
        raise ValueError(f"data.source={source!r}: valid are {SOURCES}")
    return source
