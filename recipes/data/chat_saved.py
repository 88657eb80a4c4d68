"""Conversations from a dataset saved with the ``datasets`` library (``Dataset.save_to_disk`` /
``DatasetDict.save_to_disk``), for ``data=chat`` (:mod:`recipes.data.chat`).

Only a local directory is read, with ``datasets.load_from_disk`` (memory-mapped Arrow files;
nothing is downloaded: ``HF_DATASETS_OFFLINE`` is set before ``datasets`` is imported). A
``DatasetDict``'s split is chosen by ``data.chat_split`` (``data.paths``) or
``data.chat_valid_split`` (``data.valid_paths``). The directory's files (path, mtime, size)
key the cache, as a ``.jsonl`` file's do.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator

# What save_to_disk writes: a Dataset's state.json, a DatasetDict's dataset_dict.json.
DATASET_STATE = "state.json"
DATASET_DICT = "dataset_dict.json"


def is_saved_dataset(path: str) -> bool:
    """Whether ``path`` is a directory written by ``Dataset`` / ``DatasetDict.save_to_disk``."""
    return os.path.isdir(path) and any(
        os.path.isfile(os.path.join(path, name)) for name in (DATASET_STATE, DATASET_DICT))


def check_saved_dataset(path: str, split: str, where: str) -> None:
    """Refuse a directory that is not a saved dataset, or a ``DatasetDict`` without ``split``
    (ValueError naming ``where``, what was found and the fix)."""
    if not is_saved_dataset(path):
        raise ValueError(f"{where}: the directory {path} is not a dataset saved with the datasets "
                         f"library (no {DATASET_STATE} or {DATASET_DICT}); save one with "
                         f"dataset.save_to_disk(DIR), or give .jsonl files")
    splits = saved_splits(path)
    if splits is not None and split not in splits:
        raise ValueError(f"{where}: the DatasetDict in {path} has no split {split!r}; its splits "
                         f"are {splits} (set data.chat_split / data.chat_valid_split)")


def saved_splits(path: str) -> list[str] | None:
    """The splits of the ``DatasetDict`` saved in ``path`` (None: a single ``Dataset``)."""
    dict_file = os.path.join(path, DATASET_DICT)
    if not os.path.isfile(dict_file):
        return None
    with open(dict_file, encoding="utf-8") as f:
        splits = json.load(f).get("splits")
    return [str(s) for s in splits] if isinstance(splits, list) else []


def saved_rows(path: str, split: str) -> Iterator[tuple[int, Any]]:
    """``(index, row)`` of the saved dataset in ``path`` (its ``split`` for a ``DatasetDict``);
    none for a dataset saved without rows (no Arrow file, which ``load_from_disk`` cannot read).

    Raises:
        ValueError: ``load_from_disk`` cannot read it (damaged or another version's), named.
    """
    state = os.path.join(path, split if saved_splits(path) is not None else "", DATASET_STATE)
    if os.path.isfile(state):
        with open(state, encoding="utf-8") as f:
            if not json.load(f).get("_data_files"):
                return
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from datasets import DatasetDict, load_from_disk

    try:
        dataset = load_from_disk(path, keep_in_memory=False)
    except Exception as err:  # noqa: BLE001 - one line naming the dir, not datasets' traceback
        raise ValueError(f"{path}: datasets.load_from_disk cannot read it ({type(err).__name__}: "
                         f"{err}); save it again with save_to_disk, or give .jsonl files") from None
    if isinstance(dataset, DatasetDict):
        dataset = dataset[split]
    yield from enumerate(dataset)


def input_stats(path: str) -> list[list]:
    """What of ``path`` keys the cache: ``[path, mtime_ns, size]`` of the file, or of each
    file under the saved dataset directory, in name order."""
    if not os.path.isdir(path):
        st = os.stat(path)
        return [[path, st.st_mtime_ns, st.st_size]]
    out = []
    for root, dirs, names in os.walk(path):
        dirs.sort()
        for name in sorted(names):
            full = os.path.join(root, name)
            st = os.stat(full)
            out.append([full, st.st_mtime_ns, st.st_size])
    return out
