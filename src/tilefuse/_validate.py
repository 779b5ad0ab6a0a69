"""Host-side argument checks shared by every op: they read shapes, dtypes, strides and devices,
never device data, so they cost the hot path no synchronisation."""

from __future__ import annotations

import torch

from tilefuse._interpreter import interpreter_enabled


def expect(cond: bool, exc: type, msg: str) -> None:
    if not cond:
        raise exc(msg)


def expect_tensor(x, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    return x


def expect_int(value, name: str, minimum: int) -> None:
    if value.__class__ is not int or value < minimum:  # bool is not int here
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= minimum):
            raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")


def check_aligned(t: torch.Tensor, name: str) -> None:
    if t.data_ptr() % 16:
        raise ValueError(f"{name}: data pointer must be 16-byte aligned")


def check_tma_rows(t: torch.Tensor, name: str) -> None:
    """Tensor-descriptor rules: unit last stride, 16-byte aligned base and row stride."""
    # Messages are formatted only on failure: these checks run on every call of an op.
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: last dim must be contiguous (stride 1), got strides {t.stride()}")
    row_bytes = t.stride(0) * t.element_size()
    if row_bytes % 16:
        raise ValueError(f"{name}: row stride must be a multiple of 16 bytes, got {row_bytes}")
    # Data pointers do not exist while torch.compile traces: the op itself checks them then.
    if not torch.compiler.is_compiling():
        check_aligned(t, name)


def check_same_device(tensors: dict[str, torch.Tensor], like: str) -> torch.device:
    """Every tensor on the device of ``tensors[like]``; returns that device."""
    device = tensors[like].device
    for name, t in tensors.items():
        expect(t.device == device, ValueError, f"{name}: expected device {device} like {like}, got {t.device}")
    return device


def check_kernel_device(t: torch.Tensor, name: str) -> None:
    """The kernels run on CUDA tensors, or on CPU tensors through Triton's interpreter only."""
    if t.device.type == "cuda":
        return
    if t.device.type == "cpu" and interpreter_enabled():
        return
    hint = (" (CPU tensors run only through Triton's interpreter: set TRITON_INTERPRET=1 before importing tilefuse)"
            if t.device.type == "cpu" else "")
    raise ValueError(f"{name}: tilefuse kernels need a CUDA tensor, got a tensor on {t.device}{hint}")
