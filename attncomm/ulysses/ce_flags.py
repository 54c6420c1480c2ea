"""Flag writes and waits on a CUDA stream for the ``ce`` transport: stream memory ops
(``cuStreamWriteValue32`` / ``cuStreamWaitValue32`` from ``cuda.bindings.driver``) or one-block
Triton kernels (release store / acquire spin with a device-side deadline: ``ce_flag_kernels``).

A kernel wait that runs past its deadline stores 1 into the error word of the peer it waited
for (``PeerErrors.words``, mapped host memory: a system-scope store), releases its stream and
lets the host find out at the next ``check()`` without a CUDA call. A stream-memory-op wait has
no deadline: the transport hands it to the substrate's watchdog (``attncomm.symm``), which
writes the awaited flag locally when the budget runs out.
"""
from __future__ import annotations

import torch

from .. import _triton

if _triton.REASON is None:
    from . import ce_flag_kernels as _k
else:
    _k = None

__all__ = ["Flags", "driver", "runtime", "triton_reason", "ok"]

_WAIT_EQ = 1  # CU_STREAM_WAIT_VALUE_EQ


def driver():
    try:
        from cuda.bindings import driver as drv
        return drv
    except Exception:  # noqa: BLE001 - optional dependency
        return None


def runtime():
    try:
        from cuda.bindings import runtime as rt
        return rt
    except Exception:  # noqa: BLE001 - optional dependency
        return None


def triton_reason() -> str | None:
    """None when Triton is importable, else the import's error."""
    return _triton.ERROR


def ok(res) -> bool:
    """Whether a ``cuda.bindings`` call returned success."""
    err = res[0] if isinstance(res, tuple) else res
    return int(getattr(err, "value", err)) == 0


class Flags:
    """Flag operations on a stream. ``mode``: "stream" (memory ops) or "kernel"; ``errors``:
    the ``[W] int32`` error words the kernel waits write; ``timeout_s``: their deadline."""

    def __init__(self, mode: str, errors: torch.Tensor, timeout_s: float):
        self.mode = mode
        self.errors = errors
        self.timeout_ns = int(timeout_s * 1e9)
        self.drv = driver() if mode == "stream" else None

    @property
    def unbounded(self) -> bool:
        """Whether ``wait(..., bounded=False)`` enqueues a wait without a device deadline."""
        return self.drv is not None

    def write(self, stream: torch.cuda.Stream, addr: int, value: int,
              kernel: bool = False) -> None:
        """``*addr = value`` after the stream's earlier work (release order). ``kernel`` forces
        the Triton kernel (inside graph capture every flag op is a kernel)."""
        if self.drv is not None and not kernel:
            if not ok(self.drv.cuStreamWriteValue32(stream.cuda_stream, addr, value, 0)):
                raise RuntimeError(f"cuStreamWriteValue32 at {addr:#x} failed")
            return
        with torch.cuda.stream(stream):
            _k.signal_kernel[(1,)](addr, value)

    def wait(self, stream: torch.cuda.Stream, addr: int, value: int, peer: int,
             bounded: bool) -> None:
        """The stream waits until ``*addr == value``, then sets ``*addr = 0``. ``bounded``
        asks for the device-side deadline (the Triton kernel; used inside graph capture and
        when there are no memory ops); ``peer`` is whose error word a timeout sets."""
        if self.drv is not None and not bounded:
            if not ok(self.drv.cuStreamWaitValue32(stream.cuda_stream, addr, value, _WAIT_EQ)):
                raise RuntimeError(f"cuStreamWaitValue32 at {addr:#x} failed")
            self.write(stream, addr, 0)
            return
        with torch.cuda.stream(stream):
            _k.wait_kernel[(1,)](addr, value, self.errors, peer, self.timeout_ns)

    def warm(self, device: torch.device) -> None:
        """Compile the flag kernels now (never during graph capture): a write and a wait on a
        scratch word, synchronised."""
        word = torch.zeros(1, dtype=torch.int32, device=device)
        scratch = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        kern = Flags("kernel", scratch, 1.0)
        s = torch.cuda.current_stream(device)
        kern.write(s, word.data_ptr(), 1)
        kern.wait(s, word.data_ptr(), 1, 0, bounded=True)
        torch.cuda.synchronize(device)
