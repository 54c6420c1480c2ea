"""The ``ce`` transport's one-block flag kernels (Triton): a release store of a flag, and an
acquire spin on a flag with a device-side deadline (host side: ``ce_flags``). Importing this
module needs Triton (``attncomm._triton``)."""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import cuda as tlcuda

__all__ = ["signal_kernel", "wait_kernel"]


@triton.jit
def signal_kernel(addr, value):
    ptr = addr.to(tl.pointer_type(tl.int32))
    tl.atomic_xchg(ptr, value, sem="release", scope="sys")


@triton.jit
def wait_kernel(addr, expect, err_ptr, peer, timeout_ns):
    # spin (acquire) until *addr == expect, then reset it; past the deadline record the
    # timeout in errors[peer] (host-visible) and give up
    ptr = addr.to(tl.pointer_type(tl.int32))
    t0 = tlcuda.globaltimer()
    val = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
    while (val != expect) & ((tlcuda.globaltimer() - t0) < timeout_ns):
        val = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
    if val == expect:
        tl.atomic_xchg(ptr, 0, sem="relaxed", scope="sys")
    else:
        tl.atomic_xchg(err_ptr + peer, 1, sem="relaxed", scope="sys")
