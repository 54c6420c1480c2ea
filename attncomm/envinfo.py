"""``attncomm env``: what this machine offers and, for every backend of every exchange, whether
it can run here and why not. Local facts only (no process group is formed); useful on CPU
machines too. ``--json PATH`` writes the same facts as JSON."""
from __future__ import annotations

import argparse
import json
import platform
import sys

import torch

from . import _triton, capability, config
from .dp_attention.shm import shm_supported
from .ulysses import api as ulysses_api

__all__ = ["add_arguments", "main", "collect", "nvlink_state"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH", default=None, help="also write the facts as JSON")


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
        return f"needs ≥ 2 GPUs on this host for W ≥ 2 (found {len(p2p)}); W=1 runs"
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
    dp.append({"backend": "cpu", "available": True, "why_not": None})
    dp.append({"backend": "device", "available": True,
               "why_not": None if not cuda else f"no GPU here, so it runs on the gloo group "
                                                f"({cuda})"})
    return {"dcp": dcp, "dcp_gather": dcp_gather, "ulysses": ulysses, "dp_sync": dp}


def collect() -> dict:
    """Every fact ``attncomm env`` prints, as a dict."""
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


def main(args) -> int:
    config.force_safe_env()
    info = collect()
    _print(info)
    path = getattr(args, "json", None)
    if path:
        with open(path, "w") as f:
            json.dump(info, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(argparse.Namespace(json=None)))
