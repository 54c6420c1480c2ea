"""What this machine and group can do: local probes, then agreement across ranks.

Local facts (no communication): CUDA present, this host's name, P2P access between this rank's
GPU and every other GPU, torch SymmetricMemory importable with its CUDA backend, and stream
memory ops (``cuStreamWriteValue32`` / ``cuStreamWaitValue32`` from ``cuda.bindings.driver``),
probed by a trial call because the V1 device attribute reads 0 on H200 although the calls work.

Group facts: ``same_host`` and ``peer_access`` gather the per-rank facts over the gloo twin of the
group; ``agree_reason`` turns per-rank reasons into one verdict that every rank shares
(all_reduce(MIN) of an ok-flag); ``collective_try`` runs a step (allocation, rendezvous) on every
rank, catches a failure and agrees on it, so every rank takes the same path.
"""
from __future__ import annotations

import functools
import os
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist

from ._dist import agree_reason, cpu_group

__all__ = ["agree_reason", "hostname", "host_identity", "cuda_reason", "p2p_matrix",
           "symm_mem_reason", "stream_mem_ops_reason", "same_host", "peer_access_reason",
           "symm_unavailable_reason", "collective_try", "multicast_env"]


def hostname() -> str:
    return socket.gethostname()


@functools.cache
def host_identity() -> str:
    """This machine's identity for "same host" checks: the hostname plus the kernel's boot id
    (two containers may share a hostname without sharing memory or GPUs)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


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
    """Whether every rank of ``group`` runs on this host (collective over the gloo twin)."""
    return len(set(_gather(group, host_identity()))) == 1


def peer_access_reason(group=None) -> str | None:
    """Collective. Local reason (None if fine) why this rank's GPU cannot reach every other
    rank's GPU directly: the ranks must share the host, and P2P must work for every pair."""
    info = (host_identity(), torch.cuda.current_device() if torch.cuda.is_available() else -1)
    everyone = _gather(group, info)
    hosts = {h for h, _ in everyone}
    if len(hosts) != 1:
        return f"ranks span {len(hosts)} hosts ({sorted(hosts)})"
    if cuda_reason():
        return cuda_reason()
    mine = info[1]
    for r, (_, dev) in enumerate(everyone):
        if dev == mine:
            if r != dist.get_rank(group):
                return f"rank {r} uses the same GPU {dev} as this rank"
            continue
        if not torch.cuda.can_device_access_peer(mine, dev):
            return f"no P2P access from GPU {mine} to GPU {dev} (rank {r})"
    return None


_PROBE_OVERRIDE: Callable | None = None


def _override_probe(fn: Callable | None) -> None:
    """Tests only: replace ``symm_unavailable_reason`` on this process by ``fn(group, device)``
    (None restores the real probe)."""
    global _PROBE_OVERRIDE
    _PROBE_OVERRIDE = fn


def symm_unavailable_reason(group, device: torch.device) -> str | None:
    """Collective over ``group``. This rank's reason against a symmetric-memory backend (None if
    it can run): CUDA tensors, symmetric memory importable, one host, P2P to every peer. The
    caller agrees the verdict across ranks (``agree_reason``)."""
    if _PROBE_OVERRIDE is not None:
        return _PROBE_OVERRIDE(group, device)
    # peer_access_reason is collective: every rank must call it, whatever its local verdict.
    peer = peer_access_reason(group) if torch.device(device).type == "cuda" else None
    if torch.device(device).type != "cuda":
        return f"the group's tensors are on {torch.device(device).type}, not CUDA"
    return symm_mem_reason() or peer


def collective_try(group, fn: Callable[[], object], what: str):
    """Run ``fn()`` on every rank, catch a failure, and agree on it.

    Returns ``(value, None)`` when every rank succeeded, else ``(None, reason)`` with the same
    reason (naming each failing rank) on every rank. ``fn`` must not be collective in a way that
    hangs when a peer failed before reaching it (allocate here; rendezvous in a second call)."""
    value, err = None, None
    try:
        value = fn()
    except Exception as exc:  # noqa: BLE001 - agreed below; the caller raises or falls back
        err = f"{type(exc).__name__}: {exc}"
    reason = agree_reason(group, err, what)
    return (value, None) if reason is None else (None, reason)
