"""What GPU a tensor lives on, for the ops that pick a kernel by architecture."""

from __future__ import annotations

import torch


def capability_major(device: torch.device | str | None) -> int | None:
    """Compute-capability major of a CUDA device; None for CPU tensors (the interpreter)."""
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)[0]


_SM_COUNTS: dict[int, int] = {}


def sm_count(device: torch.device | str | None) -> int | None:
    """Multiprocessors of a CUDA device (cached per device); None for CPU tensors."""
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    n = _SM_COUNTS.get(index)
    if n is None:
        n = _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return n
