"""The substrate on ONE GPU: a steady-state eager call makes no host sync (symm_a2a and the ce
transport at W=1, under ``torch.cuda.set_sync_debug_mode("error")`` and behind a long GPU
sleep the host must run ahead of), error words in mapped pinned memory written by a Triton
kernel and read without a CUDA call, and the watchdog releasing a stream blocked on a
``cuStreamWaitValue32`` that nobody answers. Run on the device: ``pytest -m gpu tests/gpu``."""
from __future__ import annotations

import time

import pytest
import torch

import attncomm
from attncomm import PeerTimeoutError
from attncomm._wait import poll_until

pytestmark = pytest.mark.gpu

_SLEEP_CYCLES = int(3e9)  # ~1.5 s of GPU time at H200 clocks: the host must not wait for it


@pytest.fixture(scope="module")
def one_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    pool = attncomm.RankPool(1, device="cuda")
    yield pool
    pool.close(force=not pool.alive)


def _behind_sleep(fn):
    """Run ``fn()`` (enqueues GPU work) behind a long GPU sleep, in sync-debug "error" mode:
    True when the host got through it before the sleep ended (it never waited for the GPU)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(_SLEEP_CYCLES)
    asleep = torch.cuda.Event()
    asleep.record()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    ahead = not asleep.query()
    torch.cuda.synchronize()
    return ahead


def _symm_steady_state(rank, world):
    from attncomm.dcp import DcpMerger
    from attncomm.dcp.lse_merge.combine import combine_torch
    dev = torch.device("cuda", torch.cuda.current_device())
    H, D, dtype = 8, 128, torch.bfloat16
    m = DcpMerger(max_tokens=16, num_heads=H, head_dim=D, dtype=dtype, backend="symm_a2a")
    gen = torch.Generator(device=dev).manual_seed(7)
    ins = [(torch.randn(T, H, D, device=dev, generator=gen).to(dtype),
            torch.randn(T, H, device=dev, generator=gen) * 3) for T in (1, 5, 16)]
    outs = []

    def calls():
        for i in range(30):
            out, lse = ins[i % 3]
            o, l = m(out, lse, return_lse=True)
            outs.append((i % 3, o.clone(), l.clone()))
        m.check()  # reads the error words: no CUDA call

    ahead = _behind_sleep(calls)
    exact = all(torch.equal(o.float(), combine_torch(ins[j][0][None], ins[j][1][None],
                                                     dtype)[0].float())
                for j, o, _ in outs)
    m._impl.ws.errors[0] = 1  # what a wait that timed out for peer 0 leaves (host memory)
    torch.cuda.set_sync_debug_mode("error")
    try:
        m(*ins[0])
        raised = None
    except PeerTimeoutError as exc:
        raised = exc.peer_ranks
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return ahead, exact, raised, m._impl.ws.errors.is_pinned()


def test_symm_a2a_eager_call_makes_no_host_sync(one_gpu):
    ahead, exact, raised, pinned = one_gpu.run(_symm_steady_state)[0]
    assert pinned, "the error words are not in pinned host memory"
    assert ahead, "the host waited for the GPU during eager merges"
    assert exact, "W=1 merge differs from combine_torch"
    assert raised == [0], raised


def _ce_steady_state(rank, world):
    from attncomm.ulysses.all_to_all import AllToAllTransport
    from attncomm.ulysses.ce import CopyEngineTransport
    from attncomm.ulysses.layout import head_to_seq_plan, seq_to_head_plan
    from attncomm.ulysses.transport import fill_send_buffer
    dev = torch.device("cuda", torch.cuda.current_device())
    ce = CopyEngineTransport(None, 0, 1, 5.0, device=dev)
    a2a = AllToAllTransport(None, 0, 1, 5.0)
    plan_in = seq_to_head_plan(2, (96,), 64, (((0, 6),), ((0, 2),)))
    plan_out = head_to_seq_plan(2, (96,), 64, (6,), (0,), 6)
    q = torch.randn(2, 96, 6, 64, device=dev).bfloat16()
    kv = torch.randn(2, 96, 2, 64, device=dev).bfloat16()
    o = torch.randn(2, 96, 6, 64, device=dev).bfloat16()
    for plan in (plan_in, plan_out):
        assert ce.prepare(plan, torch.bfloat16) is None
    ref_in = a2a.start(plan_in, [q, kv], torch.bfloat16, dev).wait().clone()
    ref_out = a2a.start(plan_out, [o], torch.bfloat16, dev).wait().clone()
    got = []
    out = torch.empty(2 * 96 * 6 * 64, device=dev, dtype=torch.bfloat16)

    def calls():
        for i in range(20):
            if i % 2:
                sb = ce.send_buffer(plan_in, torch.bfloat16, dev)
                fill_send_buffer(sb, [q, kv])  # a producer writing in place
                ex = ce.start(plan_in, [], torch.bfloat16, dev, send=sb)
            else:
                ex = ce.start(plan_in, [q, kv], torch.bfloat16, dev)
            got.append(ex.wait().clone())
            ex.release()
            ex = ce.start(plan_out, [o], torch.bfloat16, dev, out=out)
            got.append(ex.wait().clone())
        ce.check()

    ahead = _behind_sleep(calls)
    exact = all(torch.equal(g, ref_in if i % 2 == 0 else ref_out) for i, g in enumerate(got))
    return ahead, exact


def test_ce_exchange_makes_no_host_sync(one_gpu):
    ahead, exact = one_gpu.run(_ce_steady_state)[0]
    assert ahead, "the host waited for the GPU inside ce exchanges"
    assert exact, "ce differs from all_to_all"


def test_kernel_wait_timeout_sets_the_pinned_error_word():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from attncomm.symm import PeerErrors
    from attncomm.ulysses.ce_flags import Flags
    dev = torch.device("cuda", torch.cuda.current_device())
    errs = PeerErrors(3, dev, op="test wait", timeout_s=0.2, watch=False)
    flags = Flags("kernel", errs.words, 0.2)
    word = torch.zeros(1, dtype=torch.int32, device=dev)
    flags.wait(torch.cuda.current_stream(), word.data_ptr(), 1, 2, bounded=True)  # nobody
    torch.cuda.synchronize()
    assert errs.words.tolist() == [0, 0, 1]
    with pytest.raises(PeerTimeoutError) as info:
        errs.check()
    assert info.value.peer_ranks == [2]


def test_watchdog_releases_an_unanswered_stream_wait():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from attncomm import capability
    from attncomm.symm import PeerErrors
    from attncomm.watchdog import PendingWait, watchdog
    from attncomm.ulysses.ce_flags import Flags
    dev = torch.device("cuda", torch.cuda.current_device())
    if capability.stream_mem_ops_reason(dev.index):
        pytest.skip(capability.stream_mem_ops_reason(dev.index))
    errs = PeerErrors(2, dev, op="test wait", timeout_s=0.5)
    flags = Flags("stream", errs.words, 0.5)
    word = torch.zeros(1, dtype=torch.int32, device=dev)
    s, side = torch.cuda.Stream(), torch.cuda.Stream()
    x = torch.ones(1024, device=dev)
    # The kernel launched behind the wait has run once before it: with CUDA's lazy module
    # loading, a kernel's first launch in a process blocks the launching thread (holding the
    # GIL, so the watchdog thread cannot run) until the unanswered wait is released.
    with torch.cuda.stream(s):
        x * 2
    torch.cuda.synchronize()
    started = torch.cuda.Event()
    started.record(s)
    flags.wait(s, word.data_ptr(), 1, 1, bounded=False)  # nobody answers
    after = torch.cuda.Event()
    after.record(s)
    # The wait goes to the watchdog before this thread launches anything, as the ce transport
    # does.
    watchdog().add(PendingWait(errs, started, {1: after}, 0.5,
                               lambda blocked: flags.write(side, word.data_ptr(), 1),
                               dev.index))
    t0 = time.monotonic()
    with torch.cuda.stream(s):
        y = x * 2
    poll_until(after.query, 20, interval_s=0.01)  # bounded: never hang the suite
    waited = time.monotonic() - t0
    if not after.query():
        dog = watchdog()
        seen = (f"watchdog pending {dog.pending()}, thread alive "
                f"{dog._thread is not None and dog._thread.is_alive()}, started "
                f"{started.query()}, owner broken {errs.broken}")
        with torch.cuda.stream(torch.cuda.Stream(priority=-1)):
            word.fill_(1)  # release the stream ourselves so that the process can go on
        torch.cuda.synchronize()
        pytest.fail(f"the watchdog did not release the wait within 20 s ({seen})")
    torch.cuda.synchronize()
    assert 0.4 < waited < 10, waited
    assert torch.equal(y, x * 2)
    with pytest.raises(PeerTimeoutError) as info:
        errs.check()
    assert info.value.peer_ranks == [1]
