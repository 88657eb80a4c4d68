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
