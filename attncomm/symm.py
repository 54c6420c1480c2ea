"""The symmetric-memory substrate: what every exchange over peer-mapped memory shares.

- ``SymmWorkspace``: one symmetric slab (allocate, then rendezvous, each agreed across ranks by
  the caller through ``capability.collective_try``), the peers' slab addresses, a small device
  word array for epochs, and ``close()`` / ``release()``. Its layout belongs to its user (DCP's
  merge: ``attncomm.dcp.lse_merge.symm_layout``; the Ulysses ``ce`` transport: flags + two
  slots). The peers' slabs are mapped one of two ways (``capability.peer_mapping``, the same on
  every rank of a group): torch SymmetricMemory where every rank has a GPU of its own, or CUDA
  IPC (torch's: ``torch.multiprocessing.reductions``; a plain allocation whose handle every
  peer opens) where ranks share a GPU, which torch's allocator refuses, or where torch's is
  unavailable. Above the mapping nothing differs: kernels and copies get peer addresses.
- ``PeerErrors``: per-peer error words and the broken-after-timeout state of one exchange
  object. The words live in mapped pinned host memory: a kernel (or a stream memory op) that
  gave up waiting for peer ``p`` stores 1 at ``words[p]`` with a system-scope store, and the
  host reads them with no CUDA call, so the hot path never synchronises. Once a wait timed out
  the ranks are out of step, so the object is broken: every later ``check()`` (each call does
  one) raises ``PeerTimeoutError`` naming the peers; build a new one on every rank.
- Protocol helpers shared by the push kernels' hosts (``plan_blocks``, ``num_warps``,
  ``grid_bound``, ``ll_rows_for``, ``use_ll``; constants
  ``DELTA_UNIT``, ``SCRUB_PERIOD``, ``LL_MAX_BYTES``); the slabs' region layouts and the
  kernels' descriptor are ``attncomm.symm_regions``; the device half (epochs, scrub, bounded
  waits, LL words) is ``attncomm.symm_device``.
- The watchdog (``attncomm.watchdog``) polls every live ``PeerErrors`` and releases the
  waits the host enqueued without a device deadline.

CPU processes (gloo tests, the Triton interpreter) get plain host memory for the words.
"""
from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

from . import capability, collectives, config
from ._dist import cpu_group, group_key, guard_timeout, wait
from .errors import PeerTimeoutError, ranks_text
from .watchdog import watchdog

__all__ = ["SymmWorkspace", "PeerErrors", "plan_blocks",
           "num_warps", "grid_bound", "ll_rows_for", "use_ll", "DELTA_UNIT",
           "SCRUB_PERIOD", "LL_MAX_BYTES", "held_bytes"]

#: Peer offsets are given to kernels in units of this many elements (keeps stores vectorised).
DELTA_UNIT = 16
#: Epochs ``e`` with ``(e >> 1) % SCRUB_PERIOD == 0`` scrub the other parity slot first.
SCRUB_PERIOD = 1 << 29
#: Payload per peer up to which a push kernel takes the LL protocol by default (the table's
#: ``ATTNCOMM_SYMM_LL_MAX_BYTES`` default).
LL_MAX_BYTES = config.VARS["ATTNCOMM_SYMM_LL_MAX_BYTES"].default
#: Bytes of a block per warp: about one 16-byte vector per thread and row chunk.
_BYTES_PER_WARP = 32 * 16
#: Blocks from this size take ``num_warps``'s ``wide_warps``.
WIDE_BYTES = 32 * 1024


def plan_blocks(n_rows: int, n_programs_max: int, max_block_rows: int = 64):
    """Rows per block (a power of two ≤ ``max_block_rows``) and grid size for ``n_rows`` rows:
    enough rows per block that the blocks roughly fill ``n_programs_max`` programs.

    Returns ``(block_rows, n_blocks, grid)``; the same on every rank for the same inputs."""
    if n_rows <= 0:
        return 1, 0, 0
    per = -(-n_rows // max(n_programs_max, 1))
    br = 1
    while br < per and br < max_block_rows:
        br *= 2
    n_blocks = -(-n_rows // br)
    return br, n_blocks, min(n_blocks, n_programs_max)


def num_warps(nbytes: int, max_warps: int = 16, wide_warps: int = 0) -> int:
    """Warps for a program whose block holds ``nbytes``: about one 16-byte vector per thread and
    row chunk, at least 1 and at most ``max_warps``; ``wide_warps`` (0: none) for blocks of
    ``WIDE_BYTES`` or more, whatever ``max_warps`` says."""
    if wide_warps > 0 and nbytes >= WIDE_BYTES:
        return wide_warps
    return max(1, min(max_warps, nbytes // _BYTES_PER_WARP))


def grid_bound(device, programs_per_sm: int = 1, max_programs: int = 0) -> int:
    """Programs a persistent push kernel may launch on ``device`` so that all are resident:
    ``programs_per_sm`` per SM, at most ``max_programs`` (0: no cap). On a CPU device (the
    Triton interpreter) 3, so that a few programs and their block loops run. Local: agree it
    across ranks (``_agree.agreed_min``) before planning."""
    device = torch.device(device)
    if device.type != "cuda":
        n = 3
    else:
        n = max(1, torch.cuda.get_device_properties(device).multi_processor_count
                * programs_per_sm)
    return min(n, max_programs) if max_programs > 0 else n


def ll_rows_for(max_rows: int, head_dim: int, itemsize: int,
                ll_max_bytes: int = LL_MAX_BYTES) -> int:
    """Rows per LL cell: the rows whose payload per peer fits ``ll_max_bytes`` (0 when a row of
    ``head_dim · itemsize`` bytes cannot be cut into 32-bit words)."""
    if (head_dim * itemsize) % 4:
        return 0
    return min(max_rows, ll_max_bytes // (head_dim * itemsize))


def use_ll(n_rows: int, layout) -> bool:
    """Whether a call of ``n_rows`` rows per peer takes the LL protocol (``layout.ll_rows``:
    the rows an LL cell holds)."""
    return 0 < n_rows <= layout.ll_rows


class PeerErrors:
    """Error words ``[W] int32`` (mapped pinned host memory on CUDA) and the broken state.

    Arguments:
        world_size: peers (group ranks) that can be named.
        device: the exchange's device (``cuda``: pinned host words; else plain host memory).
        op: the exchange's name in messages. rank: this rank. timeout_s: the wait budget.

    Attributes:
        words: the ``[W] int32`` CPU tensor kernels write (pass it as a pointer argument: the
            launcher maps it; a kernel stores 1 at ``words[p]`` with ``scope="sys"``).
        broken: the error every later ``check()`` raises (None while usable).
    """

    def __init__(self, world_size: int, device: torch.device, *, op: str, rank: int = 0,
                 timeout_s: float | None = None, watch: bool = True):
        device = torch.device(device)
        pin = device.type == "cuda" and torch.cuda.is_available()
        self.words = torch.zeros(world_size, dtype=torch.int32, pin_memory=pin)
        self._view = memoryview(self.words.numpy()).cast("B")
        self._zero = bytes(len(self._view))
        self.op, self.rank, self.timeout_s = op, rank, timeout_s
        self.broken: PeerTimeoutError | None = None
        self._lock = threading.Lock()
        if watch:
            watchdog().watch(self)

    def peers(self) -> list[int]:
        """Peers whose word is set (a host read, no CUDA call)."""
        return [p for p, v in enumerate(self.words.tolist()) if v]

    def poll(self) -> bool:
        """Turn set error words into the broken state (no raise). True once broken."""
        if self.broken is None and self.failed():  # a set word
            peers = self.peers()
            self.mark_broken(peers, f"rank {self.rank} waited for {ranks_text(peers)} past the "
                                    f"timeout" + self._budget() + "; the peer did not signal")
        return self.broken is not None

    def failed(self) -> bool:
        """Whether ``check()`` would raise now: the broken state or a set word (reads the
        words; no CUDA call, no change of state)."""
        return self.broken is not None or self._view.tobytes() != self._zero

    def check(self) -> None:
        """Raise ``PeerTimeoutError`` if a wait timed out, now or before (reads the words; no
        CUDA call)."""
        if self.broken is not None or self.poll():
            self._raise()

    def ensure_usable(self) -> None:
        """Raise ``PeerTimeoutError`` if the broken state is set (does not read the words)."""
        if self.broken is not None:
            self._raise()

    def mark_broken(self, peers: Sequence[int], what: str) -> None:
        """Set the broken state (the first reason wins; later ones are dropped)."""
        with self._lock:
            if self.broken is None:
                self.broken = PeerTimeoutError(
                    f"{self.op}: {what}; unusable from now on: construct a new one on every "
                    f"rank", peer_ranks=list(peers), timeout_s=self.timeout_s, op=self.op)

    def _budget(self) -> str:
        return f" of {self.timeout_s:g} s" if self.timeout_s else ""

    def _raise(self):
        b = self.broken
        raise PeerTimeoutError(str(b), peer_ranks=b.peer_ranks, timeout_s=b.timeout_s, op=b.op)


def _group_or_world(group):
    return group if group is not None else dist.group.WORLD


#: Every workspace whose slab is allocated (dropped on release or when garbage collected).
_LIVE: weakref.WeakSet = weakref.WeakSet()


def held_bytes(group=None) -> int:
    """Bytes of symmetric memory this process holds for ``group`` (None: the default group),
    over every live workspace (DCP merge and query gather slabs, Ulysses ``ce`` staging)."""
    key = group_key(_group_or_world(group))
    return sum(ws.nbytes for ws in list(_LIVE) if group_key(ws.group) == key)


def _decided_mapping(group, op: str) -> str:
    """The group's decided peer mapping (the constructor is local: it runs inside
    ``collective_try`` and must make no collective)."""
    m = capability.known_peer_mapping(group)
    if m is None:
        raise RuntimeError(f"{op}: the group's peer mapping is not decided yet: call "
                           f"capability.peer_mapping(group) on every rank first (the "
                           f"eligibility check does), or pass mapping=")
    return m.kind


class SymmWorkspace:
    """A symmetric slab of one group: allocate (constructor), rendezvous, release.

    Arguments:
        group: the process group (None: default). Collective: every rank constructs it with
            the same size; allocation and rendezvous may fail on one rank, so the caller runs
            each through ``capability.collective_try`` (allocate with ``rendezvous=False``,
            then ``rendezvous()`` only once every rank allocated).
        size: bytes, or a layout with ``total_bytes`` and ``world_size`` (checked against the
            group).
        device: the CUDA device.
        op: the exchange's name in messages. timeout_s: its wait budget.
        errors: the ``PeerErrors`` to report into (None: a new one; several workspaces of one
            exchange object share one).
        mapping: ``"torch"`` or ``"ipc"`` (None: the group's decided mapping,
            ``capability.known_peer_mapping``; RuntimeError when it is not decided yet).

    Attributes:
        slab: the local ``[size] uint8`` symmetric tensor (zeroed before the rendezvous).
        peer_ptrs: after ``rendezvous()``, every rank's slab address in this process (group
            rank order).
        mapping: ``"torch"`` or ``"ipc"`` (the group's decided ``capability.peer_mapping``
            unless ``mapping`` is given; construction makes no collective).
        handle: the torch SymmetricMemory handle (after ``rendezvous()``; None with ipc).
        state: ``[4] int32`` device words for the user's epochs (zeroed).
        failures: the ``PeerErrors``; ``errors`` is its ``words`` tensor (kernel argument).

    Raises:
        ValueError: a layout for another world size. Whatever torch raises when allocation
        or rendezvous fails (the caller agrees across ranks and falls back).
    """

    def __init__(self, group, size, device: torch.device, *, op: str = "symm",
                 timeout_s: float | None = None, rendezvous: bool = True,
                 errors: PeerErrors | None = None, mapping: str | None = None):
        self.group = _group_or_world(group)
        self.device = torch.device(device)
        self.op, self.timeout_s = op, timeout_s
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        nbytes = getattr(size, "total_bytes", size)
        want = getattr(size, "world_size", self.world_size)
        if want != self.world_size:
            raise ValueError(f"{op}: layout for {want} ranks, group has {self.world_size}")
        self.layout = size if not isinstance(size, int) else None
        self.nbytes = int(nbytes)
        self.mapping = mapping or _decided_mapping(self.group, op)
        if self.mapping not in capability.MAPPINGS:
            raise ValueError(f"{op}: mapping must be one of {capability.MAPPINGS}, got "
                             f"{self.mapping!r}")
        self._peers: list = []  # the ipc mapping's views of every peer's slab
        self.slab = (self._allocate_torch() if self.mapping == "torch" else
                     torch.empty(self.nbytes, dtype=torch.uint8, device=self.device))
        self.slab.zero_()
        _LIVE.add(self)
        self.state = torch.zeros(4, dtype=torch.int32, device=self.device)
        self.failures = errors if errors is not None else PeerErrors(
            self.world_size, self.device, op=op, rank=self.rank, timeout_s=timeout_s)
        self.errors = self.failures.words
        self.handle = None
        self.peer_ptrs: list[int] = []
        if rendezvous:
            self.rendezvous()

    @classmethod
    def agreed(cls, group, size, device: torch.device, *, op: str,
               timeout_s: float | None = None) -> SymmWorkspace:
        """Allocate, then rendezvous, each step agreed across ranks
        (``capability.collective_try``): every rank gets a workspace, or every rank raises
        ``RuntimeError`` naming ``op`` and the step that failed on some rank."""
        mapping = capability.peer_mapping(group).kind  # collective on first use, before any try
        ws, reason = capability.collective_try(
            group, lambda: cls(group, size, device, op=op, timeout_s=timeout_s,
                               rendezvous=False, mapping=mapping), f"{op} allocation")
        if reason:
            raise RuntimeError(f"{op}: allocation failed: {reason}")
        _, reason = capability.collective_try(group, ws.rendezvous, f"{op} rendezvous")
        if reason:
            raise RuntimeError(f"{op}: rendezvous failed: {reason}")
        return ws

    def _allocate_torch(self) -> torch.Tensor:
        import torch.distributed._symmetric_memory as symm_mem

        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # deprecated (not needed) in newer torch
                    enable(self.group.group_name)
            except Exception:  # noqa: BLE001, S110 - already enabled
                pass
        return symm_mem.empty(self.nbytes, dtype=torch.uint8, device=self.device)

    def rendezvous(self) -> None:
        """Collective: exchange slab handles with every rank (host-blocking; before capture).
        Whatever the user wrote into the slab before it (zeros, initial flags) lands before
        any peer can write."""
        torch.cuda.synchronize(self.device)
        if self.mapping == "ipc":
            self._rendezvous_ipc()
            return
        import torch.distributed._symmetric_memory as symm_mem

        self.handle = symm_mem.rendezvous(self.slab, self.group.group_name)
        self.peer_ptrs = [int(p) for p in self.handle.buffer_ptrs]

    def _rendezvous_ipc(self) -> None:
        # Every rank's CUDA IPC handle of its slab (torch's reduction: the allocation's handle,
        # the slab's offset in it, a reference count the producer keeps the memory alive by)
        # over the gloo group; each rank opens every peer's (its own slab it has).
        g = cpu_group(self.group)
        handles: list = [None] * self.world_size
        with guard_timeout(g, f"{self.op} (CUDA IPC rendezvous)"):  # the group's timeout
            dist.all_gather_object(handles, reduce_tensor(self.slab), group=g)
        peers = []
        for q, (rebuild, args) in enumerate(handles):
            peers.append(self.slab if q == self.rank else rebuild(*args))
        self._peers = peers
        self.peer_ptrs = [int(t.data_ptr()) for t in peers]

    @property
    def broken(self) -> PeerTimeoutError | None:
        return self.failures.broken

    def check(self) -> None:
        """Raise ``PeerTimeoutError`` if a wait of this exchange timed out (no CUDA call)."""
        self.failures.check()

    def ensure_usable(self) -> None:
        """Raise ``PeerTimeoutError`` if the workspace is broken (no read of the words)."""
        self.failures.ensure_usable()

    def sync_check(self) -> None:
        """Finish the device's work, then ``check()`` (construction and tests only)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.check()

    def close(self) -> None:
        """Collective end of life: finish this rank's device work, then agree with every rank
        (bounded by the workspace's timeout) that all got here, so no peer still stores into
        the slab, and whether any rank is broken; then ``release()``. With the ipc mapping and
        no rank broken, every rank first closes its views of the peers' slabs and a second
        barrier keeps each slab alive until no peer maps it. Idempotent; never raises for a
        peer that does not come (it releases after the budget).

        When some rank is broken (a wait timed out: a peer may be gone) or a peer does not
        come, only the agreement runs, then the release: the peers' late stores still land in
        memory that no new tensor takes (torch SymmetricMemory keeps the physical pages while a
        peer maps them; CUDA IPC keeps the allocation while a peer's reference count is
        held)."""
        if self.slab is None:
            return
        try:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            g = cpu_group(self.group)
            if dist.get_world_size(g) > 1 and self._all_here_and_well(g) and self._peers:
                self._peers = []
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                wait(dist.barrier(group=g, async_op=True), g,
                     f"{self.op} (close: peers unmapped)", self.timeout_s)
        except PeerTimeoutError:
            pass  # a peer left between the two steps: released below all the same
        finally:
            self.release()

    def _all_here_and_well(self, g) -> bool:
        """The first step of ``close`` on every rank: an all_reduce(MAX) of this rank's broken
        flag over the gloo group, bounded by the timeout (it is also the barrier after which no
        peer stores into the slab). True when every rank came and none is broken; every rank
        that came gets the same answer."""
        flag = torch.tensor([0 if self.failures.broken is None else 1], dtype=torch.int64)
        try:
            wait(collectives.all_reduce(flag, op=dist.ReduceOp.MAX, group=g, async_op=True), g,
                 f"{self.op} (close)", self.timeout_s)
        except PeerTimeoutError:
            return False
        return int(flag.item()) == 0

    def release(self) -> None:
        """Drop the slab, its handle and (ipc) the views of the peers' slabs (call on every
        rank, after every rank is done with it: synchronise and barrier first when peers may
        still write; ``close()`` does)."""
        _LIVE.discard(self)
        ipc = self.mapping == "ipc" and self.slab is not None
        self._peers = []
        self.handle = None
        self.slab = None
        self.peer_ptrs = []
        if ipc and torch.cuda.is_available():
            torch.cuda.ipc_collect()  # free what peers no longer hold
