"""``attncomm env``: what this machine offers and, for every backend of every exchange, whether
it can run here and why not; useful on CPU machines too. ``--json PATH`` writes the same facts as
JSON.

Alone, it reports local facts (no process group is formed). With a live group it also reports
the group's topology (``group_topology``): its hosts, and which exchanges can use their
single-host transports on it. A live group is: torch.distributed already initialised in this
process; torchrun's variables (``RANK``, ``WORLD_SIZE`` > 1, ``MASTER_ADDR``), where it joins a
gloo group and rank 0 prints; or ``--world-size N`` (N local ranks through ``attncomm.launch``:
gloo CPU ranks, or with ``--device cuda`` CUDA ranks, sharing the GPUs when N exceeds them;
``--hosts H`` makes them act as H hosts through the test-only ``ATTNCOMM_TEST_HOST``). On CUDA
the group's facts include which GPU each rank uses and how peers map each other's memory
(torch SymmetricMemory or CUDA IPC, and why).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch
import torch.distributed as dist

from . import _triton, capability, config
from ._dist import group_device
from ._agree import agree_reason
from .dp_attention.rows import sync_decision
from .dp_attention.shm import shm_supported
from .launch import launch
from .ulysses import api as ulysses_api

__all__ = ["add_arguments", "main", "collect", "nvlink_state", "group_topology"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH", default=None, help="also write the facts as JSON")
    p.add_argument("--world-size", type=int, default=None, metavar="N",
                   help="also report the topology of N local ranks (gloo CPU ranks, or CUDA "
                        "ranks with --device cuda; default: only a group that is already "
                        "live, e.g. under torchrun)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="with --world-size: CPU ranks (gloo, default) or CUDA ranks (NCCL, or "
                        "ranks sharing GPUs on gloo when N exceeds the GPUs)")
    p.add_argument("--hosts", type=int, default=1, metavar="H",
                   help="with --world-size: consecutive ranks act as H hosts (test-only "
                        "ATTNCOMM_TEST_HOST; default 1)")


def _versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "triton": _triton.VERSION, "nccl": None}
    if torch.cuda.is_available():
        try:
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001
            pass
    return out


def _gpus() -> list[dict]:
    if capability.cuda_reason():
        return []
    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        gpus.append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2 ** 30, 1),
                     "sms": p.multi_processor_count, "capability": f"{p.major}.{p.minor}"})
    return gpus


def nvlink_state() -> dict:
    """Active NVLink links per GPU through nvidia-ml-py (``{"error": ...}`` when unavailable)."""
    try:
        import pynvml
    except Exception as exc:  # noqa: BLE001
        return {"error": f"nvidia-ml-py is not importable: {exc}"}
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001
        return {"error": f"NVML did not initialise: {exc}"}
    try:
        out = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            active = 0
            for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    if pynvml.nvmlDeviceGetNvLinkState(h, link) == pynvml.NVML_FEATURE_ENABLED:
                        active += 1
                except Exception:  # noqa: BLE001 - links past the device's count raise
                    break
            out[str(i)] = {"active_links": active}
        return out
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def _symm_a2a_reason(p2p: list[list[bool]]) -> str | None:
    reason = capability.cuda_reason() or capability.symm_mem_reason()
    if reason:  # the more basic reason first (no CUDA), then Triton
        return reason
    if _triton.REASON:
        return _triton.REASON
    if len(p2p) < 2:
        return (f"needs ≥ 2 GPUs on this host for W ≥ 2 (found {len(p2p)}); W=1 runs, and "
                f"ranks that share a GPU run it through CUDA IPC (correctness, not speed)")
    missing = [f"{i}→{j}" for i, row in enumerate(p2p) for j, ok in enumerate(row) if not ok]
    return f"no P2P access between GPUs {', '.join(missing)}" if missing else None


def _backends(p2p) -> dict:
    cuda = capability.cuda_reason()
    dcp = [{"backend": "reference", "available": True, "why_not": None},
           {"backend": "ag_rs", "available": True, "why_not": None},
           {"backend": "a2a", "available": True, "why_not": None}]
    why = _symm_a2a_reason(p2p)
    dcp.append({"backend": "symm_a2a", "available": why is None, "why_not": why})
    # DCP's query-head all-gather (DcpQueryGather): "symm" needs what symm_a2a needs
    # (symmetric memory, Triton, P2P between the GPUs).
    dcp_gather = [{"backend": "all_gather", "available": True, "why_not": None},
                  {"backend": "symm", "available": why is None, "why_not": why}]
    ulysses = []
    try:
        avail = ulysses_api.backend_availability()
        ulysses = [{"backend": k, "available": v is None, "why_not": v} for k, v in avail.items()]
    except Exception as exc:  # noqa: BLE001 - a failing probe is reported, not raised
        ulysses = [{"backend": "all_to_all", "available": True, "why_not": None},
                   {"backend": "ce", "available": False,
                    "why_not": f"could not ask attncomm.ulysses: {exc}"}]
    dp = []
    try:
        ok, why_shm = shm_supported()
    except Exception as exc:  # noqa: BLE001
        ok, why_shm = False, f"could not ask attncomm.dp_attention: {exc}"
    dp.append({"backend": "shm", "available": ok, "why_not": why_shm})
    dp.append({"backend": "hier", "available": ok, "why_not": why_shm})
    dp.append({"backend": "cpu", "available": True, "why_not": None})
    dp.append({"backend": "device", "available": True,
               "why_not": None if not cuda else f"no GPU here, so it runs on the gloo group "
                                                f"({cuda})"})
    return {"dcp": dcp, "dcp_gather": dcp_gather, "ulysses": ulysses, "dp_sync": dp}


def group_topology(group=None) -> dict:
    """The hosts of a live ``group`` and, for each exchange's single-host transport, whether it
    can run on the group and why not (the same verdicts the exchanges' ``auto`` reaches).

    Collective over ``group`` (every rank calls it; the DP sync's "auto" path is decided, and
    built, as on its first use). Returns ``{"world_size", "backend", "device", "hosts": [{"host",
    "ranks"}], "single_host": [{"exchange", "backend", "available", "why_not"}], "dp_sync_auto":
    {"path", "why_not_shm"}, "gpus": [{"rank", "gpu", "uuid"}] | None, "shared_gpu": str |
    None, "peer_mapping": {"kind", "why", "unavailable"} | None}``, the same on every rank (the
    GPU facts on CUDA groups only).
    """
    dev = group_device(group)
    layout = capability.group_hosts(group)
    gpus = mapping = None
    if dev.type == "cuda":
        gpus = capability.group_gpus(group)  # collective on first use
        mapping = capability.peer_mapping(group)  # collective on first use
    symm = capability.symm_unavailable_reason(group, dev) or _triton.REASON  # collective
    # the hosts' reason is the same on every rank (the layout is agreed): said once, not per rank
    symm = layout.reason() or agree_reason(group, symm, "symmetric memory")
    ce = ulysses_api.ce_reason(group, dev)
    dp = sync_decision("auto", group)

    def row(exchange, backend, why):
        return {"exchange": exchange, "backend": backend, "available": why is None,
                "why_not": why}

    return {
        "world_size": dist.get_world_size(group), "backend": str(dist.get_backend(group)),
        "device": str(dev),
        "hosts": [{"host": n, "ranks": list(r)} for n, r in zip(layout.names, layout.ranks)],
        "single_host": [row("dcp", "symm_a2a", symm), row("dcp_gather", "symm", symm),
                        row("ulysses", "ce", ce),
                        row("dp_sync", "shm", None if dp.backend == "shm" else dp.fallback_reason)],
        "dp_sync_auto": {"path": dp.backend, "why_not_shm": dp.fallback_reason},
        "gpus": None if gpus is None else [{"rank": r, "gpu": idx, "uuid": uuid}
                                           for r, (_, uuid, idx) in enumerate(gpus.gpus)],
        "shared_gpu": None if gpus is None else gpus.shared_reason(),
        "peer_mapping": None if mapping is None else {"kind": mapping.kind, "why": mapping.why,
                                                      "unavailable": mapping.unavailable},
    }


def collect(group=None) -> dict:
    """Every fact ``attncomm env`` prints, as a dict (``topology``: ``group_topology(group)``
    when torch.distributed is initialised, collective then; else None)."""
    p2p = capability.p2p_matrix()
    mc = capability.multicast_env()
    mc_ok = mc == config.SAFE_ENV
    return {
        "host": capability.hostname(),
        "versions": _versions(),
        "cuda": capability.cuda_reason() or "available",
        "gpus": _gpus(),
        "p2p": p2p,
        "nvlink": nvlink_state() if not capability.cuda_reason() else {"error": "no CUDA"},
        "symmetric_memory": capability.symm_mem_reason() or "available",
        "stream_mem_ops": capability.stream_mem_ops_reason() or "available (trial call)",
        "multicast": dict(mc, state="off" if mc_ok else "NOT OFF: set the variables above"),
        "timeout_s": config.timeout_s(),
        "settings": config.overrides(),
        "backends": _backends(p2p),
        "topology": group_topology(group) if dist.is_available() and dist.is_initialized()
        else None,
    }


def _print(info: dict) -> None:
    v = info["versions"]
    print(f"host {info['host']}: python {v['python']}, torch {v['torch']}, triton {v['triton']}, "
          f"CUDA {v['cuda']}, NCCL {v['nccl']}")
    print(f"CUDA: {info['cuda']}")
    for g in info["gpus"]:
        print(f"  GPU {g['index']}: {g['name']}, {g['memory_gib']} GiB, {g['sms']} SMs, "
              f"sm_{g['capability'].replace('.', '')}")
    if info["p2p"]:
        print("P2P matrix (row → column):")
        n = len(info["p2p"])
        print("      " + " ".join(f"{j:>3}" for j in range(n)))
        for i, row in enumerate(info["p2p"]):
            print(f"  {i:>3} " + " ".join("  Y" if ok else "  -" for ok in row))
    nv = info["nvlink"]
    if isinstance(nv, dict) and set(nv) == {"error"}:
        print(f"NVLink: unknown ({nv['error']})")
    else:
        print(f"NVLink: {nv}")
    print(f"symmetric memory: {info['symmetric_memory']}")
    print(f"stream memory ops: {info['stream_mem_ops']}")
    mc = dict(info["multicast"])
    state = mc.pop("state")
    print(f"NVLink multicast: {state} (" + ", ".join(f"{k}={v}" for k, v in mc.items()) + ")")
    print(f"default timeout: {info['timeout_s']:g} s (ATTNCOMM_TIMEOUT_S)")
    settings = ", ".join(f"{k}={v}" for k, v in info["settings"].items())
    print(f"ATTNCOMM_* set: {settings or 'none'} (every variable: attncomm.config.VARS)")
    for exchange, rows in info["backends"].items():
        print(f"{exchange} backends:")
        for r in rows:
            mark = "yes" if r["available"] else "no "
            print(f"  {r['backend']:<10} {mark}" + (f"  {r['why_not']}" if r["why_not"] else ""))
    topo = info.get("topology")
    if topo:
        print(f"live group: {topo['world_size']} ranks ({topo['backend']}, {topo['device']}) on "
              f"{len(topo['hosts'])} host(s):")
        for h in topo["hosts"]:
            print(f"  {h['host']}: ranks {h['ranks']}")
        print("single-host transports on this group:")
        for r in topo["single_host"]:
            mark = "yes" if r["available"] else "no "
            print(f"  {r['exchange'] + ' ' + r['backend']:<20} {mark}"
                  + (f"  {r['why_not']}" if r["why_not"] else ""))
        print(f"DP sync auto: {topo['dp_sync_auto']['path']}")
        if topo.get("gpus"):
            print("GPUs: " + ", ".join(f"rank {g['rank']} on GPU {g['gpu']}"
                                       for g in topo["gpus"]))
        if topo.get("shared_gpu"):
            print(f"shared GPU: {topo['shared_gpu']} (time-sliced: correctness and fault tests, "
                  f"not speed)")
        m = topo.get("peer_mapping")
        if m:
            print(f"peer mapping: {m['kind']} ({m['why']})"
                  + (f"; cannot serve the group: {m['unavailable']}" if m["unavailable"] else ""))


def _torchrun_env() -> bool:
    """Whether this process was started by torchrun (or anything that sets its variables) as
    one of several ranks."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ \
            and "MASTER_ADDR" in os.environ
    except ValueError:
        return False


def _launched_rank(rank: int, world: int, hosts: int) -> dict | None:
    """One rank of ``--world-size``: act as host ``rank·hosts // world`` when ``hosts`` > 1,
    then gather the facts (collective); rank 0 returns them."""
    if hosts > 1:
        config.set_var("ATTNCOMM_TEST_HOST", f"sim{rank * hosts // world}")
    info = collect()
    return info if rank == 0 else None


def main(args) -> int:
    config.force_safe_env()
    world, hosts = getattr(args, "world_size", None), getattr(args, "hosts", 1)
    device = getattr(args, "device", "cpu")
    if world is not None or hosts != 1:
        if world is None or world < 1 or not 1 <= hosts <= world:
            raise ValueError(f"--world-size must be ≥ 1 and --hosts in [1, world size], got "
                             f"--world-size {world} --hosts {hosts}")
        info = launch(_launched_rank, world, args=(hosts,), device=device)[0]
    else:
        if _torchrun_env() and not dist.is_initialized():
            dist.init_process_group("gloo", init_method="env://")
        info = collect()
        if dist.is_initialized() and dist.get_rank() != 0:
            return 0
    _print(info)
    path = getattr(args, "json", None)
    if path:
        with open(path, "w") as f:
            json.dump(info, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(argparse.Namespace(json=None, world_size=None, hosts=1, device="cpu")))
