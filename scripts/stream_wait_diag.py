"""Why a launch can block the host behind an unanswered ``cuStreamWaitValue32``: one variant
per fresh process (``faulthandler`` prints every thread's stack and exits if it hangs).

    python scripts/stream_wait_diag.py VARIANT     # as-is | warm-kernel | main-writes
    CUDA_MODULE_LOADING=EAGER python scripts/stream_wait_diag.py as-is

- ``as-is``: the wait is handed to the watchdog, then ``y = x * 2`` is launched behind it on
  the same stream (the GPU test's order).
- ``warm-kernel``: the same, after ``x * 2`` ran once on that stream before the wait (its
  module loaded).
- ``main-writes``: no watchdog; after the launch returns, the main thread writes the flag.
"""
import faulthandler
import sys
import time

faulthandler.dump_traceback_later(30, exit=True)

import torch  # noqa: E402

from attncomm._wait import poll_until  # noqa: E402
from attncomm.symm import PeerErrors  # noqa: E402
from attncomm.ulysses.ce_flags import Flags  # noqa: E402
from attncomm.watchdog import PendingWait, watchdog  # noqa: E402

variant = sys.argv[1]
dev = torch.device("cuda", 0)
errs = PeerErrors(2, dev, op="diag", timeout_s=0.5, watch=variant != "main-writes")
flags = Flags("stream", errs.words, 0.5)
word = torch.zeros(1, dtype=torch.int32, device=dev)
s, side = torch.cuda.Stream(), torch.cuda.Stream()
x = torch.ones(1024, device=dev)
if variant == "warm-kernel":
    with torch.cuda.stream(s):
        x * 2
    torch.cuda.synchronize()
started = torch.cuda.Event()
started.record(s)
flags.wait(s, word.data_ptr(), 1, 1, bounded=False)
after = torch.cuda.Event()
after.record(s)
if variant != "main-writes":
    watchdog().add(PendingWait(errs, started, {1: after}, 0.5,
                               lambda blocked: flags.write(side, word.data_ptr(), 1), dev.index))
t0 = time.monotonic()
with torch.cuda.stream(s):
    y = x * 2
print(variant, f"launch returned after {time.monotonic() - t0:.3f} s", flush=True)
if variant == "main-writes":
    flags.write(side, word.data_ptr(), 1)
poll_until(after.query, 10, interval_s=0.01)
torch.cuda.synchronize()
print(variant, f"released after {time.monotonic() - t0:.3f} s; result ok {torch.equal(y, x * 2)}; "
      f"broken {errs.broken is not None}", flush=True)
