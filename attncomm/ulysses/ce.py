"""The ``ce`` transport: copy-engine copies into peer-mapped staging slots.

Each rank copies its pieces for peer ``p`` straight into ``p``'s staging slot (final layout, so
strided rows use pitched 2D copies, ``cudaMemcpy2DAsync`` through ``cuda.bindings``; a
non-contiguous ``copy_`` would be an SM kernel), then raises a flag in ``p``'s memory ordered
after the data on the same stream.

Staging buffer (one per shape bucket and, when more than two exchanges of that bucket are in
flight, one more per two: an exchange takes the first entry whose next slot is not held,
because this rank's own region of a slot is written on the caller's stream, which the flags do
not order; cached; every rank holds the same set and evicts in the same order because every
rank makes the same calls), a ``SymmWorkspace`` of the substrate::

    flags  uint32 [4, W]   F[k][s] (set by source s: slot k holds its data),
                           A[k][p] (set by destination p: it is done reading slot k from me)
    slot 0, slot 1         the final receive buffer (bytes), double-buffered by parity k

Protocol for an exchange with parity ``k`` (flag layout and peer orders: ``ce_flags``):

- sender ``r`` → ``p`` (on a copy stream): wait ``A[k][p] == 1`` (local), set it 0, copy the
  pieces into ``p``'s slot ``k``, write ``F[k][r] = tag`` into ``p``'s flags, where ``tag``
  (``ExchangePlan.tag``, nonzero) names the exchange's layout: a peer that runs another plan
  (a replay of a graph captured for another shape) never satisfies the wait below, which
  times out instead of handing back rows laid out for another call.
- receiver ``r``: wait ``F[k][s] == tag`` for every peer, set it 0, read the slot, then
  ``release()`` writes ``A[k][r] = 1`` into every source's flags.

CUDA graphs: an exchange captured after one eager call of its shape (staging allocated, kernels
compiled) replays with no host step. The flags need none: every wait resets the flag it waited
for, so after each complete exchange (started, waited and released in the same graph, as every
caller does) the block is back to its initial values — the counterpart, for flags that are
reset, of ``symm_a2a``'s device-side epochs, whose flags are never reset. A replay uses the
slots chosen at capture; an eager call after it uses the host's parity and may pick the same
slot: the A flags order every peer's write after this rank's release, and this rank's own
writes follow the replay on its stream. Inside a capture every flag operation is a Triton
kernel with a device deadline (no watchdog), and nothing is allocated: a new size raises
``ValueError`` (warm the shape up eagerly).

The host never waits for the GPU inside an exchange: every order lives on the device (stream
memory ops or flag kernels, events between the copy streams and the caller's stream), so a
forward can enqueue all its exchanges ahead of the GPU. Flag operations are stream memory ops
(``cuStreamWriteValue32`` / ``cuStreamWaitValue32``) where a trial call works, else one-block
Triton kernels (``ce_flags``). Waits are bounded: a kernel wait (always inside CUDA graph
capture) gives up at a device-side deadline and sets the peer's error word; a memory-op wait is
handed to the substrate's watchdog, which after ``timeout_s`` (counted from when the stream
reaches the wait) writes the awaited flags locally so no stream stays blocked. Either way the
transport is broken from then on and the next call, or ``check()``, raises
``PeerTimeoutError`` naming the peers (``attncomm.symm``). Results of a timed-out exchange are
garbage: call ``check()`` before trusting the last results of a run.
"""
from __future__ import annotations

import collections
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .. import capability, config
from .._dist import cpu_group, group_key, on_release
from .._agree import agree_reason, agreed_min
from ..errors import PeerTimeoutError
from ..symm import PeerErrors
from ..watchdog import PendingWait, watchdog
from .ce_flags import Flags, ok, recv_order, runtime, send_order, triton_reason
from .ce_staging import Staging as _Staging, align as _align
from .layout import ExchangePlan
from .transport import Exchange, SendBuffer, Transport, send_views, source_view

__all__ = ["CopyEngineTransport", "local_unavailable_reason", "host_unavailable_reason",
           "agreed_unavailable_reason", "probe_stream_mem_ops", "CACHE_ENTRIES"]

#: Staging buffers kept per transport (least recently used evicted first).
CACHE_ENTRIES = config.get("ATTNCOMM_ULYSSES_CE_CACHE")
# ------------------------------------------------------------------------------ eligibility
def local_unavailable_reason(group, device: torch.device) -> str | None:
    """Local facts only (no communication): CUDA tensors, a flag mechanism (``cuda.bindings``
    or Triton) and ``cuda.bindings`` for the copies. (The peer mapping, torch SymmetricMemory
    or CUDA IPC, is the group's: ``capability.symm_unavailable_reason``.)"""
    if device.type != "cuda":
        return f"tensors are not CUDA (they are on {device.type})"
    why = capability.cuda_reason()
    if why:
        return why
    if runtime() is None:
        return "cuda.bindings (runtime) is not importable: needed for copy-engine copies"
    if triton_reason() is not None:
        return f"Triton is not importable (flag kernels, waits inside graphs): {triton_reason()}"
    return None


def host_unavailable_reason() -> str | None:
    """For ``attncomm env`` without a process group: local facts plus P2P between every pair
    of this host's GPUs (one GPU: ranks that share it can run ``ce`` through CUDA IPC, for
    correctness, not speed: not counted here)."""
    why = local_unavailable_reason(None, torch.device("cuda"))
    if why:
        return why
    m = capability.p2p_matrix()
    if len(m) < 2:
        return (f"needs ≥ 2 GPUs on this host for speed (found {len(m)}; ranks sharing one "
                f"GPU run it through CUDA IPC, for correctness only)")
    missing = [f"{i}→{j}" for i, row in enumerate(m) for j, ok in enumerate(row) if not ok]
    return f"no P2P access between GPUs {', '.join(missing)}" if missing else None


#: ``(group_key(group), device type) → reason or None``; keyed by the group object itself, not
#: ``id(group)``: a stale entry on one rank would skip the agreement collective there.
_AGREED: dict = {}


@on_release
def _forget_agreement(key) -> None:
    for k in [k for k in _AGREED if k[0] == key]:
        del _AGREED[k]


def agreed_unavailable_reason(group, device: torch.device) -> str | None:
    """Why ``ce`` cannot run on ``group`` for ``device`` tensors, the same on every rank (None if
    it can). Collective on first use per (group, device type), cached: local facts, one host,
    P2P to every peer (``capability.symm_unavailable_reason``), agreed by all_reduce(MIN) over
    the gloo group (``agree_reason``) before any allocation."""
    key = (group_key(group), device.type)
    if key not in _AGREED:
        why = capability.symm_unavailable_reason(group, device)  # collective on CUDA
        why = why or local_unavailable_reason(group, device)
        if why is None and dist.get_world_size(group) == 1:
            why = "a single rank has no peer to copy to"
        _AGREED[key] = agree_reason(group, why, "ulysses ce eligibility")
    return _AGREED[key]


def probe_stream_mem_ops(device: torch.device) -> str | None:
    """Trial call of ``cuStreamWriteValue32`` / ``cuStreamWaitValue32`` (the V1 device
    attribute can read 0 while the calls work): None if they work, else why not."""
    return capability.stream_mem_ops_reason(torch.device(device).index)


# ------------------------------------------------------------------------------ staging
def _mode(stream):
    """None outside CUDA graph capture, else a tag of the capture ``stream`` belongs to
    (its capture id where ``cudaStreamGetCaptureInfo`` answers)."""
    if not torch.cuda.is_current_stream_capturing():
        return None
    rt = runtime()
    try:
        res = rt.cudaStreamGetCaptureInfo(stream.cuda_stream)
        if ok(res) and len(res) > 2:
            return ("capture", int(res[2]))
    except Exception:  # noqa: BLE001 - the id only sharpens the tag
        pass
    return ("capture", None)


def _bucket(nbytes: int) -> int:
    """Round up to 1/8 of the next power of two (≤ 12.5 % waste), at least 64 KiB."""
    n = max(nbytes, 1 << 16)
    step = max(1 << 16, (1 << (n - 1).bit_length()) // 8)
    return _align((n + step - 1) // step * step)


class CopyEngineTransport(Transport):
    """Copy-engine transport (see the module docstring).

    Arguments:
        group, rank, world_size, timeout_s: as ``Transport``.
        device: the CUDA device.
        flag_mode: ``"auto"`` (stream memory ops if the trial call works, else Triton kernels;
            agreed across ranks), ``"stream"`` or ``"kernel"`` (env
            ``ATTNCOMM_ULYSSES_CE_FLAGS``).
        cache_entries: staging buffers kept (LRU).

    Attributes:
        failures: the substrate's ``PeerErrors`` (error words, broken state) of this transport.
    """

    name = "ce"
    result_aliases_staging = True

    def __init__(self, group, rank: int, world_size: int, timeout_s: float, *,
                 device: torch.device, flag_mode: str | None = None,
                 cache_entries: int | None = None):
        super().__init__(group, rank, world_size, timeout_s)
        self.device = torch.device(device)
        self.flag_mode = self._agree_flag_mode(flag_mode)
        self.mapping = capability.peer_mapping(group).kind  # collective on first use
        self.failures = PeerErrors(world_size, self.device, op="ulysses ce", rank=rank,
                                   timeout_s=timeout_s)
        self.flags = Flags(self.flag_mode, self.failures.words, timeout_s)
        self.capacity = cache_entries if cache_entries is not None else CACHE_ENTRIES
        self.cache: collections.OrderedDict = collections.OrderedDict()
        self.evictions = 0
        self.rt = runtime()
        n_streams = max(1, min(world_size - 1, 4))
        self.streams = [torch.cuda.Stream(device=self.device) for _ in range(n_streams)]
        self.side = torch.cuda.Stream(device=self.device)  # the watchdog's flag writes
        if triton_reason() is None:
            self.flags.warm(self.device)

    def _agree_flag_mode(self, flag_mode) -> str:
        mode = flag_mode or config.get("ATTNCOMM_ULYSSES_CE_FLAGS")
        if mode not in ("auto", "stream", "kernel"):
            raise ValueError(f"flag_mode must be 'auto', 'stream' or 'kernel', got {mode!r}")
        if mode == "kernel":
            return mode
        why = probe_stream_mem_ops(self.device)
        if agreed_min(self.group, int(why is None)) == 1:
            return "stream"
        if mode == "stream":
            raise ValueError(f"ce flag_mode='stream': stream memory ops do not work on every "
                             f"rank ({why or 'a peer failed the probe'})")
        return "kernel"

    @property
    def broken(self) -> PeerTimeoutError | None:
        return self.failures.broken

    def close(self) -> None:
        """Collective: free every staging buffer once every rank got here (no peer still
        copies into one), each through ``SymmWorkspace.close`` (agreed across ranks, bounded;
        a broken transport or a peer that does not come frees without the peers). The
        transport can allocate again afterwards."""
        for st in self.cache.values():
            st.close()
        self.cache.clear()

    # -------------------------------------------------------------------------- cache
    def _key(self, plan: ExchangePlan, dtype) -> tuple:
        """``(tiled, size bucket, n)``: the first entry of that shape whose next slot is not
        held (every rank makes the same calls, so every rank picks the same entry). Two
        exchanges in flight per shape fit one entry; more in flight (a pipeline's q/k and v
        exchanges of the same bucket, two head groups ahead) take further entries."""
        item = dtype.itemsize
        base = (plan.tiled, _bucket(max(plan.recv_numel) * item))
        n = 0
        while (st := self.cache.get(base + (n,))) is not None and st.held[st.parity]:
            n += 1
        return base + (n,)

    def prepare(self, plan: ExchangePlan, dtype) -> str | None:
        """None if ``start`` can run this plan now (allocating its staging buffer if needed,
        collectively), else why not (the same on every rank). Raises ``ValueError`` when a new
        buffer would be needed inside CUDA graph capture (warm the shape up eagerly)."""
        self.check()
        key = self._key(plan, dtype)
        if key in self.cache:
            return None
        if torch.cuda.is_current_stream_capturing():
            raise ValueError(
                "ulysses ce: a staging buffer for a new message size is needed inside CUDA "
                "graph capture, where it cannot be allocated (collective): run this call "
                "shape once eagerly on every rank before capturing")
        return self._allocate(key)

    def _allocate(self, key) -> str | None:
        g = cpu_group(self.group)
        # Entries used inside a CUDA graph are pinned (the graph holds their addresses); the
        # bound counts the others.
        victims = [k for k, st in self.cache.items() if not st.pinned and not any(st.held)]
        if len(victims) >= self.capacity and victims:
            # Every rank evicts the same entry at the same call; make sure nobody still reads
            # or writes it.
            torch.cuda.synchronize(self.device)
            dist.barrier(group=g)
            self.cache.pop(victims[0]).release()
            self.evictions += 1
        # Allocate (may fail on one rank, e.g. OOM) → agree → rendezvous only if every rank
        # allocated: a rank that failed never leaves its peers waiting in the rendezvous.
        st, why = capability.collective_try(
            self.group, lambda: _Staging(self.group, self.rank, self.world_size, key[1],
                                         self.device, failures=self.failures,
                                         mapping=self.mapping),
            "ulysses ce staging allocation")
        if why:
            return f"staging allocation failed: {why}"
        _, why = capability.collective_try(self.group, st.rendezvous,
                                           "ulysses ce staging rendezvous")
        if why:
            return f"staging rendezvous failed: {why}"
        self.cache[key] = st
        return None

    def check(self) -> None:
        """Raise ``PeerTimeoutError`` if a wait of this transport timed out (the error words
        and the watchdog's verdicts; no CUDA call)."""
        self.failures.check()

    # -------------------------------------------------------------------------- exchange
    def _entry(self, plan: ExchangePlan, dtype) -> tuple:
        self.check()
        key = self._key(plan, dtype)
        if key not in self.cache:
            why = self.prepare(plan, dtype)
            if why:
                raise ValueError(f"ulysses ce: {why}")
        return key, self.cache[key]

    def send_storage(self, plan: ExchangePlan) -> int:
        return 0  # its own staging: the slot and a send staging buffer per parity

    def send_buffer(self, plan: ExchangePlan, dtype: torch.dtype, device: torch.device,
                    storage: torch.Tensor | None = None) -> SendBuffer:
        """Views of this transport's staging for the next ``start(plan, ..., send=)``: for a
        tiled plan ``regions[rank]`` is this rank's own region of its receive slot (written in
        place, never copied), the peers' regions lie in a local send staging buffer that the
        copy engine reads. The current stream first waits (on the device) until the last
        release of that slot and the copies that last read that buffer are done."""
        key, st = self._entry(plan, dtype)
        k, r = st.parity, self.rank
        item = dtype.itemsize
        own_in_slot = plan.tiled
        need = sum(n for p, n in enumerate(plan.numel[r]) if p != r or not own_in_slot) * item
        cur = torch.cuda.current_stream(self.device)
        mode = _mode(cur)
        st.await_slot(cur, k, mode)
        for ev in st.marks(mode).send_done[k]:
            cur.wait_event(ev)
        buf = st.send_bufs[k]
        if buf is None or buf.numel() < need:
            if torch.cuda.is_current_stream_capturing():
                raise ValueError("ulysses ce: a new send buffer size inside CUDA graph "
                                 "capture: run this call shape once eagerly before capturing")
            # Both parities at once: one eager call of a shape takes one parity, and the
            # capture that follows it takes the other, where nothing may be allocated.
            for j in (k, 1 - k):
                old = st.send_bufs[j]
                if old is None or old.numel() < need:
                    if old is not None:
                        for cs in self.streams:
                            old.record_stream(cs)
                    st.send_bufs[j] = torch.empty(_bucket(need), dtype=torch.uint8,
                                                  device=self.device)
            buf = st.send_bufs[k]
        flat = buf.view(dtype)
        regions, base = [], 0
        for p, n in enumerate(plan.numel[r]):
            if p == r and own_in_slot:
                lo = plan.region_start[r][r]
                regions.append(st.slot_view(k, plan.recv_numel[r], dtype)[lo:lo + n])
            else:
                regions.append(flat[base:base + n])
                base += n
        return SendBuffer(plan, dtype, r, tuple(regions), None, token=(key, k, st))

    def start(self, plan: ExchangePlan, parts: Sequence[torch.Tensor], dtype: torch.dtype,
              device: torch.device, out: torch.Tensor | None = None, *,
              send: SendBuffer | None = None) -> Exchange:
        """Enqueue the exchange of ``parts`` (or of ``send``, a buffer a fill packed) with
        ``plan``; nothing waits on the host. Streams of one exchange on rank r with parity k
        (``A``/``F``: the flags of the module docstring; time runs right)::

            caller  ready ................ own pieces -> slot k | wait(): F[k][s] == tag
            copy 0    +- wait A[k][p1] == 1 -- copy -> p1's slot k -- F[k][r] = tag at p1
            copy 1    +- wait A[k][p2] == 1 -- copy -> p2's slot k -- F[k][r] = tag at p2
            caller  (after reading slot k) release(): A[k][r] = 1 at every source s

        Peers in ``send_order`` share ``min(W - 1, 4)`` copy streams round-robin; an A wait
        that has no device deadline (a memory op outside capture) is handed to the watchdog.
        """
        key, st = self._entry(plan, dtype)
        if send is not None:
            self._validate_send(plan, dtype, send)
            if send.token != (key, st.parity, st):
                raise ValueError("ulysses ce: send buffer is stale (take it right before the "
                                 "start it is for)")
        self.cache.move_to_end(key)
        capturing = torch.cuda.is_current_stream_capturing()
        if capturing:
            st.pinned = True
        k = st.take()
        item = dtype.itemsize
        r, w = self.rank, self.world_size
        cur = torch.cuda.current_stream(self.device)
        mode = _mode(cur)
        ready = _record(cur)
        done, a_waits = {}, []
        for i, p in enumerate(send_order(r, w)):
            cs = self.streams[i % len(self.streams)]
            cs.wait_event(ready)
            a_waits.append(self._bounded_wait(cs, st.a_addr(r, k, p), p, capturing))
            self._copy_to(cs, st.slot_addr(p, k), plan, p, parts, send, item)
            self.flags.write(cs, st.f_addr(p, k, r), plan.tag, kernel=capturing)
            done[p] = _record(cs)
        if send is not None:
            st.marks(mode).send_done[k] = list(done.values())
        elif w > 1:
            for x in parts:  # the copy streams read them: keep their memory until then
                for cs in self.streams:
                    x.record_stream(cs)
        self._watch(a_waits, capturing, lambda p: [(st.a_addr(r, k, p), 1)])
        local = st.slot_view(k, plan.recv_numel[r], dtype)
        if send is None or not plan.tiled:
            st.await_slot(cur, k, mode)  # this rank's own pieces, written on its stream
            srcs = (send_views(send, r) if send is not None else
                    [(x, source_view(parts, x)) for x in plan.pieces[r][r]])
            for x, src in srcs:
                dst = local.as_strided((x.rows, x.cols), (x.dst_pitch, 1),
                                       local.storage_offset() + x.dst_offset)
                dst.copy_(src)
        return _CEExchange(self, st, k, plan, local, out, done, capturing)

    def _bounded_wait(self, stream, addr: int, peer: int, capturing: bool, value: int = 1):
        """Enqueue the wait for ``peer``'s flag at ``addr`` on ``stream``; returns ``(peer,
        started, passed)``: events right before and right after that wait (None when the
        watchdog will not watch it), so that on a shared stream the budget of a peer runs
        from when the stream reaches that peer's own wait, and a timeout names the peer that
        did not answer, not those queued behind it."""
        watched = not capturing and self.flags.unbounded
        started = _record(stream) if watched else None
        self.flags.wait(stream, addr, value, peer, bounded=capturing)
        return peer, started, _record(stream) if watched else None

    def _watch(self, waits: list, capturing: bool, addrs) -> None:
        """Hand the waits that have no device deadline to the watchdog, one per peer
        (``_bounded_wait``): past ``timeout_s`` from when the stream reached it, the watchdog
        writes the awaited flags (``addrs(peer)``: ``(address, value)`` pairs) locally on the
        side stream, and the stream goes on to the next wait, which has a budget of its own.

        The watchdog releases such a wait only if every kernel launched behind it has been
        launched before in this process: with CUDA's lazy module loading (the default), a
        kernel's first launch waits for its module load behind the unanswered wait, inside the
        driver, holding the GIL, so the watchdog thread cannot run. Hence a process's first
        forward must not meet a dead peer on this path: warm up first, or set
        ``CUDA_MODULE_LOADING=EAGER``, or use ``flag_mode="kernel"`` (device deadlines)."""
        if capturing or not waits or not self.flags.unbounded:
            return

        def release(blocked):
            for p in blocked:
                for addr, value in addrs(p):
                    self.flags.write(self.side, addr, value)

        index = self.device.index if self.device.index is not None else \
            torch.cuda.current_device()
        for p, started, passed in waits:
            watchdog().add(PendingWait(self.failures, started, {p: passed}, self.timeout_s,
                                       release, index))

    def _copy_to(self, cs, base: int, plan: ExchangePlan, p: int, parts, send, item) -> None:
        """Everything this rank sends to ``p`` into ``p``'s slot at ``base``: from the send
        buffer one 1D copy per region of a tiled plan, else one copy per piece."""
        r = self.rank
        if send is not None and plan.tiled:
            region = send.regions[p]
            if region.numel():
                self._raw_copy(cs, base + plan.region_start[r][p] * item, region.data_ptr(),
                               region.numel() * item)
            return
        srcs = (send_views(send, p) if send is not None else
                [(x, source_view(parts, x)) for x in plan.pieces[r][p]])
        for x, src in srcs:
            self._copy(cs, base, x, src, item)

    def _raw_copy(self, stream, dst: int, src: int, nbytes: int) -> None:
        rt = self.rt
        res = rt.cudaMemcpyAsync(dst, src, nbytes, rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice,
                                 stream.cuda_stream)
        if not ok(res):
            raise RuntimeError(f"ulysses ce: copy of {nbytes} B failed: {res}")

    def _copy(self, stream, base: int, x, src: torch.Tensor, item: int) -> None:
        """Rows of ``src`` (``[rows, cols]``, unit column stride) to ``base + dst_offset`` with
        the destination pitch: a 1D or pitched 2D copy-engine copy."""
        dst = base + x.dst_offset * item
        width = x.cols * item
        spitch = src.stride(0) * item
        dpitch = x.dst_pitch * item
        s = stream.cuda_stream
        rt = self.rt
        if rt is None:
            raise RuntimeError("ulysses ce needs cuda.bindings for copy-engine copies")
        kind = rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
        if x.rows == 1 or (spitch == width and dpitch == width):
            res = rt.cudaMemcpyAsync(dst, src.data_ptr(), width * x.rows, kind, s)
        else:
            res = rt.cudaMemcpy2DAsync(dst, dpitch, src.data_ptr(), spitch, width, x.rows,
                                       kind, s)
        if not ok(res):
            raise RuntimeError(f"ulysses ce: copy of {x.rows}×{width} B failed: {res}")


def _record(stream) -> torch.cuda.Event:
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


class _CEExchange(Exchange):
    """An exchange in flight. ``wait()`` orders the caller's stream after every source's flag
    and this rank's own copies (device-side; the host does not wait) and returns the slot, or
    copies it into ``out`` (then releases the slot)."""

    def __init__(self, t, st, k, plan, local, out, done, capturing):
        self.t, self.st, self.k, self.plan = t, st, k, plan
        self.local, self.out, self.done = local, out, done
        self.capturing = capturing
        self._result = None
        self._released = False

    def wait(self) -> torch.Tensor:
        if self._result is not None:
            return self._result
        t, st, k, r = self.t, self.st, self.k, self.t.rank
        cur = torch.cuda.current_stream(t.device)
        tag = self.plan.tag
        f_waits = [t._bounded_wait(cur, st.f_addr(r, k, s), s, self.capturing, tag)
                   for s in recv_order(r, t.world_size)]
        for ev in self.done.values():
            cur.wait_event(ev)
        t._watch(f_waits, self.capturing, lambda s: [(st.f_addr(r, k, s), tag)])
        result = self.local
        if self.out is not None:
            self._copy_out()
            result = self.out
            self.release()
        self._result = result
        return result

    def _copy_out(self) -> None:
        plan, r = self.plan, self.t.rank
        if plan.covers(r):
            self.out.copy_(self.local)
            return
        for s in range(plan.world_size):
            for x in plan.pieces[s][r]:
                off = x.dst_offset
                src = self.local.as_strided((x.rows, x.cols), (x.dst_pitch, 1),
                                            self.local.storage_offset() + off)
                dst = self.out.as_strided((x.rows, x.cols), (x.dst_pitch, 1),
                                          self.out.storage_offset() + off)
                dst.copy_(src)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        t, st, k, r = self.t, self.st, self.k, self.t.rank
        cur = torch.cuda.current_stream(t.device)
        kernel = torch.cuda.is_current_stream_capturing()
        for s in recv_order(r, t.world_size):
            t.flags.write(cur, st.a_addr(s, k, r), 1, kernel=kernel)
        # The caller's reads of slot k are enqueued before this point: the next user of the
        # slot writes its own region only after this event (``_Staging.await_slot``).
        st.put(k)
        st.marks(_mode(cur)).released[k] = _record(cur)
