"""Key windows ``[ks, ke)`` per query row, as serving engines produce them.

Used by tests and benchmarks alike, so both exercise the same shapes.
"""

from __future__ import annotations

import torch


def _pair(ks: torch.Tensor, ke: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    return ks.to(device=device, dtype=torch.int32), ke.to(device=device, dtype=torch.int32)


def causal_tail(s_q: int, s_k: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Causal tail as in DeepGEMM's tests: ``ks = 0``, ``ke[i] = i + s_k - s_q`` (exclusive)."""
    i = torch.arange(s_q)
    return _pair(torch.zeros(s_q, dtype=torch.int64), i + s_k - s_q, device)


def full(s_q: int, s_k: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Every row sees every key."""
    return _pair(torch.zeros(s_q, dtype=torch.int64), torch.full((s_q,), s_k), device)


def zigzag(s_q: int, s_k: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Context-parallel zig-zag windows (DeepGEMM's generator).

    ``chunk = s_q/2``, ``cp = s_k/s_q``, ``cp_id = cp // 3``; the first half of the rows ends at
    ``cp_id*chunk + i``, the second at ``(2*cp - 1 - cp_id)*chunk + i``.
    """
    if s_q % 2 or s_k % s_q:
        raise ValueError(f"zigzag needs an even s_q dividing s_k, got s_q={s_q}, s_k={s_k}")
    chunk = s_q // 2
    cp = s_k // s_q
    cp_id = cp // 3
    i = torch.arange(chunk)
    ke = torch.cat([cp_id * chunk + i, (2 * cp - 1 - cp_id) * chunk + i])
    return _pair(torch.zeros(s_q, dtype=torch.int64), ke, device)


def random_windows(s_q: int, s_k: int, generator: torch.Generator | None = None, device="cpu",
                   empty_fraction: float = 0.0, overhang: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``0 <= ks <= ke <= s_k + overhang``; a fraction of rows is made empty (``ks == ke``)."""
    a = torch.randint(0, s_k + overhang + 1, (s_q,), generator=generator)
    b = torch.randint(0, s_k + overhang + 1, (s_q,), generator=generator)
    ks, ke = torch.minimum(a, b), torch.maximum(a, b)
    if empty_fraction > 0:
        empty = torch.rand(s_q, generator=generator) < empty_fraction
        ke = torch.where(empty, ks, ke)
    return _pair(ks, ke, device)


GENERATORS = {
    "causal": causal_tail,
    "full": full,
    "zigzag": zigzag,
    "random": random_windows,
}


def valid_pairs(ks: torch.Tensor, ke: torch.Tensor, s_k: int) -> int:
    """Number of (row, key) pairs inside the windows (``ke`` clamped to ``s_k``): the FLOP count base."""
    return int((ke.long().clamp(max=s_k) - ks.long()).clamp(min=0).sum())
