"""Megatron's GPT datasets of a run (:func:`build_datasets`), built collectively.

Under ``torch.distributed`` global rank 0 builds the corpus and megatron's index caches
(``<cache_dir>/gpt_indices/<hash>-GPTDataset-train-*.npy``) first; the others then read them.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, Optional

import torch

from gtp.collectives import collective_device
from recipes.data import images
from recipes.data.chat import ChatDataset, prepare_chat
from recipes.data.corpus import (check_indexed_paths, check_text_paths, prepare_data,
                                 resolved_cache_dir, sequence_lengths)
from recipes.data.tokenizers import Tokenizer, build_tokenizer, check_source
from recipes.config.errors import ConfigError


def _dist_initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _rank0_first(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on global rank 0, then (after it succeeded) on the other ranks.

    A failure on rank 0 is broadcast, so the other ranks raise instead of waiting forever (a
    ConfigError for rank 0's refusal of its input: each rank then exits without a traceback).
    """
    if not _dist_initialized():
        return fn()
    dist = torch.distributed
    rank = dist.get_rank()
    result, error = None, None
    if rank == 0:
        try:
            result = fn()
        except Exception as err:  # re-raised below, after telling the other ranks
            error = err

    # 0: done; 1: failed; 2: refused its input (a ConfigError: the other ranks refuse too, so
    # none prints a traceback for what rank 0 says in one line)
    code = 0 if error is None else 2 if isinstance(error, ConfigError) else 1
    failed = torch.tensor([code], dtype=torch.int32, device=collective_device())
    dist.broadcast(failed, src=0)
    if rank == 0:
        if error is not None:
            raise error
        return result
    if int(failed.item()):
        # "failed on another rank": the launcher reports rank 0's error, not this consequence
        kind = ConfigError if int(failed.item()) == 2 else RuntimeError
        raise kind("the data preparation failed on another rank (global rank 0); its error is "
                   "in its log")
    return fn()


def _train_split_tokens(prefix: str, split: str) -> int:
    """Tokens in the train split of ``prefix``, split by documents exactly as megatron does."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix, parse_and_normalize_split)

    lengths = sequence_lengths(prefix)
    bounds = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))[0]
    if bounds is None:
        return 0
    beg = int(round(bounds[0] * float(lengths.size)))
    end = int(round(bounds[1] * float(lengths.size)))
    return int(lengths[beg:end].sum())


SPLIT_NAMES = ("train", "validation", "test")


def split_document_counts(num_documents: int, split: str) -> tuple[int, int, int]:
    """Documents of one prefix in each of megatron's train/valid/test splits.

    megatron splits whole documents: split ``i`` holds documents ``round(b0 * n)`` to
    ``round(b1 * n)`` for its normalized bounds ``(b0, b1)``
    (``BlendedMegatronDatasetBuilder._build_megatron_dataset_splits``); a weight of 0 gives 0.
    """
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix, parse_and_normalize_split)

    n = float(num_documents)
    bounds = convert_split_vector_to_split_matrix(parse_and_normalize_split(check_split(split)))
    return tuple(0 if b is None else int(round(b[1] * n)) - int(round(b[0] * n))
                 for b in bounds)


def check_split_documents(num_documents: int, split: str, validation: bool, what: str) -> None:
    """Refuse a ``data.split`` that leaves the train split, or (``validation``: eval_iters > 0)
    the validation split, without a document: megatron's ``GPTDataset`` would loop for ever
    looking for tokens in an empty split (``_get_num_epochs``).

    Raises:
        ValueError: naming the split, the document count and the overrides that work.
    """
    counts = split_document_counts(num_documents, split)
    empty = [i for i in ((0, 1) if validation else (0,)) if counts[i] == 0]
    if not empty:
        return
    name = SPLIT_NAMES[empty[0]]
    ways = []
    if empty == [1]:
        ways.append("train.eval_iters=0 (no validation)")
    for p in range(1, 100):
        trial = f"{100 - p},{p},0"
        c = split_document_counts(num_documents, trial)
        if c[0] > 0 and (c[1] > 0 or not validation):
            ways.append(f"data.split={trial.replace(',', '/')}")
            break
    ways.append("more documents (a .txt file is one document, a .jsonl line is one)")
    raise ValueError(
        f"data.split={str(split)!r} gives the {name} split none of the {num_documents} "
        f"document(s) of {what} (megatron splits whole documents); use " + ", or ".join(ways))


def check_split(split: Any) -> str:
    """``data.split`` after checking it holds up to 3 weights train,valid,test with train > 0
    (ValueError naming it and the form expected)."""
    split = str(split)
    parts = re.split(r"[,/]", split)
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        weights = None
    if (
        weights is None
        or not 1 <= len(weights) <= 3
        or any(w < 0 for w in weights)
        or weights[0] <= 0
    ):
        raise ValueError(
            f"data.split={split!r}: expected up to 3 comma-separated non-negative weights "
            f"train,valid,test with train > 0 (e.g. '98,2,0')"
        )
    return split


def build_datasets(
    cfg: Any, tokenizer: Tokenizer, train_samples: int, valid_samples: Optional[int] = None
) -> tuple[Any, Optional[Any], Optional[Any]]:
    """Megatron's train/valid/test GPT datasets for ``cfg`` (collective under torch.distributed).

    ``source=chat``: :class:`recipes.data.chat.ChatDataset` splits (train, validation, no test)
    of the cache :func:`recipes.data.chat.prepare_chat` builds; ``source=shapes``:
    :func:`recipes.data.images.build_datasets`. Otherwise prepares the corpus
    (:func:`prepare_data`) and builds ``GPTDataset`` splits (``MockGPTDataset`` for ``source=mock``) through ``BlendedMegatronDatasetBuilder`` with ``GPTDatasetConfig(
    random_seed=cfg.train.seed, sequence_length=cfg.model.seq_length, split=cfg.data.split,
    path_to_cache=<cache_dir>/gpt_indices)``, no position-id/attention-mask reset, no eod loss
    masking, no attention mask. Sizes: ``[train_samples, valid_samples, None]`` (a size of None:
    one epoch of that split; a larger size repeats epochs, as megatron does for any split). Several indexed prefixes are blended in proportion to their sizes (megatron's
    unweighted blend, which does not repeat data).

    With torch.distributed initialized, every rank of the default group must call this: global
    rank 0 builds the corpus and index caches first, then the others load them (megatron's builder
    barriers); ``is_built_on_rank`` is true on every rank, so each rank gets the datasets.

    Each sample (``dataset[i]``) is a dict of 1-D tensors of length ``seq_length``: ``tokens``,
    ``labels``, ``position_ids`` (int64) and ``loss_mask`` (float32).

    Args:
        cfg: the whole run config (``data``, ``model.seq_length``, ``train.seed``).
        tokenizer: from :func:`build_tokenizer`.
        train_samples: number of train samples wanted (``train_iters * global_batch_size``).
        valid_samples: number of validation samples wanted (``eval_iters * global_batch_size``),
            None for one epoch of the validation split.

    Returns:
        (train, valid, test): a split is ``None`` when its ``data.split`` weight is 0 (for
        ``source=mock`` megatron ignores ``data.split`` and splits its mock documents 1:1:1).

    Raises:
        ValueError: as :func:`prepare_data`; a malformed ``data.split``; ``train_samples`` < 1; a
            train split (or, with ``valid_samples``, a validation split) without a document; a
            train split with fewer than ``seq_length + 1`` tokens; a blend of several prefixes
            holding fewer than ``train_samples`` train samples.
        FileNotFoundError: as :func:`prepare_data`.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import \
        BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    data_cfg = cfg.data
    seq_length = int(cfg.model.seq_length)
    source = check_source(data_cfg)
    if source == "shapes":  # images with captions, drawn on the fly (no files, no index caches)
        return images.build_datasets(cfg, tokenizer, train_samples, valid_samples)
    if source == "chat":  # conversations, rendered, masked and packed once into the cache
        return _chat_datasets(cfg, tokenizer, train_samples, valid_samples)
    split = check_split(data_cfg.split)
    if int(train_samples) < 1:
        raise ValueError(f"train_samples={train_samples} must be >= 1")
    # Cheap checks on every rank before any collective, so a bad config fails everywhere alike.
    if source == "indexed":
        build_tokenizer(data_cfg)
        check_indexed_paths(data_cfg)
    elif source == "text":
        check_text_paths(data_cfg)

    prefixes = _rank0_first(lambda: prepare_data(data_cfg, seq_length))
    for prefix in prefixes:
        check_split_documents(sequence_lengths(prefix).size, split, bool(valid_samples), prefix)
        tokens = _train_split_tokens(prefix, split)
        if tokens < seq_length + 1:
            raise ValueError(
                f"the train part of {prefix} under data.split={split!r} holds {tokens} tokens, "
                f"fewer than model.seq_length + 1 = {seq_length + 1}: give train a larger share "
                f"or add text"
            )

    config = GPTDatasetConfig(
        random_seed=int(cfg.train.seed),
        sequence_length=seq_length,
        blend=(prefixes, None) if prefixes else None,
        split=split,
        path_to_cache=os.path.join(resolved_cache_dir(data_cfg), "gpt_indices"),
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    cls = MockGPTDataset if source == "mock" else GPTDataset
    builder = BlendedMegatronDatasetBuilder(
        cls, [int(train_samples), None if valid_samples is None else int(valid_samples), None],
        lambda: True, config
    )
    train, valid, test = builder.build()
    if len(train) < train_samples:
        raise ValueError(
            f"the train data holds {len(train)} samples of {seq_length} tokens, fewer than the "
            f"{train_samples} asked for (megatron does not repeat an unweighted blend of "
            f"{len(prefixes)} prefixes): lower train.train_iters or add data"
        )
    return train, valid, test


def _chat_datasets(cfg: Any, tokenizer: Tokenizer, train_samples: int,
                   valid_samples: Optional[int]) -> tuple[Any, Optional[Any], None]:
    """``data=chat``'s train and validation :class:`recipes.data.chat.ChatDataset` (rank 0
    builds the cache first)."""
    seq_length = int(cfg.model.seq_length)
    out_dir = _rank0_first(lambda: prepare_chat(cfg.data, seq_length, tokenizer.eod))
    seed = int(cfg.train.seed)
    train = ChatDataset(out_dir, "train", int(train_samples), seed)
    valid = ChatDataset(out_dir, "validation", valid_samples, seed)
    if valid.num_rows == 0:
        if valid_samples:
            raise ConfigError(f"train.eval_iters > 0 needs chat validation data: data.split="
                              f"{cfg.data.split!r} left none; set data.valid_paths=[...], give "
                              f"validation a share of data.split, or train.eval_iters=0")
        valid = None
    return train, valid, None
