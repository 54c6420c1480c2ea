"""The one small interface every Ulysses transport implements.

A transport moves the pieces of an ``ExchangePlan``. Callers use only this interface (never a
transport's name): ``prepare`` before capture, ``send_buffer`` + ``start(..., send=)`` for a
producer that writes its outgoing data in place (no pack), ``result_aliases_staging`` to know
whether a result must be copied before ``release()``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from .layout import ExchangePlan, Piece

__all__ = ["Transport", "Exchange", "SendBuffer", "source_view", "region_view",
           "fill_send_buffer", "dense_send_buffer", "send_views", "dense"]


def source_view(parts: Sequence[torch.Tensor], piece: Piece) -> torch.Tensor:
    """The ``[rows, cols]`` view of ``parts[piece.part]`` (``[B, S, H, D]``, last two dims
    dense) that ``piece`` sends: rows are sequence positions, columns ``heads × D``."""
    x = parts[piece.part]
    st = x.stride()
    # heads × D of one row are contiguous (last two dims dense): one strided view
    return x.as_strided((piece.rows, piece.cols), (st[1], 1), x.storage_offset() + piece.b * st[0]
                        + piece.src_row0 * st[1] + piece.src_head0 * st[2])


def region_view(plan: ExchangePlan, src: int, dst: int, piece: Piece,
                region: torch.Tensor, pos: int) -> torch.Tensor:
    """The ``[rows, cols]`` view of ``piece`` (one of ``plan.pieces[src][dst]``) inside the flat
    send region ``region`` for ``dst`` (``[plan.numel[src][dst]]``).

    Tiled plans keep the destination's layout: the piece starts at ``piece.dst_offset −
    plan.region_start[src][dst]`` with the destination pitch. Other plans pack the pieces
    densely in plan order: the piece starts at ``pos`` (the sum of the earlier pieces' numel)
    with pitch ``cols``."""
    if plan.tiled:
        off, pitch = piece.dst_offset - plan.region_start[src][dst], piece.dst_pitch
    else:
        off, pitch = pos, piece.cols
    return region.as_strided((piece.rows, piece.cols), (pitch, 1), region.storage_offset() + off)


def _region_pieces(plan: ExchangePlan, src: int, dst: int):
    pos = 0
    for x in plan.pieces[src][dst]:
        yield x, pos
        pos += x.numel


class SendBuffer:
    """Where a producer writes what this rank sends in one exchange, in the transport's layout.

    Attributes:
        plan, dtype: the exchange it is for.
        rank: this rank (the source).
        regions: ``regions[p]`` is a flat ``[plan.numel[rank][p]]`` tensor of ``dtype`` holding
            what goes to destination ``p`` (``region_view`` gives each piece's place). For a
            tiled plan such as ``seq_to_head_plan`` that is this rank's rows of ``p``'s final
            buffer: ``regions[p].view(S_rank, B, n(p), D)`` with ``n(p)`` the heads ``p``
            receives (the parts' heads side by side). A transport may hand out views of its
            own staging (``regions[rank]`` may be this rank's receive slot). Given as None
            with ``flat``, they are ``flat``'s consecutive slices, made when first read (a
            producer that writes ``flat`` makes no views).
        flat: all regions as one destination-major ``[Σ_p numel[rank][p]]`` tensor when they are
            its consecutive slices, else None.
        token: private to the transport that made it.
    """

    __slots__ = ("plan", "dtype", "rank", "flat", "token", "_regions")

    def __init__(self, plan: ExchangePlan, dtype: torch.dtype, rank: int,
                 regions: tuple | None, flat: torch.Tensor | None = None, token: object = None):
        if regions is None and flat is None:
            raise ValueError("SendBuffer: regions or flat is needed")
        self.plan, self.dtype, self.rank = plan, dtype, rank
        self.flat, self.token, self._regions = flat, token, regions

    @property
    def regions(self) -> tuple:
        if self._regions is None:
            self._regions = tuple(self.flat.split(self.plan.numel[self.rank]))
        return self._regions


def dense(x: torch.Tensor) -> torch.Tensor:
    """``x [B, S, H, D]`` with its last two dims dense (a copy only when they are not): what a
    transport or a fill reads rows of ``heads × D`` from, and what ``attn_fn`` reads at W = 1
    when nothing is packed (``forward_plan``, "One rank")."""
    if x.is_contiguous():  # the common case, one check
        return x
    if x.dim() == 4 and x.stride(3) == 1 and (x.shape[2] <= 1 or x.stride(2) == x.shape[3]):
        return x
    return x.contiguous()


def dense_send_buffer(plan: ExchangePlan, dtype: torch.dtype, device: torch.device,
                      rank: int, token: object = None,
                      storage: torch.Tensor | None = None) -> SendBuffer:
    """A destination-major buffer (``storage`` when given, else a fresh tensor): the regions are
    consecutive slices of one tensor."""
    flat = storage if storage is not None else torch.empty(sum(plan.numel[rank]), dtype=dtype,
                                                           device=device)
    return SendBuffer(plan, dtype, rank, None, flat, token)


def fill_send_buffer(send: SendBuffer, parts: Sequence[torch.Tensor]) -> None:
    """Copy the pieces of ``parts`` into ``send`` (the reference producer; SM copies on the
    current stream)."""
    plan, r = send.plan, send.rank
    for p in range(plan.world_size):
        for x, pos in _region_pieces(plan, r, p):
            region_view(plan, r, p, x, send.regions[p], pos).copy_(source_view(parts, x))


def send_views(send: SendBuffer, p: int):
    """``(piece, [rows, cols] view in send.regions[p])`` for every piece this rank sends to
    ``p``."""
    plan, r = send.plan, send.rank
    return [(x, region_view(plan, r, p, x, send.regions[p], pos))
            for x, pos in _region_pieces(plan, r, p)]


class Exchange(ABC):
    """An exchange in flight. ``wait()`` returns this rank's final buffer (flat, ``[numel]``)
    once every source's data is there (in stream order: the returned tensor is ready for work
    enqueued on the current stream after ``wait()``; the host need not have waited);
    ``release()`` says the caller is done reading it (a transport with staging buffers may
    reuse them afterwards; the default does nothing)."""

    @abstractmethod
    def wait(self) -> torch.Tensor:
        ...

    def release(self) -> None:
        return None


class Transport(ABC):
    """Moves the pieces of an ``ExchangePlan`` between the ranks of a group.

    ``start(plan, parts, dtype, device, out=None, *, send=None)`` is called on every rank in
    the same order with the same plan. ``parts`` are this rank's source tensors (``[B, S, H,
    D]``, last two dims dense, dtype ``dtype``, on ``device``); with ``send`` (a buffer from
    ``send_buffer(plan, dtype, device)``, filled on the current stream) the data is taken from
    there instead and ``parts`` may be empty. ``out`` (optional, flat, ``recv_numel[rank]``
    elements) is where the final buffer should live; without it the transport chooses (a
    staging buffer valid until ``release()`` when ``result_aliases_staging``).

    Attributes:
        name: the backend name (for reports only: callers never branch on it).
        result_aliases_staging: ``Exchange.wait()`` without ``out`` may return a view of the
            transport's staging, valid until ``release()``; copy it to keep it.
    """

    name: str = "?"
    result_aliases_staging: bool = False

    def __init__(self, group, rank: int, world_size: int, timeout_s: float):
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s

    def prepare(self, plan: ExchangePlan, dtype: torch.dtype) -> str | None:
        """Make ``start`` ready for ``plan`` (collective when it allocates: every rank calls it
        with the same plan). Returns None when ``start`` can run it now, else why not (the same
        on every rank). Call it before CUDA graph capture. Default: always ready."""
        return None

    def send_storage(self, plan: ExchangePlan) -> int:
        """Elements of caller-provided memory ``send_buffer(..., storage=)`` would use for
        ``plan`` (0: this transport stages elsewhere and ignores ``storage``). A caller with
        several exchanges to fill can take one allocation for all of them."""
        return sum(plan.numel[self.rank])

    def keeps_send_buffer(self, plan: ExchangePlan) -> bool:
        """Whether ``start(plan, (), ..., send=buf)`` without ``out`` moves nothing and its
        ``wait()`` returns ``buf.flat``, the ``storage`` the send buffer was given (a group of
        one with a tiled plan): a producer that filled that storage may read it as the
        received buffer and skip ``send_buffer``, ``start`` and ``wait``. Default: False."""
        return False

    def send_buffer(self, plan: ExchangePlan, dtype: torch.dtype, device: torch.device,
                    storage: torch.Tensor | None = None) -> SendBuffer:
        """Where a producer writes this rank's outgoing data for the next ``start(plan, ...,
        send=buf)`` of this transport (at most one buffer outstanding per plan: take it right
        before that ``start``). ``storage``: a flat ``dtype`` tensor of ``send_storage(plan)``
        elements to use (else the transport allocates). Default: a dense buffer."""
        return dense_send_buffer(plan, dtype, device, self.rank, storage=storage)

    @abstractmethod
    def start(self, plan: ExchangePlan, parts: Sequence[torch.Tensor], dtype: torch.dtype,
              device: torch.device, out: torch.Tensor | None = None, *,
              send: SendBuffer | None = None) -> Exchange:
        ...

    def check(self) -> None:
        """Raise any timeout recorded since the last check (default: none). Never waits for
        the GPU."""
        return None

    def close(self) -> None:
        """Free the transport's buffers (collective when peers write into them: a barrier
        first). Default: nothing to free."""
        return None

    def _validate_send(self, plan: ExchangePlan, dtype: torch.dtype, send: SendBuffer) -> None:
        if send.plan is not plan and send.plan != plan:
            raise ValueError(f"ulysses {self.name}: send buffer is for another plan")
        if send.dtype != dtype or send.rank != self.rank:
            raise ValueError(f"ulysses {self.name}: send buffer is for dtype {send.dtype}, "
                             f"rank {send.rank}; start got {dtype}, rank {self.rank}")
