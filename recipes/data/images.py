"""Image-caption data made here (``data.source=shapes``): each sample one coloured shape on a
dark background, drawn from its index and the run's seed, with the caption that describes it
("big red circle"). Nothing is downloaded; the same index gives the same sample on every rank,
in every run and at every layout.

A sample as megatron's ``LLaVAModel`` reads it (its ``_preprocess_data``): the text ``tokens``
are the image token (megatron's ``DEFAULT_IMAGE_TOKEN_INDEX``, -200), a newline prompt, the
caption's tokens and ``eod``, then ``eod`` padding; ``labels`` are the tokens shifted left;
``loss_mask`` is 1 where the label is a caption token or the closing ``eod``, so the loss is
on the caption only (megatron masks the image's positions itself).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

# megatron.core.models.multimodal.llava_model.DEFAULT_IMAGE_TOKEN_INDEX (a test checks they agree;
# not imported: this module loads without megatron).
IMAGE_TOKEN_INDEX = -200
PROMPT = "\n"
COLOURS = {"red": (1.0, 0.1, 0.1), "green": (0.1, 0.9, 0.2), "blue": (0.2, 0.3, 1.0),
           "yellow": (1.0, 0.9, 0.1), "magenta": (0.9, 0.1, 0.9), "cyan": (0.1, 0.9, 0.9),
           "white": (1.0, 1.0, 1.0)}
SHAPES = ("square", "circle", "triangle", "cross")
SIZES = {"small": 0.22, "big": 0.4}
# Stream ids of the splits: validation samples are other images than training ones.
SPLITS = {"train": 0, "validation": 1}


def draw(shape: str, colour: str, size: str, centre: tuple[float, float], h: int,
         w: int) -> torch.Tensor:
    """One image, float32 ``[3, h, w]`` in [-1, 1]: the shape (half-width ``SIZES[size]`` of
    the shorter side, centre ``(y, x)`` as fractions of the sides) in ``colour`` on -1.

    Raises:
        KeyError: an unknown shape, colour or size.
    """
    y, x = np.meshgrid((np.arange(h) + 0.5) / h, (np.arange(w) + 0.5) / w, indexing="ij")
    dy, dx, r = y - centre[0], x - centre[1], SIZES[size]
    inside = {"square": (abs(dy) <= r) & (abs(dx) <= r),
              "circle": dy ** 2 + dx ** 2 <= r ** 2,
              "triangle": (dy <= r) & (dy >= -r) & (abs(dx) <= (dy + r) / 2),
              "cross": ((abs(dy) <= r / 3) & (abs(dx) <= r)) | ((abs(dx) <= r / 3) & (abs(dy) <= r)),
              }[shape]
    image = np.full((3, h, w), -1.0, dtype=np.float32)
    for c, value in enumerate(COLOURS[colour]):
        image[c][inside] = 2.0 * value - 1.0
    return torch.from_numpy(image)


def check_seq_length(tokenizer: Any, seq_length: int) -> None:
    """Whether ``seq_length`` text tokens hold every sample: the image token, the prompt, the
    longest caption in ``tokenizer``'s tokens and ``eod``.

    Raises:
        ValueError: it does not (names the length needed).
    """
    longest = max(len(tokenizer.tokenize(f"{s} {c} {k}")) for s in SIZES for c in COLOURS
                  for k in SHAPES)
    if 3 + longest > int(seq_length):
        raise ValueError(f"model.seq_length={seq_length} holds no whole caption: the image "
                         f"token, the prompt, up to {longest} caption tokens and eod need "
                         f"model.seq_length >= {3 + longest}")


class ShapesDataset(torch.utils.data.Dataset):
    """``num_samples`` image-caption samples of one split.

    Sample ``i`` is drawn by a numpy generator seeded with ``(seed, split, i)``: shape, colour,
    size and centre. ``dataset[i]`` is a dict: ``images`` float32 ``[3, img_h, img_w]``;
    ``tokens``, ``labels``, ``position_ids`` int64 ``[seq_length]``; ``loss_mask`` float32
    ``[seq_length]`` (see the module docstring); ``caption`` (str).

    Raises:
        ValueError: ``seq_length`` too short for the image token, the prompt, a caption and
            ``eod``.
    """

    def __init__(self, tokenizer: Any, num_samples: int, seq_length: int, img_h: int,
                 img_w: int, seed: int, split: str = "train") -> None:
        self.tokenizer, self.num_samples = tokenizer, int(num_samples)
        self.seq_length, self.img_h, self.img_w = int(seq_length), int(img_h), int(img_w)
        self.seed, self.split = int(seed), SPLITS[split]
        check_seq_length(tokenizer, self.seq_length)

    def __len__(self) -> int:
        return self.num_samples

    def describe(self, i: int) -> tuple[str, str, str, tuple[float, float]]:
        """``(size, colour, shape, centre)`` of sample ``i``."""
        rng = np.random.default_rng([self.seed, self.split, int(i)])
        size = sorted(SIZES)[rng.integers(len(SIZES))]
        colour = sorted(COLOURS)[rng.integers(len(COLOURS))]
        shape = SHAPES[rng.integers(len(SHAPES))]
        margin = SIZES[size]
        centre = tuple(float(v) for v in rng.uniform(margin, 1.0 - margin, size=2))
        return size, colour, shape, centre

    def __getitem__(self, i: int) -> dict:
        if not 0 <= int(i) < self.num_samples:
            raise IndexError(f"sample {i} of {self.num_samples}")
        size, colour, shape, centre = self.describe(i)
        caption = f"{size} {colour} {shape}"
        tok = self.tokenizer
        text = [IMAGE_TOKEN_INDEX, *tok.tokenize(PROMPT), *tok.tokenize(caption), tok.eod]
        tokens = torch.full((self.seq_length,), tok.eod, dtype=torch.int64)
        tokens[:len(text)] = torch.tensor(text)
        labels = torch.full((self.seq_length,), tok.eod, dtype=torch.int64)
        labels[:-1] = tokens[1:]
        loss_mask = torch.zeros(self.seq_length, dtype=torch.float32)
        # Position j predicts tokens[j + 1]: from the prompt's last token (-> the caption's
        # first) to the caption's last (-> eod).
        loss_mask[len(tok.tokenize(PROMPT)):len(text) - 1] = 1.0
        return {"images": draw(shape, colour, size, centre, self.img_h, self.img_w),
                "tokens": tokens, "labels": labels, "loss_mask": loss_mask,
                "position_ids": torch.arange(self.seq_length, dtype=torch.int64),
                "caption": caption}


def build_datasets(cfg: Any, tokenizer: Any, train_samples: int,
                   valid_samples: Optional[int] = None) -> tuple:
    """``(train, validation or None, None)`` :class:`ShapesDataset` s of ``cfg`` (``train.seed``,
    ``model.seq_length``, ``model.img_h`` / ``img_w``); nothing to build on disk, so nothing
    collective. ``valid_samples`` None: no validation split."""
    m, seed = cfg.model, int(cfg.train.seed)

    def split(n, name):
        return ShapesDataset(tokenizer, n, m.seq_length, m.img_h, m.img_w, seed, name)

    valid = split(valid_samples, "validation") if valid_samples else None
    return split(train_samples, "train"), valid, None
