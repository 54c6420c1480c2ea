"""Flag writes and waits on a CUDA stream for the ``ce`` transport: stream memory ops
(``cuStreamWriteValue32`` / ``cuStreamWaitValue32`` from ``cuda.bindings.driver``) or one-block
Triton kernels (release store / acquire spin with a device-side deadline: ``ce_flag_kernels``);
and the protocol's flag layout and peer orders as pure functions (``f_word``, ``a_word``,
``initial_flags``, ``send_order``, ``recv_order``), which the transport addresses its flags by.

A kernel wait that runs past its deadline stores 1 into the error word of the peer it waited
for (``PeerErrors.words``, mapped host memory: a system-scope store), releases its stream and
lets the host find out at the next ``check()`` without a CUDA call. A stream-memory-op wait has
no deadline: the transport hands it to the substrate's watchdog (``attncomm.symm``), which
writes the awaited flag locally when the budget runs out.
"""
from __future__ import annotations

import torch

from .. import _triton, capability

if _triton.REASON is None:
    from . import ce_flag_kernels as _k
else:
    _k = None

__all__ = ["Flags", "driver", "runtime", "triton_reason", "ok", "f_word", "a_word",
           "initial_flags", "send_order", "recv_order"]

_WAIT_EQ = 1  # CU_STREAM_WAIT_VALUE_EQ


driver = capability.cuda_driver
runtime = capability.cuda_runtime
ok = capability.cuda_ok


def triton_reason() -> str | None:
    """None when Triton is importable, else the import's error."""
    return _triton.ERROR


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


# ------------------------------------------------------------------------------ the protocol
# One staging entry's flags block: int32 [4, W]. Row k (0, 1): F[k][s], set by source s to
# the exchange's plan tag (nonzero) once slot k holds its data; row 2 + k: A[k][p], set to 1 by
# destination p once it is done reading slot k (its data from this rank). A wait resets the
# flag it waited for, so the block returns to ``initial_flags`` after every complete exchange
# (tests/test_ulysses_ce_protocol.py runs the protocol over eager calls, captures and
# replays).
def f_word(k: int, src: int, world: int) -> int:
    """Word index of ``F[k][src]`` in a flags block."""
    return k * world + src


def a_word(k: int, dst: int, world: int) -> int:
    """Word index of ``A[k][dst]`` in a flags block."""
    return (2 + k) * world + dst


def initial_flags(rank: int, world: int) -> list[int]:
    """``rank``'s flags block when its entry is allocated, flat ``[4 · W]``: no slot holds data
    (F = 0) and every slot is free for every peer (``A[k][p] = 1``, p ≠ rank)."""
    return [int(row >= 2 and p != rank) for row in range(4) for p in range(world)]


def send_order(rank: int, world: int) -> list[int]:
    """The peers a sender copies to, in order: ``rank + 1, rank + 2, ...`` (mod W)."""
    return [(rank + i) % world for i in range(1, world)]


def recv_order(rank: int, world: int) -> list[int]:
    """The sources a receiver waits for and releases, in order: ``rank − 1, rank − 2, ...``."""
    return [(rank - i) % world for i in range(1, world)]
