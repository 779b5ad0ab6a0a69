"""Chunk ownership and tile order of the fused TP GEMMs (pure Python, mirrored by the kernels).

Rows of the ``[M, N]`` product split into ``W`` chunks of ``Mc = M / W`` rows; chunk ``c`` is the
rows ``[c * Mc, (c + 1) * Mc)``: the rows of rank ``c``'s activation shard (ag_gemm) or the rows
rank ``c`` owns after the reduce-scatter (gemm_rs). Output tiles never straddle chunks: a chunk
has ``cdiv(Mc, BM)`` tile rows, the last one masked when ``Mc % BM != 0``. That keeps one flag
per tile and one owner per tile for any ``M`` divisible by ``W``.

A persistent program walks tile indices ``t = pid, pid + P, ...``; ``decode`` maps ``t`` to
``(chunk, tile_row_in_chunk, tile_col)``: chunks in ``chunk_order``, and inside a chunk the
banded "super-tile" order (``group_m`` tile rows sweep all columns together, for L2 reuse).
``_gemm_core._decode_tile`` is the same arithmetic in Triton; the tests keep them equal.

``lag > 0`` (gemm_rs, ``owner_last`` order) interleaves instead of walking whole chunks: the
peer chunks' tiles form one stream, round-robin over the peers by tile index, and the own
chunk's tile ``i`` follows ``lag`` stream positions behind: first ``(W-1) * lag`` peer tiles,
then groups of ``W-1`` peer tiles and one own tile, then the last ``lag`` own tiles. Every
peer computes a rank's tile ``i`` at least ``lag`` positions before that rank reduces it
(``W * lag`` in the middle of the walk), and the pushes to the owners spread over the whole
GEMM instead of its first ``(W-1)/W``.
"""

from __future__ import annotations

from dataclasses import dataclass

from tilefuse._jit import cdiv

CHUNK_ORDERS = ("natural", "arrival", "owner_last")


def chunk_order(kind: str, rank: int, world: int) -> list[int]:
    """The order in which a rank computes the row chunks.

    * ``natural``: ``0 .. W-1`` (a plain GEMM);
    * ``arrival``: own chunk, then ``rank+1, rank+2, ...`` (mod W): the order in which the
      gathers of ag_gemm deliver peer chunks, so a tile never waits behind a later chunk;
    * ``owner_last``: ``rank+1, ..., rank-1`` then own chunk: gemm_rs sends peer rows first
      and reduces its own rows last, when the peers' partials have arrived.
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    if kind == "natural":
        return list(range(world))
    if kind == "arrival":
        return [(rank + s) % world for s in range(world)]
    if kind == "owner_last":
        return [(rank + s) % world for s in range(1, world)] + [rank]
    raise ValueError(f"chunk order must be one of {CHUNK_ORDERS}, got {kind!r}")


def chunk_rows(m: int, world: int) -> int:
    """Rows per chunk; ``m`` must be divisible by ``world``."""
    if m % world:
        raise ValueError(f"M = {m} must be divisible by the world size {world}")
    return m // world


@dataclass(frozen=True)
class TileSchedule:
    """Tile grid of one rank's GEMM: ``world`` chunks of ``mc`` rows, ``n`` columns."""

    mc: int
    n: int
    world: int
    block_m: int
    block_n: int
    group_m: int
    order: tuple[int, ...]
    lag: int = 0  # 0: whole chunks in ``order``; > 0: interleaved, own chunk ``order[-1]`` lagging

    def __post_init__(self):
        if sorted(self.order) != list(range(self.world)):
            raise ValueError(f"order {self.order} is not a permutation of range({self.world})")
        if min(self.mc, self.n, self.block_m, self.block_n, self.group_m) < 1:
            raise ValueError("mc, n, block_m, block_n and group_m must be positive")
        if self.lag < 0:
            raise ValueError(f"lag must be >= 0, got {self.lag}")
        if self.lag and self.world < 2:
            raise ValueError("an interleaved order (lag > 0) needs at least two chunks")

    @property
    def tile_rows_per_chunk(self) -> int:
        return cdiv(self.mc, self.block_m)

    @property
    def tile_cols(self) -> int:
        return cdiv(self.n, self.block_n)

    @property
    def tiles_per_chunk(self) -> int:
        return self.tile_rows_per_chunk * self.tile_cols

    @property
    def num_tiles(self) -> int:
        return self.tiles_per_chunk * self.world

    @property
    def aligned(self) -> bool:
        """True when chunks hold whole tiles (TMA stores need no row mask)."""
        return self.mc % self.block_m == 0

    def decode(self, t: int) -> tuple[int, int, int]:
        """Tile index ``t`` -> ``(chunk, tile row inside the chunk, tile column)``."""
        if not 0 <= t < self.num_tiles:
            raise ValueError(f"tile index {t} outside [0, {self.num_tiles})")
        ci, r = self.position(t)
        chunk = self.order[ci]
        tm, tn = self.tile_rows_per_chunk, self.tile_cols
        width = self.group_m * tn
        first = (r // width) * self.group_m
        size = min(tm - first, self.group_m)
        j = first + (r % width) % size
        col = (r % width) // size
        return chunk, j, col

    @property
    def lag_tiles(self) -> int:
        """The lag in effect (at most the tiles of a chunk)."""
        return min(self.lag, self.tiles_per_chunk)

    def position(self, t: int) -> tuple[int, int]:
        """Tile index ``t`` -> ``(index into order, index inside the chunk's super-tile order)``."""
        tpc, w, lag = self.tiles_per_chunk, self.world, self.lag_tiles
        if lag == 0:
            return divmod(t, tpc)
        head = (w - 1) * lag
        if t < head:  # the lead: peer tiles only
            slot = t
        elif t < head + w * (tpc - lag):
            g, r = divmod(t - head, w)
            if r == w - 1:
                return w - 1, g
            slot = head + g * (w - 1) + r
        else:  # the tail: own tiles only
            return w - 1, t - head - w * (tpc - lag) + tpc - lag
        return slot % (w - 1), slot // (w - 1)
