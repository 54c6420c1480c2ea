"""What this machine and group can do: local probes, then agreement across ranks.

Local facts (no communication): CUDA present, this host's name, P2P access between this rank's
GPU and every other GPU, torch SymmetricMemory importable with its CUDA backend, and stream
memory ops (``cuStreamWriteValue32`` / ``cuStreamWaitValue32`` from ``cuda.bindings.driver``),
probed by a trial call because the V1 device attribute reads 0 on H200 although the calls work.

Group facts: ``same_host``, ``group_hosts`` (which ranks share a host: the topology, cached per
group) and ``group_gpus`` (which GPU each rank uses, by device UUID: ranks may share one, cached
per group) gather the per-rank facts over the gloo twin of the group; ``peer_mapping`` decides,
once per group, how the ranks map each other's memory (torch SymmetricMemory, or CUDA IPC where
ranks share a GPU, which torch's allocator refuses, or where torch's is unavailable);
``agree_reason`` turns per-rank reasons into one verdict that every rank shares (all_reduce(MIN)
of an ok-flag); ``collective_try`` runs a step (allocation, rendezvous) on every rank, catches a
failure and agrees on it, so every rank takes the same path. A group that spans hosts is refused
by every single-host backend for that reason first (``symm_unavailable_reason``).
"""
from __future__ import annotations

import functools
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import config
from ._dist import cpu_group, group_key, on_forget_groups
from ._agree import agree_reason

__all__ = ["agree_reason", "hostname", "host_identity", "cuda_reason", "cuda_driver",
           "cuda_runtime", "cuda_ok", "p2p_matrix", "symm_mem_reason", "ipc_reason",
           "stream_mem_ops_reason", "same_host", "HostLayout", "group_hosts", "GpuLayout",
           "group_gpus", "device_uuid", "PeerMapping", "peer_mapping", "known_peer_mapping",
           "unmeasured_reason", "symm_unavailable_reason", "collective_try", "multicast_env",
           "MAPPINGS", "NOT_MEASURED"]

#: Why nothing is timed on CPU tensors (``unmeasured_reason``; a decision's reason).
NOT_MEASURED = "CPU: not measured"

_TEST_HOST = "/test:"  # joins the machine's identity and the test-only host name


def hostname() -> str:
    return socket.gethostname()


@functools.cache
def _machine_identity() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def host_identity() -> str:
    """This machine's identity for "same host" checks: the hostname plus the kernel's boot id
    (two containers may share a hostname without sharing memory or GPUs).

    ``ATTNCOMM_TEST_HOST`` (tests only, read on every call) adds a name to it, so that the
    ranks of one machine can act as several hosts; added to the machine's identity, it can
    split a machine but never make two machines look like one."""
    test = config.get("ATTNCOMM_TEST_HOST")
    return _machine_identity() + (f"{_TEST_HOST}{test}" if test else "")


def _display_name(identity: str) -> str:
    """A host identity without the boot id: ``name`` or ``name/test:X``."""
    machine, _, test = identity.partition(_TEST_HOST)
    return machine.split("/", 1)[0] + (f"{_TEST_HOST}{test}" if test else "")


def _ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` → ``"0-2, 5"``."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(f"{start}" if start == r else f"{start}-{r}")
            start = None
    return ", ".join(parts)


@dataclass(frozen=True)
class HostLayout:
    """Which ranks of a group share a host: the group's topology, the same on every rank.

    Attributes:
        identities: one ``host_identity()`` per host, hosts in the order of their lowest rank.
        host_of: the host index of each group rank (``len == W``).
    """

    identities: tuple[str, ...]
    host_of: tuple[int, ...]

    @classmethod
    def from_identities(cls, per_rank: Sequence[str]) -> HostLayout:
        hosts = tuple(dict.fromkeys(per_rank))  # first appearance = lowest rank
        index = {h: i for i, h in enumerate(hosts)}
        return cls(hosts, tuple(index[h] for h in per_rank))

    @property
    def num_hosts(self) -> int:
        return len(self.identities)

    @property
    def ranks(self) -> tuple[tuple[int, ...], ...]:
        """The group ranks of each host, ascending."""
        return tuple(tuple(r for r, h in enumerate(self.host_of) if h == i)
                     for i in range(self.num_hosts))

    @property
    def leaders(self) -> tuple[int, ...]:
        """Each host's lowest group rank (its leader in a hierarchical exchange)."""
        return tuple(r[0] for r in self.ranks)

    @property
    def names(self) -> tuple[str, ...]:
        """Each host's printable name (hostname, and the test-only name where set)."""
        return tuple(_display_name(h) for h in self.identities)

    def describe(self) -> str:
        """``"2 hosts (a: ranks 0-1; b: ranks 2-3)"``."""
        hosts = "; ".join(f"{n}: ranks {_ranges(r)}" for n, r in zip(self.names, self.ranks))
        return f"{self.num_hosts} host{'s' if self.num_hosts > 1 else ''} ({hosts})"

    def reason(self) -> str | None:
        """Why a single-host transport (symmetric memory, P2P copies, host shared memory)
        cannot serve the group; None on one host."""
        if self.num_hosts == 1:
            return None
        return (f"the group's ranks span {self.describe()}: symmetric memory, P2P copies and "
                f"host shared memory reach only the ranks of one host")


_HOSTS: dict = {}  # group_key(group) → HostLayout


def group_hosts(group=None) -> HostLayout:
    """Which ranks of ``group`` share a host (``HostLayout``), the same on every rank.

    Collective over the group's gloo twin on its first use per group (every rank must call it
    then), cached for the group's lifetime after that: a rank's host does not change."""
    key = group_key(group)
    layout = _HOSTS.get(key)
    if layout is None:
        layout = _HOSTS[key] = HostLayout.from_identities(_gather(group, host_identity()))
    return layout


def cuda_driver():
    """``cuda.bindings.driver``, or None where it is not importable (an optional dependency)."""
    try:
        from cuda.bindings import driver
        return driver
    except Exception:  # noqa: BLE001 - optional dependency
        return None


def cuda_runtime():
    """``cuda.bindings.runtime``, or None where it is not importable."""
    try:
        from cuda.bindings import runtime
        return runtime
    except Exception:  # noqa: BLE001 - optional dependency
        return None


def cuda_ok(res) -> bool:
    """Whether a ``cuda.bindings`` call returned success (its result, or its first item)."""
    err = res[0] if isinstance(res, tuple) else res
    return int(getattr(err, "value", err)) == 0


def cuda_reason() -> str | None:
    """None when CUDA is usable, else why not."""
    if not torch.cuda.is_available():
        return "CUDA is not available (no GPU or a CPU-only torch build)"
    return None


def p2p_matrix() -> list[list[bool]]:
    """``m[i][j]``: can GPU i access GPU j's memory directly (True on the diagonal)."""
    if cuda_reason():
        return []
    n = torch.cuda.device_count()
    return [[i == j or bool(torch.cuda.can_device_access_peer(i, j)) for j in range(n)]
            for i in range(n)]


@functools.cache
def symm_mem_reason() -> str | None:
    """None when torch SymmetricMemory (CUDA backend) is importable here, else why not.

    Whether an allocation and rendezvous succeed is only known by doing them
    (``collective_try``)."""
    if cuda_reason():
        return cuda_reason()
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except Exception as exc:  # noqa: BLE001 - any import failure means "not here"
        return f"torch.distributed._symmetric_memory is not importable: {exc}"
    for name in ("empty", "rendezvous"):
        if not hasattr(symm_mem, name):
            return f"torch SymmetricMemory lacks {name}() in torch {torch.__version__}"
    get_backend = getattr(symm_mem, "get_backend", None)
    if get_backend is not None:
        try:
            backend = get_backend(torch.device("cuda", torch.cuda.current_device()))
        except Exception:  # noqa: BLE001 - older torch: no backend query, CUDA is the default
            backend = None
        if backend not in (None, "CUDA"):
            return f"torch SymmetricMemory backend is {backend}, not CUDA"
    return None


@functools.cache
def stream_mem_ops_reason(device_index: int | None = None) -> str | None:
    """None when ``cuStreamWriteValue32`` and ``cuStreamWaitValue32`` work on this GPU, probed by
    a trial write + wait on a scratch word; else why not."""
    if cuda_reason():
        return cuda_reason()
    try:
        from cuda.bindings import driver
    except Exception as exc:  # noqa: BLE001
        return f"cuda.bindings.driver is not importable: {exc}"
    dev = torch.device("cuda", torch.cuda.current_device() if device_index is None
                       else device_index)
    try:
        word = torch.zeros(1, dtype=torch.int32, device=dev)
        stream = driver.CUstream(torch.cuda.current_stream(dev).cuda_stream)
        ptr = driver.CUdeviceptr(word.data_ptr())
        (err,) = driver.cuStreamWriteValue32(stream, ptr, 7, 0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return f"cuStreamWriteValue32 returned {err}"
        geq = driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
        (err,) = driver.cuStreamWaitValue32(stream, ptr, 7, geq)
        if err != driver.CUresult.CUDA_SUCCESS:
            return f"cuStreamWaitValue32 returned {err}"
        torch.cuda.synchronize(dev)
        if int(word.item()) != 7:
            return f"cuStreamWriteValue32 did not write (read {int(word.item())})"
    except Exception as exc:  # noqa: BLE001
        return f"stream memory op trial failed: {type(exc).__name__}: {exc}"
    return None


def multicast_env() -> dict[str, str | None]:
    """The environment variables that keep NVLink multicast off (they must read 0/1/1)."""
    return {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                          "NVSHMEM_DISABLE_NVLS")}


def _gather(group, value) -> list:
    g = cpu_group(group)
    out: list = [None] * dist.get_world_size(g)
    dist.all_gather_object(out, value, group=g)
    return out


def same_host(group=None) -> bool:
    """Whether every rank of ``group`` runs on this host (collective over the gloo twin, on
    every call; ``group_hosts`` gives the whole layout, cached)."""
    return len(set(_gather(group, host_identity()))) == 1


def ipc_reason() -> str | None:
    """This rank's local reason against CUDA IPC (torch's own,
    ``torch.multiprocessing.reductions``): CUDA must be there; whether a handle opens is
    only known by opening it (the rendezvous, agreed through ``collective_try``)."""
    return cuda_reason()


def device_uuid(index: int) -> str:
    """A name of CUDA device ``index`` that is the same in every process of the machine,
    whatever its ``CUDA_VISIBLE_DEVICES``: the device UUID, else its PCI address (on a torch
    that reports neither, its index: right only when every process sees the same devices)."""
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    if uuid is not None and str(uuid):
        return f"GPU-{uuid}" if not str(uuid).startswith("GPU-") else str(uuid)
    bus = getattr(props, "pci_bus_id", None)
    if bus is not None:
        return (f"pci:{getattr(props, 'pci_domain_id', 0)}:{bus}:"
                f"{getattr(props, 'pci_device_id', 0)}")
    return f"index:{index}"


@dataclass(frozen=True)
class GpuLayout:
    """Which GPU each rank of a group uses, the same on every rank.

    Attributes:
        gpus: per group rank, ``(host identity, device UUID, device index)`` of its current
            CUDA device (``(host identity, "", -1)`` for a rank without CUDA).
    """

    gpus: tuple[tuple[str, str, int], ...]

    @property
    def shared(self) -> tuple[tuple[int, ...], ...]:
        """The sets of two or more ranks that use one GPU (in order of their lowest rank)."""
        on: dict = {}
        for r, (host, uuid, _) in enumerate(self.gpus):
            if uuid:
                on.setdefault((host, uuid), []).append(r)
        return tuple(tuple(rs) for rs in on.values() if len(rs) > 1)

    def shared_reason(self) -> str | None:
        """``"ranks 0-3 share GPU 0"`` when some ranks use one GPU, else None."""
        sets = self.shared
        if not sets:
            return None
        return "; ".join(f"ranks {_ranges(rs)} share GPU {self.gpus[rs[0]][2]}" for rs in sets)

    def p2p_reason(self, rank: int) -> str | None:
        """Why ``rank``'s GPU cannot reach the GPU of some other rank directly (None if it can
        reach all): ranks on one GPU need nothing; others need P2P access (local query)."""
        _, mine, idx = self.gpus[rank]
        if not mine:
            return cuda_reason() or "this rank has no CUDA device"
        for r, (_, uuid, other) in enumerate(self.gpus):
            if r == rank or uuid == mine:
                continue
            if not uuid:
                return f"rank {r} has no CUDA device"
            if not torch.cuda.can_device_access_peer(idx, other):
                return f"no P2P access from GPU {idx} to GPU {other} (rank {r})"
        return None


_GPUS: dict = {}  # group_key(group) → GpuLayout


def group_gpus(group=None) -> GpuLayout:
    """Which GPU each rank of ``group`` uses (``GpuLayout``), the same on every rank.

    Collective over the group's gloo twin on its first use per group (every rank must call it
    then), cached for the group's lifetime: a rank's device does not change under a group."""
    key = group_key(group)
    layout = _GPUS.get(key)
    if layout is None:
        if torch.cuda.is_available():
            idx = torch.cuda.current_device()
            mine = (host_identity(), device_uuid(idx), idx)
        else:
            mine = (host_identity(), "", -1)
        layout = _GPUS[key] = GpuLayout(tuple(tuple(x) for x in _gather(group, mine)))
    return layout


#: The peer mappings a symmetric slab can use (``ATTNCOMM_PEER_MAPPING`` forces one).
MAPPINGS = ("torch", "ipc")


@dataclass(frozen=True)
class PeerMapping:
    """How the ranks of a group map each other's slabs, the same on every rank.

    Attributes:
        kind: ``"torch"`` (torch SymmetricMemory) or ``"ipc"`` (CUDA IPC handles of plain
            allocations, exchanged over the gloo group).
        why: the reason for that choice, for ``attncomm env`` and messages.
        unavailable: why that mapping cannot serve the group (None if it can), agreed.
    """

    kind: str
    why: str
    unavailable: str | None = None


_MAPPING: dict = {}  # group_key(group) → PeerMapping


@on_forget_groups
def _forget_groups() -> None:
    _HOSTS.clear()
    _GPUS.clear()
    _MAPPING.clear()


def peer_mapping(group=None) -> PeerMapping:
    """Which peer mapping the symmetric slabs of ``group`` use (``PeerMapping``).

    ``ATTNCOMM_PEER_MAPPING`` (``auto``: decide) forces one. ``auto`` takes CUDA IPC when some
    ranks share a GPU (torch SymmetricMemory refuses allocations from overlapping devices of
    different ranks) or when torch SymmetricMemory is unavailable on some rank, else torch
    SymmetricMemory. CUDA IPC serves only a group whose ranks all use one GPU
    (``unavailable`` says so otherwise). Collective over the group's gloo twin on first use
    per group (the GPU layout and the agreement on each mapping's local facts), cached for the
    group's lifetime (the variable is read then)."""
    key = group_key(group)
    hit = _MAPPING.get(key)
    if hit is not None:
        return hit
    layout = group_gpus(group)
    shared = layout.shared_reason()
    torch_why = agree_reason(group, symm_mem_reason(), "torch SymmetricMemory")
    ipc_why = agree_reason(group, ipc_reason(), "CUDA IPC")
    gpus = len({(h, u) for h, u, _ in layout.gpus if u})
    if ipc_why is None and gpus > 1:
        # Opening a peer's handle maps it under the peer's device index, without peer access
        # from this rank's GPU: kernels would fault on it. One GPU for the whole group only.
        ipc_why = (f"CUDA IPC serves a group whose ranks all share one GPU; these ranks use "
                   f"{gpus} GPUs")
    if torch_why is None and shared is not None:
        torch_why = f"{shared}: torch SymmetricMemory refuses ranks on one GPU"
    forced = config.get("ATTNCOMM_PEER_MAPPING")
    if forced == "torch":
        m = PeerMapping("torch", "ATTNCOMM_PEER_MAPPING=torch", torch_why)
    elif forced == "ipc":
        m = PeerMapping("ipc", "ATTNCOMM_PEER_MAPPING=ipc", ipc_why)
    elif shared is not None:
        m = PeerMapping("ipc", f"{shared}: torch SymmetricMemory refuses ranks on one GPU",
                        ipc_why)
    elif torch_why is not None:
        m = PeerMapping("ipc", f"torch SymmetricMemory is unavailable ({torch_why})", ipc_why)
    else:
        m = PeerMapping("torch", "every rank has a GPU of its own and torch SymmetricMemory")
    _MAPPING[key] = m
    return m


def known_peer_mapping(group=None) -> PeerMapping | None:
    """The group's ``peer_mapping`` when it has been decided (no communication), else None."""
    return _MAPPING.get(group_key(group))


def unmeasured_reason(group, device: torch.device) -> str | None:
    """Why timing backends on ``group`` with ``device`` tensors would say nothing about their
    speed (None: timings are meaningful): CPU tensors, or ranks that share a GPU (their
    contexts run in time slices, so a peer-mapped exchange waits slices for its peers).
    Collective on first use per group (``group_gpus``) for CUDA tensors."""
    if torch.device(device).type != "cuda":
        return NOT_MEASURED
    shared = group_gpus(group).shared_reason()
    return None if shared is None else f"shared GPU ({shared}): time-sliced, not measured"


_PROBE_OVERRIDE: Callable | None = None


def _override_probe(fn: Callable | None) -> None:
    """Tests only: replace ``symm_unavailable_reason`` on this process by ``fn(group, device)``
    (None restores the real probe)."""
    global _PROBE_OVERRIDE
    _PROBE_OVERRIDE = fn


def symm_unavailable_reason(group, device: torch.device) -> str | None:
    """Collective over ``group`` (for every device type). This rank's reason against a
    symmetric-memory backend (None if it can run): one host (``group_hosts``; checked first, so
    a group that spans hosts is told so whatever its device), CUDA tensors, a peer mapping that
    can serve the group (``peer_mapping``), P2P between every pair of distinct GPUs. The caller
    agrees the verdict across ranks (``agree_reason``)."""
    if _PROBE_OVERRIDE is not None:
        return _PROBE_OVERRIDE(group, device)
    hosts = group_hosts(group).reason()  # collective on first use per group: always call
    if hosts is not None:
        return hosts
    if torch.device(device).type != "cuda":
        return f"the group's tensors are on {torch.device(device).type}, not CUDA"
    layout = group_gpus(group)  # collective on first use per group
    mapping = peer_mapping(group)  # collective on first use per group
    if mapping.unavailable is not None:
        return f"peer mapping {mapping.kind}: {mapping.unavailable}"
    return layout.p2p_reason(dist.get_rank(group))


def collective_try(group, fn: Callable[[], object], what: str,
                   discard: Callable[[object], None] | None = None):
    """Run ``fn()`` on every rank, catch a failure, and agree on it.

    Returns ``(value, None)`` when every rank succeeded, else ``(None, reason)`` with the same
    reason (naming each failing rank) on every rank; ``discard(value)`` then frees what this
    rank built. ``fn`` must not be collective in a way that hangs when a peer failed before
    reaching it (allocate here; rendezvous in a second call)."""
    value, err = None, None
    try:
        value = fn()
    except Exception as exc:  # noqa: BLE001 - agreed below; the caller raises or falls back
        err = f"{type(exc).__name__}: {exc}"
    reason = agree_reason(group, err, what)
    if reason is None:
        return value, None
    if discard is not None and value is not None:
        discard(value)
    return None, reason
