"""``.metadata``'s chunk check (``gtp verify`` and every verified load): a tensor's chunks cover
it exactly once, found in O(n log n) of the chunks, and a tensor listing more chunks than the
checkpoint stores records is one problem, not one per chunk. Crafted ``Metadata``, no save."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)

from ckpt import verify
from ckpt.format.safe_metadata import tiling_problems



def _chunks(boxes):
    return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(e)) for o, e in boxes]


def _metadata(size, boxes, records=None) -> Metadata:
    """One tensor of ``size`` in ``boxes`` (offsets, sizes), each with a stored record (the
    first ``records`` only, when given) in ``__0_0.distcp``."""
    chunks = _chunks(boxes)
    item = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(size), chunks)
    stored = chunks if records is None else chunks[:records]
    storage = {MetadataIndex("w", c.offsets): _StorageInfo("__0_0.distcp", i, 1)
               for i, c in enumerate(stored)}
    return Metadata(state_dict_metadata={"w": item}, storage_data=storage)


def _check(tmp_path, size, boxes, records=None):
    (tmp_path / "__0_0.distcp").touch()
    return verify.check_metadata(tmp_path, _metadata(size, boxes, records))


def _lines_run(tmp_path, size, boxes) -> int:
    """How many lines of ``ckpt/`` the check of one tensor of ``boxes`` executes (Python's line
    trace events): a count of the work done, the same on every machine, unlike a time."""
    import sys
    from pathlib import Path

    import ckpt

    root = str(Path(ckpt.__file__).parent)
    count = 0

    def trace(frame, event, arg):
        nonlocal count
        if not frame.f_code.co_filename.startswith(root):
            return None
        if event == "line":
            count += 1
        return trace

    sys.settrace(trace)
    try:
        problems = _check(tmp_path, size, boxes)
    finally:
        sys.settrace(None)
    assert problems == []
    return count


def test_thousands_of_chunks_along_one_row_check_in_n_log_n(tmp_path):
    """One tensor of N (1, 1) chunks side by side in a (1, N) row, the issue's case (8000 of
    them took 143 s: each chunk was compared with every one before it). Four times the chunks
    cost about four times the lines executed (n log n: 4.9x from 500 to 2000), where comparing
    every pair costs sixteen times; and the row costs what the same chunks stacked in an
    (N, 1) column cost."""
    def row(n):
        return _lines_run(tmp_path, (1, n), [((0, i), (1, 1)) for i in range(n)])

    small, large = row(500), row(2000)
    assert large < 8 * small, (small, large)
    column = _lines_run(tmp_path, (2000, 1), [((i, 0), (1, 1)) for i in range(2000)])
    assert large < 2 * column, (large, column)


@pytest.mark.parametrize("size, boxes, overlap", [
    ((1, 6), [((0, 0), (1, 3)), ((0, 2), (1, 1)), ((0, 4), (1, 2))], ((0, 0), (0, 2))),
    ((4, 4), [((0, 0), (2, 4)), ((2, 0), (2, 2)), ((1, 2), (2, 2)), ((3, 2), (1, 2))], None),
    ((4, 4), [((0, 0), (2, 2)), ((0, 2), (2, 2)), ((2, 0), (2, 3)), ((2, 3), (2, 1)),
              ((1, 1), (1, 1))], None),
    ((2, 2, 2), [((0, 0, 0), (2, 1, 1)), ((0, 1, 0), (2, 1, 2)), ((1, 0, 0), (1, 1, 2))],
     ((0, 0, 0), (1, 0, 0))),
])
def test_an_overlap_is_named(size, boxes, overlap):
    problems = tiling_problems(size, _chunks(boxes))
    if overlap is None:  # the element count differs: named first
        assert len(problems) == 1 and "elements" in problems[0], problems
    else:
        assert problems == [f"the chunks at {overlap[0]} and {overlap[1]} overlap"], problems


def test_the_sweep_agrees_with_counting_every_element():
    """Random chunks of small 1-, 2- and 3-dim tensors with the tensor's element count: an
    overlap is reported exactly when some element is covered twice."""
    rng = random.Random(59)
    seen = set()
    for _ in range(4000):
        size = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 3)))
        boxes = []
        for _ in range(rng.randint(1, 6)):
            o = tuple(rng.randrange(d) for d in size)
            boxes.append((o, tuple(rng.randint(1, d - a) for a, d in zip(o, size))))
        if sum(math.prod(e) for _, e in boxes) != math.prod(size):
            continue
        cells = [p for o, e in boxes
                 for p in itertools.product(*(range(a, a + n) for a, n in zip(o, e)))]
        twice = len(cells) != len(set(cells))
        assert bool(tiling_problems(size, _chunks(boxes))) == twice, (size, boxes)
        seen.add((len(size), twice))
    assert seen == {(d, t) for d in (1, 2, 3) for t in (False, True)}, seen


def test_more_chunks_than_stored_records_is_one_problem(tmp_path):
    n = 2000
    problems = _check(tmp_path, (1, n), [((0, i), (1, 1)) for i in range(n)], records=3)
    assert [p.what for p in problems] == [
        f"has {n} chunks, more than the 3 stored records of the whole checkpoint"], problems
