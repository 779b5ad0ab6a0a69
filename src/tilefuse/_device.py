"""What GPU a tensor lives on, for the ops that pick a kernel by architecture."""

from __future__ import annotations

import torch


def capability_major(device: torch.device | str | None) -> int | None:
    """Compute-capability major of a CUDA device; None for CPU tensors (the interpreter)."""
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)[0]
