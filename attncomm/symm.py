"""Symmetric workspace: one torch SymmetricMemory slab per exchange object, the
device epoch, the peer pointer table and the device error word.

The slab's layout belongs to its user (DCP's: ``attncomm.dcp.symm_layout``).

The epoch and the error word are ordinary (local) device memory: ``state [4] int32`` holds
``[epoch, done_counter, 0, 0]``; ``errors [W] int32`` is set to 1 at ``src`` when a wait for
``src`` ran out of time. The kernels advance the epoch themselves (graph replays need no host
step); the host only reads the error word (``check``).
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from .errors import PeerTimeoutError

__all__ = ["SymmWorkspace"]

def _group_or_world(group):
    return group if group is not None else dist.group.WORLD


class SymmWorkspace:
    """A rendezvoused symmetric slab plus its epoch, pointer table and error word.

    Collective: every rank of ``group`` constructs it with the same layout (host-blocking; do it
    before any CUDA graph capture). Two workspaces are fully independent.

    Attributes:
        slab: the local ``[total_bytes] uint8`` symmetric tensor (zeroed at construction).
        ptrs: ``[W] int64`` device tensor, the slab's address on every rank (group rank order).
        state: ``[4] int32`` device tensor, ``[epoch, done_counter, 0, 0]``.
        errors: ``[W] int32`` device tensor, 1 at ``src`` after a wait for ``src`` timed out.

    Raises:
        RuntimeError (or whatever torch raises) when allocation or rendezvous fails; the caller
        agrees across ranks and falls back.
    """

    def __init__(self, group, layout: SlabLayout, device: torch.device, *, op: str = "symm",
                 timeout_s: float | None = None, rendezvous: bool = True):
        import torch.distributed._symmetric_memory as symm_mem

        self.group = _group_or_world(group)
        self.layout = layout
        self.device = torch.device(device)
        self.op = op
        self.timeout_s = timeout_s
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        if self.world_size != layout.world_size:
            raise ValueError(f"{op}: layout for {layout.world_size} ranks, group has "
                             f"{self.world_size}")
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                enable(self.group.group_name)
        self.slab = symm_mem.empty(layout.total_bytes, dtype=torch.uint8, device=self.device)
        self.slab.zero_()
        self.state = torch.zeros(4, dtype=torch.int32, device=self.device)
        self.errors = torch.zeros(self.world_size, dtype=torch.int32, device=self.device)
        self.handle = None
        self.broken: str | None = None
        if rendezvous:
            self.rendezvous()

    def rendezvous(self) -> None:
        """Collective: exchange slab handles with every rank (host-blocking; before capture)."""
        import torch.distributed._symmetric_memory as symm_mem

        # The zeroing must land before any peer can write: finish it, then rendezvous (which
        # returns only once every rank has arrived).
        torch.cuda.synchronize(self.device)
        self.handle = symm_mem.rendezvous(self.slab, self.group)

    def check(self) -> None:
        """Raise ``PeerTimeoutError`` if a kernel recorded a timed-out wait since the last check.

        Host-blocking (reads the error word). After a timeout the ranks' epochs no longer agree,
        so the workspace is marked broken and later calls raise ``RuntimeError``."""
        if self.broken is not None:
            raise RuntimeError(self.broken)
        flags = self.errors.cpu().tolist()
        if any(flags):
            peers = [i for i, f in enumerate(flags) if f]
            self.errors.zero_()
            self.broken = (f"{self.op}: unusable after a timeout waiting for rank(s) {peers}; "
                           f"construct a new one on every rank")
            raise PeerTimeoutError(
                f"{self.op}: rank {self.rank} waited for source rank(s) {peers} past the "
                f"timeout" + (f" of {self.timeout_s:g} s" if self.timeout_s else "")
                + "; the peer did not signal", peer_ranks=peers, timeout_s=self.timeout_s,
                op=self.op)

    def ensure_usable(self) -> None:
        if self.broken is not None:
            raise RuntimeError(self.broken)
