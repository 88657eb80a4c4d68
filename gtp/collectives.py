"""The device a collective's tensors must live on, by the backend of its process group.

NCCL reduces only CUDA tensors (of the current device); gloo only CPU tensors. Every tensor that
this project creates for a collective is placed with :func:`collective_device`, so the same code
runs under gloo on CPU and under NCCL on GPUs. Object collectives (``broadcast_object_list``,
``all_gather_object``) place their buffers themselves, from the current CUDA device.
"""

from __future__ import annotations

import torch

# torch.distributed.Backend.default_device_backend_map, inverted: backend -> device type.
_DEVICE_TYPE = {"nccl": "cuda", "gloo": "cpu", "xccl": "xpu"}


def collective_device(group=None) -> torch.device:
    """The device for tensors passed to a collective on ``group`` (default: the world group).

    Returns ``cuda:<current device>`` for NCCL, ``cpu`` for gloo.

    Raises:
        ValueError: a backend whose device is unknown (names the backend).
    """
    backend = str(torch.distributed.get_backend(group)).lower()
    kind = _DEVICE_TYPE.get(backend)
    if kind is None:
        raise ValueError(f"process group backend {backend!r}: no known device (known: "
                         f"{sorted(_DEVICE_TYPE)})")
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def rank() -> int:
    """This process's global rank; 0 without a process group."""
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def barrier() -> None:
    """``torch.distributed.barrier()`` on the world group; nothing without a process group."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def max_over_ranks(flags, group=None) -> tuple[bool, ...]:
    """Each flag OR-ed over the ranks of ``group``: one all-reduce MAX of one int32 per flag,
    on the device the group's backend needs (a collective)."""
    values = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int32,
                          device=collective_device(group))
    torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX, group=group)
    return tuple(bool(v) for v in values.tolist())


def any_rank_failed(failed: bool, group=None) -> bool:
    """True on every rank when ``failed`` is true on any rank of ``group`` (a collective; its
    flag lives on the device the group's backend needs)."""
    return max_over_ranks((failed,), group)[0]


def any_rank(*flags: bool) -> tuple[bool, ...]:
    """For each flag, whether it is true on any rank (one collective for all of them,
    :func:`max_over_ranks`; the flags as they are without a process group)."""
    if not torch.distributed.is_initialized():
        return flags
    return max_over_ranks(flags)


def all_ranks(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on every rank (a collective, :func:`any_rank`
    of its negation; ``flag`` as is without a process group)."""
    return not any_rank(not flag)[0]
