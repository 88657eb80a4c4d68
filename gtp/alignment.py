"""GTP ``pad_for_alignment``: resolve it from the recipe, apply it to megatron, verify it.

megatron-core 0.19.2 pads each GTP weight's TP-local dim 0 (L rows) to a multiple of
``a * g`` (a = ``GTP_CONFIG.pad_for_alignment``, g = gtp_remat size) before slicing it over the
``gtp_remat`` group; the padding is a tail suffix, so it lands on the last rank(s). ``a == 0``
means no padding, and then L must divide by g. The shard math itself is
:func:`gtp.shards.gtp_padding`; ``docs/checkpoint-format.md`` (Padding math) explains it.

0.19.2's ``configure_gtp_remat_from_recipe`` leaves bf16/fp32 at the dataclass default 16 and has
no override. Recipes here call, in this order::

    configure_gtp_remat_from_recipe(...)                 # megatron's hook
    apply_pad_for_alignment(resolve_pad_for_alignment(cfg.pad_for_alignment, cfg.quantization))
    model = build(...)
    check_pad_applied(model, pad)
"""

from __future__ import annotations

from collections.abc import Iterable

from gtp.shards import gtp_padding

# Recipe defaults: unquantized -> 1 (upstream's later bf16 default), else the 0.19.2 values.
RECIPE_DEFAULT_PAD: dict[str, int] = {"none": 1, "fp8": 16, "mxfp8": 32, "nvfp4": 16}


def _check_pad(pad, what="pad_for_alignment") -> int:
    if isinstance(pad, bool) or not isinstance(pad, int) or pad < 0:
        raise ValueError(f"{what} must be an integer >= 0 (0 = no padding); got {pad!r}")
    return pad


def resolve_pad_for_alignment(pad_for_alignment: int | None, quantization: str) -> int:
    """The alignment to use: an explicit value wins, ``None`` means the recipe default.

    Raises:
        ValueError: ``quantization`` is not one of :data:`RECIPE_DEFAULT_PAD`, or the pad is
            negative / not an integer.
    """
    if quantization not in RECIPE_DEFAULT_PAD:
        raise ValueError(
            f"unknown quantization recipe {quantization!r}; valid: {sorted(RECIPE_DEFAULT_PAD)}"
        )
    if pad_for_alignment is None:
        return RECIPE_DEFAULT_PAD[quantization]
    return _check_pad(pad_for_alignment)


def validate_gtp_dims(dim0_list: Iterable[int], g: int, pad: int) -> None:
    """Check before launch that every TP-local GTP dim 0 can be sharded over ``g`` ranks.

    Raises:
        ValueError: a negative pad, ``g < 1``, or ``pad == 0`` with dims not divisible by ``g``
            (all offending dims are named).
    """
    _check_pad(pad)
    if g < 1:
        raise ValueError(f"gtp_remat_size must be >= 1; got {g}")
    bad = []
    for dim0 in sorted(set(dim0_list)):
        try:
            gtp_padding(dim0, g, pad)
        except ValueError:
            bad.append(dim0)
    if bad:
        raise ValueError(
            f"pad_for_alignment=0 needs every GTP dim 0 divisible by gtp_remat_size={g}; "
            f"not divisible: {bad}. Use pad_for_alignment >= 1."
        )


def apply_pad_for_alignment(pad: int) -> None:
    """Set megatron's ``GTP_CONFIG.pad_for_alignment``.

    Call after ``configure_gtp_remat_from_recipe`` (which may overwrite it) and before the model
    is built (params are padded at construction).
    """
    from megatron.core.tensor_parallel.generalized_tensor_parallelism import update_gtp_config

    update_gtp_config(pad_for_alignment=_check_pad(pad))


def applied_pad_for_alignment() -> int:
    """megatron's ``GTP_CONFIG.pad_for_alignment`` as it is now: the one place that reads it
    back (the value megatron pads GTP weights with when they are built)."""
    from megatron.core.tensor_parallel.generalized_tensor_parallelism import GTP_CONFIG

    return int(GTP_CONFIG.pad_for_alignment)


def check_pad_applied(model, pad: int) -> int:
    """Verify every GTP param of ``model`` (a module or a list of chunks) is padded for ``pad``.

    Returns:
        The number of GTP params checked.

    Raises:
        RuntimeError: megatron's ``GTP_CONFIG.pad_for_alignment`` differs from ``pad``, a param's
            ``pad_length`` / shard size is not what ``pad`` gives, or the model has no GTP param.
    """
    from megatron.core.tensor_parallel.generalized_tensor_parallelism import is_gtp_param

    applied = applied_pad_for_alignment()
    if applied != pad:
        raise RuntimeError(
            f"GTP_CONFIG.pad_for_alignment is {applied}, expected {pad}: "
            "apply_pad_for_alignment must run after configure_gtp_remat_from_recipe"
        )
    checked = 0
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        for name, param in chunk.named_parameters():
            if not is_gtp_param(param):
                continue
            g = param.group.size()
            dim0 = param._unsharded_shape[0]
            want = gtp_padding(dim0, g, pad)
            got = (param.pad_length, param.shape[0])
            if got != want:
                raise RuntimeError(
                    f"GTP param {name} (TP-local dim 0 {dim0}, g={g}) has (pad_length, shard) "
                    f"{got}; pad_for_alignment={pad} gives {want}: the model was built with "
                    "another alignment"
                )
            checked += 1
    if not checked:
        raise RuntimeError("check_pad_applied: the model has no GTP-sharded parameter")
    return checked
