"""Micro-batches for one data-parallel rank, sampled like Megatron-LM's
``MegatronPretrainingSampler`` and resumable from ``consumed_samples`` under any data-parallel
size (:class:`PretrainingSampler`, :func:`build_train_iterator`)."""

from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence

import torch

from recipes.data.datasets import build_datasets
from recipes.data.tokenizers import Tokenizer, build_tokenizer

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")
# Also stacked when the samples have them: a vision-language model's images
# (recipes.data.images, float32 [3, h, w] each).
IMAGE_KEY = "images"
# Also stacked when the samples have it: packed chat samples' block-diagonal causal mask
# (recipes.data.chat, bool [1, s, s], True = masked out).
MASK_KEY = "attention_mask"


class PretrainingSampler:
    """Index lists of micro-batches for one data-parallel rank, Megatron-LM style.

    Global batch ``b`` covers samples ``[b * gbs, (b + 1) * gbs)`` whatever ``dp_size`` is; rank
    ``r`` reads the contiguous slice ``[b * gbs + r * gbs / dp, b * gbs + (r + 1) * gbs / dp)`` of it
    as ``gbs / (mbs * dp)`` micro-batches of ``mbs`` consecutive indices. Iteration starts at global
    batch ``consumed_samples / gbs`` and stops before a global batch that would pass
    ``total_samples`` (megatron's drop_last). Like ``MegatronPretrainingSampler`` the samples of a
    global batch depend only on ``consumed_samples``; unlike it the micro-batches are not
    interleaved across ranks (rank r's micro-batch k is not ``b*gbs + (k*dp + r)*mbs``), so
    concatenating the ranks' micro-batches in rank order gives the global batch in order.

    Raises:
        ValueError: sizes < 1, ``dp_rank`` outside ``[0, dp_size)``, ``global_batch_size`` not a
            multiple of ``micro_batch_size * dp_size``, ``consumed_samples`` negative or not a
            multiple of ``global_batch_size``.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
    ) -> None:
        for name, value in (
            ("micro_batch_size", micro_batch_size),
            ("global_batch_size", global_batch_size),
            ("dp_size", dp_size),
        ):
            if int(value) < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must lie in [0, dp_size={dp_size})")
        per_step = micro_batch_size * dp_size
        if global_batch_size % per_step != 0:
            raise ValueError(
                f"global_batch_size={global_batch_size} is not a multiple of micro_batch_size="
                f"{micro_batch_size} x dp_size={dp_size} (= {per_step})"
            )
        if consumed_samples < 0 or consumed_samples % global_batch_size != 0:
            raise ValueError(
                f"consumed_samples={consumed_samples} must be a non-negative multiple of "
                f"global_batch_size={global_batch_size}"
            )
        self.total_samples = int(total_samples)
        self.consumed_samples = int(consumed_samples)
        self.micro_batch_size = int(micro_batch_size)
        self.global_batch_size = int(global_batch_size)
        self.dp_rank = int(dp_rank)
        self.dp_size = int(dp_size)
        self.num_microbatches = global_batch_size // per_step

    def __len__(self) -> int:
        """Number of micro-batches this rank will yield."""
        steps = max(0, self.total_samples // self.global_batch_size - self.start_step)
        return steps * self.num_microbatches

    @property
    def start_step(self) -> int:
        """Index of the first global batch (= iterations already done)."""
        return self.consumed_samples // self.global_batch_size

    def __iter__(self) -> Iterator[list[int]]:
        gbs, mbs = self.global_batch_size, self.micro_batch_size
        per_rank = gbs // self.dp_size
        step = self.start_step
        while (step + 1) * gbs <= self.total_samples:
            base = step * gbs + self.dp_rank * per_rank
            for k in range(self.num_microbatches):
                start = base + k * mbs
                yield list(range(start, start + mbs))
            step += 1


def collate(samples: Sequence[dict]) -> dict[str, torch.Tensor]:
    """Stack per-sample dicts into a micro-batch: ``tokens``, ``labels``, ``position_ids`` int64
    ``[b, s]``, ``loss_mask`` float32 ``[b, s]`` and, when the samples have them, ``images``
    float32 ``[b, 3, h, w]`` and ``attention_mask`` bool ``[b, 1, s, s]`` (other keys are
    dropped)."""
    keys = BATCH_KEYS + tuple(k for k in (IMAGE_KEY, MASK_KEY) if k in samples[0])
    return {key: torch.stack([s[key] for s in samples]) for key in keys}


class MicroBatchIterator:
    """Iterator over the micro-batches of one data-parallel rank (dicts from :func:`collate`).

    Attributes: ``dataset``, ``sampler`` (:class:`PretrainingSampler`), ``num_microbatches`` (per
    iteration), ``tokenizer``. Ends (StopIteration) when the dataset holds no further full global
    batch.
    """

    def __init__(self, dataset: Any, sampler: PretrainingSampler, tokenizer: Any = None) -> None:
        self.dataset = dataset
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.num_microbatches = sampler.num_microbatches
        self._indices = iter(sampler)

    def __iter__(self) -> "MicroBatchIterator":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        indices = next(self._indices)
        return collate([self.dataset[i] for i in indices])

    def __len__(self) -> int:
        return len(self.sampler)


def build_train_iterator(
    cfg: Any,
    consumed_samples: int,
    dp_rank: int,
    dp_size: int,
    tokenizer: Optional[Tokenizer] = None,
    plan: Optional[Sequence[int]] = None,
) -> MicroBatchIterator:
    """Micro-batches of the train split for data-parallel rank ``dp_rank`` of ``dp_size``.

    Builds the tokenizer and datasets (:func:`build_datasets` with ``train_samples =
    train.train_iters * data.global_batch_size``; collective under torch.distributed) and samples
    them with :class:`PretrainingSampler` from ``consumed_samples``. Each iteration of training
    takes ``iterator.num_microbatches = global_batch_size / (micro_batch_size * dp_size)``
    micro-batches. Resuming from ``consumed_samples`` under any ``dp_size`` continues with exactly
    the same samples, as long as ``train.seed``, ``train.train_iters``, ``model.seq_length`` and
    the data are unchanged (they define megatron's shuffle, as in Megatron-LM).

    Each micro-batch is a dict: ``tokens``, ``labels``, ``position_ids``: int64
    ``[micro_batch_size, seq_length]``; ``loss_mask``: float32 ``[micro_batch_size, seq_length]``.

    ``tokenizer``: the one from :func:`build_tokenizer` when the caller already has it (else built
    here from ``cfg.data``).

    ``plan``: sample counts of consecutive data segments (default: one segment of
    ``train_iters * global_batch_size``). Segment ``k`` is a dataset of that many samples built
    with seed ``train.seed + k``; a run extended on resume appends a segment, so the samples
    planned before keep their order (a larger first segment would reshuffle them).

    Raises:
        ValueError: as :class:`PretrainingSampler` (with the numbers) and :func:`build_datasets`.
        FileNotFoundError: as :func:`prepare_data`.
    """
    return build_iterators(cfg, consumed_samples, dp_rank, dp_size, tokenizer, plan)[0]


class ValidationBatches:
    """The validation set of a run: the first ``eval_iters`` global batches of megatron's
    validation split, read by data-parallel rank ``dp_rank`` of ``dp_size`` exactly as training
    reads a global batch (:class:`PretrainingSampler` from sample 0).

    Every evaluation reads the same batches, so validation losses at different iterations, in
    a resumed run or at another layout are comparable (Megatron-LM instead moves on through the
    split from one evaluation to the next). ``iter(self)`` starts a fresh pass: ``eval_iters *
    num_microbatches`` micro-batches as :func:`collate` returns them.
    """

    def __init__(self, dataset: Any, eval_iters: int, micro_batch_size: int,
                 global_batch_size: int, dp_rank: int, dp_size: int) -> None:
        if len(dataset) < eval_iters * global_batch_size:
            raise ValueError(
                f"the validation split holds {len(dataset)} samples, fewer than train.eval_iters="
                f"{eval_iters} x data.global_batch_size={global_batch_size}: lower "
                f"train.eval_iters or give validation a larger share of data.split"
            )
        self.dataset = dataset
        self.eval_iters = int(eval_iters)
        self._sampler_args = (eval_iters * global_batch_size, 0, micro_batch_size,
                              global_batch_size, dp_rank, dp_size)
        self.num_microbatches = PretrainingSampler(*self._sampler_args).num_microbatches

    def __iter__(self) -> MicroBatchIterator:
        return MicroBatchIterator(self.dataset, PretrainingSampler(*self._sampler_args))

    def __len__(self) -> int:
        return self.eval_iters * self.num_microbatches


def build_iterators(
    cfg: Any,
    consumed_samples: int,
    dp_rank: int,
    dp_size: int,
    tokenizer: Optional[Tokenizer] = None,
    plan: Optional[Sequence[int]] = None,
) -> tuple[MicroBatchIterator, Optional[ValidationBatches]]:
    """The train iterator (as :func:`build_train_iterator`) and the validation set
    (:class:`ValidationBatches`, None when ``train.eval_iters`` is 0 or absent), from one build
    of megatron's datasets (``valid_samples = eval_iters * global_batch_size``; collective under
    torch.distributed). ``plan``: as :func:`build_train_iterator`; the validation set comes from
    the first segment's build (seed ``train.seed``), so it does not change when a run is extended.

    Raises:
        ValueError: as :func:`build_train_iterator`; ``eval_iters`` > 0 with no validation split
            (its ``data.split`` weight is 0) or one too small.
    """
    data_cfg = cfg.data
    mbs, gbs = int(data_cfg.micro_batch_size), int(data_cfg.global_batch_size)
    plan = [int(cfg.train.train_iters) * gbs] if not plan else [int(n) for n in plan]
    train_samples = sum(plan)
    eval_iters = int(cfg.train.get("eval_iters", 0) or 0)
    # Validate the batch sizes and ranks before building anything (raises the same on every rank).
    PretrainingSampler(train_samples, consumed_samples, mbs, gbs, dp_rank, dp_size)
    if tokenizer is None:
        tokenizer = build_tokenizer(data_cfg)
    valid_samples = eval_iters * gbs if eval_iters else None
    if len(plan) == 1:
        train, valid, _ = build_datasets(cfg, tokenizer, train_samples, valid_samples)
    else:
        from omegaconf import OmegaConf

        parts, valid = [], None
        for k, n in enumerate(plan):
            segment_cfg = OmegaConf.merge(cfg, {"train": {"seed": int(cfg.train.seed) + k}})
            part, segment_valid, _ = build_datasets(segment_cfg, tokenizer, n,
                                                    valid_samples if k == 0 else None)
            if k == 0:
                valid = segment_valid
            parts.append(torch.utils.data.Subset(part, range(n)))
        train = torch.utils.data.ConcatDataset(parts)
    sampler = PretrainingSampler(len(train), consumed_samples, mbs, gbs, dp_rank, dp_size)
    validation = None
    if eval_iters:
        if valid is None:
            raise ValueError(f"train.eval_iters={eval_iters} needs a validation split: data.split="
                             f"{data_cfg.split!r} gives it weight 0 (e.g. '98,2,0'; or set "
                             f"train.eval_iters=0)")
        validation = ValidationBatches(valid, eval_iters, mbs, gbs, dp_rank, dp_size)
    return MicroBatchIterator(train, sampler, tokenizer), validation
