"""Head and sequence splits for Ulysses, and the exchange plans built from them.

An exchange moves, from every source rank ``s`` to every destination rank ``p``, a list of
*pieces*: ``rows`` rows of ``cols`` contiguous elements each. A piece has a place in the
destination's *final buffer* (``dst_offset`` and ``dst_pitch`` in elements), so a transport that
can write strided rows (the copy engine) puts data straight where the receiver wants it, and one
that cannot (``all_to_all_single``) packs, sends and — when the final layout is not a plain
concatenation by source — unpacks.

Two plans cover Ulysses:

- ``seq_to_head_plan``: sequence-sharded parts ``[B, S_s, H_i, D]`` → head-sharded final buffer
  ``[S, B, Σ_i n_i(p), D]`` on rank ``p`` (parts concatenated along heads). The region coming from
  source ``s`` is the contiguous row range ``[off_s, off_s + S_s)``, so ``all_to_all_single``
  lands the data in its final place with no unpack ("tiled" plan).
- ``head_to_seq_plan``: head-sharded ``[B, S, h_s, D]`` → sequence-sharded final buffer
  ``[B, S_p, H_total, D]`` with source ``s``'s heads at a given head offset.

And one for the joint rows of ``UlyssesAttention`` (replicated rows, e.g. a DiT's text tokens):

- ``head_gather_plan``: an all-gather over heads, ``[B, R, h_s, D]`` on source ``s`` → every
  rank's final buffer ``[B, R, H, D]`` (source ``s``'s heads at their global offset).
"""
from __future__ import annotations

import dataclasses
import functools
import zlib
from collections.abc import Sequence

__all__ = ["head_split", "head_offsets", "kv_head_range", "group_head_ranges", "Piece",
           "ExchangePlan", "seq_to_head_plan", "head_to_seq_plan", "head_gather_plan",
           "uniform_group"]


def head_split(num_heads: int, world_size: int) -> list[int]:
    """Heads per rank: rank ``r`` gets ``H // W + (r < H % W)``.

    Rank ``r`` owns the contiguous heads starting at the sum of earlier ranks' counts (7 heads
    over 4 ranks → ``[2, 2, 2, 1]``; 2 heads over 3 ranks → ``[1, 1, 0]``).

    Raises:
        ValueError: ``num_heads < 1`` or ``world_size < 1``.
    """
    if not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"head_split: num_heads must be an int ≥ 1, got {num_heads!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"head_split: world_size must be an int ≥ 1, got {world_size!r}")
    base, extra = divmod(num_heads, world_size)
    return [base + (r < extra) for r in range(world_size)]


def head_offsets(counts: Sequence[int]) -> list[int]:
    """Exclusive prefix sums of ``counts`` (first head of each rank)."""
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out


def kv_head_range(q_lo: int, q_hi: int, group_size: int) -> tuple[int, int]:
    """The KV heads ``[lo, hi)`` used by query heads ``[q_lo, q_hi)`` when query head ``h`` uses
    KV head ``h // group_size``; empty ``(0, 0)`` for no query heads."""
    if q_hi <= q_lo:
        return (0, 0)
    return (q_lo // group_size, (q_hi - 1) // group_size + 1)


def uniform_group(q_lo: int, q_hi: int, group_size: int) -> bool:
    """Whether local query head ``i`` uses local KV head ``i // (h / g)`` for the query heads
    ``[q_lo, q_hi)`` and their KV heads (``h`` query heads, ``g`` KV heads, ``h % g == 0``)."""
    if q_hi <= q_lo:
        return True
    lo, hi = kv_head_range(q_lo, q_hi, group_size)
    counts = [min(q_hi, (k + 1) * group_size) - max(q_lo, k * group_size) for k in range(lo, hi)]
    return all(c == counts[0] for c in counts)


def group_head_ranges(num_heads: int, world_size: int, groups: int) -> list[list[tuple[int, int]]]:
    """Query head ranges ``[lo, hi)`` of every pipeline group on every rank:
    ``out[g][p]``. Rank ``p``'s heads (``head_split``) are cut into ``groups`` consecutive
    pieces by ``head_split(n_p, groups)`` (some may be empty)."""
    counts = head_split(num_heads, world_size)
    offs = head_offsets(counts)
    out = [[(0, 0)] * world_size for _ in range(groups)]
    for p in range(world_size):
        if counts[p] == 0:
            continue
        sub = _split(counts[p], groups)
        lo = offs[p]
        for g in range(groups):
            out[g][p] = (lo, lo + sub[g])
            lo += sub[g]
    return out


def _split(n: int, parts: int) -> list[int]:
    base, extra = divmod(n, parts)
    return [base + (i < extra) for i in range(parts)]


@dataclasses.dataclass(frozen=True)
class Piece:
    """``rows`` rows of ``cols`` contiguous elements from source part ``part`` (batch ``b``).

    In the destination's final buffer, row ``i`` starts at ``dst_offset + i · dst_pitch``.
    ``src_row0`` / ``src_head0`` say where the rows start in the source tensor ``[B, S, H, D]``
    (sequence row and head index)."""

    part: int
    b: int
    src_row0: int
    src_head0: int
    rows: int
    cols: int
    dst_offset: int
    dst_pitch: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols


@dataclasses.dataclass(frozen=True)
class ExchangePlan:
    """Everything every rank needs to run one exchange; identical on all ranks.

    Attributes:
        world_size: ``W``.
        pieces: ``pieces[s][p]`` — what source ``s`` sends to destination ``p``, in packing order.
        recv_numel: ``recv_numel[p]`` — elements of destination ``p``'s final buffer.
        tiled: the region from source ``s`` in every final buffer is the contiguous range
            ``[Σ_{s'<s} numel[s'][p], …)`` and the pieces tile it (pack in final layout, no
            unpack).
    """

    world_size: int
    pieces: tuple
    recv_numel: tuple
    tiled: bool

    @functools.cached_property
    def numel(self) -> list[list[int]]:
        """``numel[s][p]`` — elements ``s`` sends to ``p``."""
        return [[sum(x.numel for x in self.pieces[s][p]) for p in range(self.world_size)]
                for s in range(self.world_size)]

    @functools.cached_property
    def tag(self) -> int:
        """A nonzero 31-bit word naming this plan's layout (what every source sends every
        destination, tiled or not). The ``ce`` transport's data flags carry it, so a peer that
        runs another plan (a graph captured for another shape) never satisfies a wait: the
        waiting rank times out instead of reading rows laid out for another call."""
        return (zlib.crc32(repr((self.tiled, self.pieces, self.recv_numel)).encode())
                & 0x3FFFFFFF) | 1

    @functools.cached_property
    def region_start(self) -> list[list[int]]:
        """``region_start[s][p]`` — where source ``s``'s data starts in ``p``'s receive order."""
        w = self.world_size
        out = [[0] * w for _ in range(w)]
        for p in range(w):
            acc = 0
            for s in range(w):
                out[s][p] = acc
                acc += self.numel[s][p]
        return out

    @functools.cached_property
    def _recv_counts(self) -> tuple:
        return tuple(sum(self.numel[s][p] for s in range(self.world_size))
                     for p in range(self.world_size))

    def recv_count(self, p: int) -> int:
        """Elements the pieces sent to ``p`` hold in all (its receive order)."""
        return self._recv_counts[p]

    def covers(self, p: int) -> bool:
        """Whether the pieces sent to ``p`` fill its whole final buffer."""
        return self._recv_counts[p] == self.recv_numel[p]

    # What a transport derives from the plan on every call, worked out on the first (a plan
    # is immutable; the answers are kept in ``_memo``, outside the dataclass fields).
    @functools.cached_property
    def _memo(self) -> dict:
        return {}

    def byte_splits(self, r: int, itemsize: int) -> tuple[list[int], list[int]]:
        """``(send, recv)``: the bytes rank ``r`` sends to, and receives from, each rank
        (``all_to_all_single``'s split sizes for elements of ``itemsize`` bytes)."""
        key = ("splits", r, itemsize)
        got = self._memo.get(key)
        if got is None:
            got = self._memo[key] = ([n * itemsize for n in self.numel[r]],
                                     [self.numel[s][r] * itemsize for s in range(self.world_size)])
        return got

    def send_span(self, r: int, strides: tuple) -> tuple[int, int] | None:
        """Where the pieces rank ``r`` sends lie in its one source part when that part has
        ``strides`` (``[B, S, H, D]``, last two dims dense): ``(first element from the part's
        storage offset, elements)`` when they are, in send order, consecutive dense rows of it
        (the send buffer is then a view of the part), else None (also for a plan with more
        than one part, whose parts' places are not fixed by their strides)."""
        key = ("span", r, strides)
        if key not in self._memo:
            self._memo[key] = self._send_span(r, strides)
        return self._memo[key]

    def _send_span(self, r: int, st: tuple) -> tuple[int, int] | None:
        pieces = [x for p in range(self.world_size) for x in self.pieces[r][p]]
        if not pieces or any(x.part != 0 for x in pieces):
            return None
        first = expect = None
        for x in pieces:
            if x.rows > 1 and (st[1] != x.cols or (self.tiled and x.dst_pitch != x.cols)):
                return None  # rows not back to back in the source (or in the final buffer)
            start = x.b * st[0] + x.src_row0 * st[1] + x.src_head0 * st[2]
            if expect is not None and start != expect:
                return None
            first = start if first is None else first
            expect = start + x.numel
        return first, expect - first

    def unpack_grid(self, p: int) -> tuple | None:
        """The unpack of rank ``p``'s receive buffer (the pieces sent to ``p`` back to back in
        source order) into its final buffer as one strided copy: ``(sizes, recv strides,
        final strides, final offset)`` of two 4-D views (source, piece of that source, row,
        column), or None when the pieces do not form such a grid (sources with different
        piece counts or shapes, offsets not evenly spaced)."""
        key = ("unpack", p)
        if key not in self._memo:
            self._memo[key] = self._unpack_grid(p)
        return self._memo[key]

    def _unpack_grid(self, p: int):
        srcs = [self.pieces[s][p] for s in range(self.world_size)]
        k = len(srcs[0])
        if k == 0 or any(len(x) != k for x in srcs):
            return None
        x0 = srcs[0][0]
        rows, cols, pitch = x0.rows, x0.cols, x0.dst_pitch
        if any((x.rows, x.cols, x.dst_pitch) != (rows, cols, pitch) for s in srcs for x in s):
            return None
        a = srcs[1][0].dst_offset - x0.dst_offset if len(srcs) > 1 else 0
        b = srcs[0][1].dst_offset - x0.dst_offset if k > 1 else 0
        if a < 0 or b < 0 or any(x.dst_offset != x0.dst_offset + i * a + j * b
                                 for i, s in enumerate(srcs) for j, x in enumerate(s)):
            return None
        n = rows * cols
        return ((len(srcs), k, rows, cols), (k * n, n, cols, 1), (a, b, pitch, 1),
                x0.dst_offset)


@functools.lru_cache(maxsize=256)
def seq_to_head_plan(batch: int, seq_lens: tuple, head_dim: int,
                     part_ranges: tuple) -> ExchangePlan:
    """Plan for sequence-sharded parts → head-sharded final buffers.

    Arguments:
        batch: ``B``.
        seq_lens: every rank's ``S_r`` (``S = Σ S_r``).
        head_dim: ``D`` (the same for every part of the exchange).
        part_ranges: ``part_ranges[i][p] = (lo, hi)`` — heads of part ``i`` that rank ``p``
            receives (ranges may overlap between ranks, e.g. shared KV heads).

    Final buffer on rank ``p``: ``[S, B, Σ_i n_i(p), D]``; part ``i`` occupies heads
    ``[Σ_{j<i} n_j(p), …)``.
    """
    w = len(seq_lens)
    total_s = sum(seq_lens)
    s_off = head_offsets(seq_lens)
    htot = [sum(r[p][1] - r[p][0] for r in part_ranges) for p in range(w)]
    pieces = [[[] for _ in range(w)] for _ in range(w)]
    for s in range(w):
        for p in range(w):
            if seq_lens[s] == 0 or htot[p] == 0:
                continue
            for b in range(batch):
                col = 0
                for i, ranges in enumerate(part_ranges):
                    lo, hi = ranges[p]
                    if hi > lo:
                        pieces[s][p].append(Piece(
                            part=i, b=b, src_row0=0, src_head0=lo, rows=seq_lens[s],
                            cols=(hi - lo) * head_dim,
                            dst_offset=((s_off[s] * batch + b) * htot[p] + col) * head_dim,
                            dst_pitch=batch * htot[p] * head_dim))
                        col += hi - lo
    recv = tuple(total_s * batch * htot[p] * head_dim for p in range(w))
    return ExchangePlan(w, _freeze(pieces), recv, tiled=True)


@functools.lru_cache(maxsize=256)
def head_to_seq_plan(batch: int, seq_lens: tuple, head_dim: int, src_heads: tuple,
                     dst_head_offsets: tuple, dst_num_heads: int) -> ExchangePlan:
    """Plan for head-sharded ``[B, S, h_s, D]`` → sequence-sharded final buffers.

    Arguments:
        batch: ``B``.
        seq_lens: every rank's ``S_p`` (``S = Σ S_p``).
        head_dim: ``D``.
        src_heads: ``h_s`` — heads each source rank holds.
        dst_head_offsets: where source ``s``'s heads go in the destination's head axis.
        dst_num_heads: ``H`` of the final buffer ``[B, S_p, H, D]`` on rank ``p``.
    """
    w = len(seq_lens)
    s_off = head_offsets(seq_lens)
    pieces = [[[] for _ in range(w)] for _ in range(w)]
    for s in range(w):
        if src_heads[s] == 0:
            continue
        for p in range(w):
            if seq_lens[p] == 0:
                continue
            for b in range(batch):
                pieces[s][p].append(Piece(
                    part=0, b=b, src_row0=s_off[p], src_head0=0, rows=seq_lens[p],
                    cols=src_heads[s] * head_dim,
                    dst_offset=(b * seq_lens[p] * dst_num_heads + dst_head_offsets[s]) * head_dim,
                    dst_pitch=dst_num_heads * head_dim))
    recv = tuple(batch * seq_lens[p] * dst_num_heads * head_dim for p in range(w))
    plan = ExchangePlan(w, _freeze(pieces), recv, tiled=False)
    return dataclasses.replace(plan, tiled=_is_concatenation(plan))


@functools.lru_cache(maxsize=256)
def head_gather_plan(batch: int, rows: int, head_dim: int, src_heads: tuple) -> ExchangePlan:
    """Plan for an all-gather over heads: source ``s`` holds ``[B, rows, h_s, D]`` (its heads
    ``head_offsets(src_heads)[s] …``); every rank's final buffer is ``[B, rows, H, D]`` with
    ``H = Σ h_s``, source ``s``'s heads at their offset (each source sends the same pieces to
    every rank, itself included)."""
    w = len(src_heads)
    h = sum(src_heads)
    offs = head_offsets(src_heads)
    pieces = [[[] for _ in range(w)] for _ in range(w)]
    for s in range(w):
        if src_heads[s] == 0 or rows == 0:
            continue
        for p in range(w):
            for b in range(batch):
                pieces[s][p].append(Piece(
                    part=0, b=b, src_row0=0, src_head0=0, rows=rows,
                    cols=src_heads[s] * head_dim, dst_offset=(b * rows * h + offs[s]) * head_dim,
                    dst_pitch=h * head_dim))
    plan = ExchangePlan(w, _freeze(pieces), (batch * rows * h * head_dim,) * w, tiled=False)
    return dataclasses.replace(plan, tiled=_is_concatenation(plan))


def _is_concatenation(plan: ExchangePlan) -> bool:
    """True when every final buffer is the plain concatenation of the pieces by source, each
    piece dense — then packing order equals final order."""
    for p in range(plan.world_size):
        pos = 0
        for s in range(plan.world_size):
            for x in plan.pieces[s][p]:
                if x.dst_offset != pos or (x.rows > 1 and x.dst_pitch != x.cols):
                    return False
                pos += x.numel
    return True


def _freeze(pieces) -> tuple:
    return tuple(tuple(tuple(row) for row in src) for src in pieces)
