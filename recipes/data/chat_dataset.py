"""The samples of a cached chat dataset (:func:`recipes.data.chat.prepare_chat`'s
``{train,validation}.npz``): :class:`ChatDataset`, and a packed sample's ``position_ids``
restarting per conversation and its block-diagonal causal ``attention_mask``."""

from __future__ import annotations

import json
import os
from typing import Optional

import numpy


class ChatDataset:
    """``size`` samples of one split of a cached chat dataset, shuffled per epoch with
    ``numpy.random.RandomState(seed + epoch)`` (the order depends on the seed only, never on the
    layout). ``dataset[i]``: ``tokens``, ``labels``, ``position_ids`` int64 ``[s]``,
    ``loss_mask`` float32 ``[s]`` and, packed, ``attention_mask`` bool ``[1, s, s]`` (True:
    masked out)."""

    def __init__(self, out_dir: str, split: str, size: Optional[int], seed: int) -> None:
        self.out_dir = out_dir
        with numpy.load(os.path.join(out_dir, f"{split}.npz")) as z:
            self.arrays = {k: z[k] for k in z.files}
        with open(os.path.join(out_dir, "meta.json")) as f:
            self.packed = bool(json.load(f)["packing"])
        self.num_rows = int(self.arrays["tokens"].shape[0])
        self.size = self.num_rows if size is None else int(size)
        self.seed = int(seed)
        self._orders: dict[int, numpy.ndarray] = {}

    def __len__(self) -> int:
        return self.size

    def row(self, i: int) -> int:
        """The cached row of sample ``i``."""
        epoch, k = divmod(int(i), self.num_rows)
        if epoch not in self._orders:
            self._orders[epoch] = numpy.random.RandomState(self.seed + epoch).permutation(
                self.num_rows)
        return int(self._orders[epoch][k])

    def __getitem__(self, i: int) -> dict:
        import torch

        r = self.row(i)
        seg = torch.from_numpy(self.arrays["segments"][r].astype(numpy.int64))
        out = {key: torch.from_numpy(self.arrays[key][r].astype(numpy.int64))
               for key in ("tokens", "labels")}
        out["loss_mask"] = torch.from_numpy(self.arrays["loss_mask"][r].astype(numpy.float32))
        out["position_ids"] = position_ids(seg)
        if self.packed:
            out["attention_mask"] = attention_mask(seg)
        return out


def position_ids(segments):
    """Positions restarting at 0 at each new segment (int64 ``[s]``)."""
    import torch

    s = segments.numel()
    idx = torch.arange(s)
    starts = torch.ones(s, dtype=torch.bool)
    starts[1:] = segments[1:] != segments[:-1]
    first = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), 0).values
    return idx - first


def attention_mask(segments):
    """Block-diagonal causal mask ``[1, s, s]`` (True = masked out): position ``q`` sees ``k``
    when both lie in the same segment and ``k <= q``."""
    import torch

    s = segments.numel()
    same = segments[:, None] == segments[None, :]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    return (~(same & causal)).unsqueeze(0)
