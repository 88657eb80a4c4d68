"""``train.dry_run=true``: check a whole config for its world size and say what each rank holds.

Nothing heavy is built and no process starts: the config is validated (``recipes.validate``),
megatron's ``TransformerConfig`` is constructed (its own checks run), and the sizes come from
``recipes.shapes``. Per rank, with megatron's DDP (fp32 gradient buffer,
``grad_reduce_in_fp32``) and Adam without the distributed optimizer:

* parameters: ``params_dtype`` bytes each (GTP padding rows included: they are allocated);
* gradients: 4 bytes each (fp32 ``main_grad`` buffer);
* optimizer state: ``exp_avg`` and ``exp_avg_sq`` in fp32 (8 bytes), plus an fp32 main copy of
  each parameter (4 bytes) when parameters are bf16.

Activations and temporary buffers are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

_BYTES = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class RankSizes:
    """What one rank holds (every rank holds the same shapes at a given layout)."""

    total_parameters: int  # the whole model, padded vocabulary, no GTP padding
    parameters: int  # on one rank, GTP padding rows included
    gtp_padding_rows: int  # padding rows added to the TP-local GTP weights (shared by g ranks)
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int


def rank_sizes(cfg, layout, vocab_size: int) -> RankSizes:
    """Per-rank parameter count and bytes of ``cfg`` at ``layout`` for a ``vocab_size``-token
    tokenizer (padded as ``recipes.model.padded_vocab_size``)."""
    from recipes.model import padded_vocab_size
    from recipes.shapes import count, local_shape, parameter_shapes

    tp, g, pad = layout.tensor_model_parallel_size, layout.gtp_remat_size, layout.pad_for_alignment
    shapes = parameter_shapes(cfg.model, padded_vocab_size(
        vocab_size, cfg.model.make_vocab_size_divisible_by, tp))
    local, pad_rows = 0, 0
    for p in shapes:
        shape, pad_length = local_shape(p, tp, g, pad)
        n = 1
        for d in shape:
            n *= d
        local += n
        pad_rows += pad_length
    dtype = cfg.precision.params_dtype
    main_copy = 4 if dtype != "fp32" else 0
    return RankSizes(
        total_parameters=count(shapes), parameters=local, gtp_padding_rows=pad_rows,
        param_bytes=local * _BYTES[dtype], grad_bytes=local * 4,
        optimizer_bytes=local * (8 + main_copy),
    )


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def report(cfg, layout) -> str:
    """The dry-run text for ``cfg`` at ``layout`` (validated already).

    Raises:
        ValueError: megatron's ``TransformerConfig`` refuses the model config (its message).
    """
    from recipes.data import build_tokenizer
    from recipes.model import padded_vocab_size, transformer_config

    transformer_config(cfg, layout)  # megatron's own checks of the model fields
    vocab = build_tokenizer(cfg.data).vocab_size
    tp = layout.tensor_model_parallel_size
    padded = padded_vocab_size(vocab, cfg.model.make_vocab_size_divisible_by, tp)
    s = rank_sizes(cfg, layout, vocab)
    total = s.param_bytes + s.grad_bytes + s.optimizer_bytes
    lines = [
        "> dry run: config valid; nothing built, no process started",
        f"> layout: {layout.describe()}",
        f"> model: {cfg.model.name}, {s.total_parameters:,} parameters "
        f"(vocabulary {vocab:,} tokens, {padded:,} rows padded)",
        f"> per rank: {s.parameters:,} parameters",
        f">   parameters       {_gib(s.param_bytes)} ({cfg.precision.params_dtype})",
        f">   gradients        {_gib(s.grad_bytes)} (fp32 grad buffer)",
        f">   optimizer state  {_gib(s.optimizer_bytes)} (Adam moments fp32"
        f"{', fp32 main params' if cfg.precision.params_dtype != 'fp32' else ''})",
        f">   total            {_gib(total)} (activations not counted)",
    ]
    try:
        from recipes.data import check_data_paths

        check_data_paths(cfg.data)
    except (ValueError, FileNotFoundError) as exc:
        lines.append(f"> data not checked: {exc} (a real run refuses this before launch)")
    if layout.gtp_remat_size > 1:
        lines.append(
            f"> GTP: gtp_remat_size={layout.gtp_remat_size}, pad_for_alignment="
            f"{layout.pad_for_alignment}: {s.gtp_padding_rows:,} padding rows in the TP-local "
            f"GTP weights (a tail suffix, held by the last GTP ranks)")
    return "\n".join(lines)
