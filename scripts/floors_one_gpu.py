"""The one-GPU kernels against their memory floors, with the copy bandwidth measured in the same
run: the Ulysses fill (bf16 and FP8 payload, with and without QK-norm + RoPE, q, k, v
``[1, S/2, 56, 128]`` bf16, the default launch shape), the ring's merge step (``[1, S, 24, 128]``
bf16 block and SDPA-layout LSE into the fp32 state) and, on the first run, the FP8 conversion of
the fill's epilogue (``fill_epilogue.e4m3_kernel``) on every fp32 bit pattern against the rule
(``clamp(−448, 448).to(float8_e4m3fn)``, 0x7F for non-finite inputs).

Floors: bytes read + written ÷ the device-to-device copy bandwidth. Fill: q, k, v read, the
send buffer written (``D + 4`` bytes per row for FP8), cos/sin read once. Merge: the state read
and written (4 + 4 bytes per element), the block read (2), the three LSEs (4 bytes each per row).
Bits: each fill output against the tree's own torch path (``bitwise_equal``; the merge within
1e-5 of it, ``within_tolerance``, as its GPU test holds it) and, through
``--ab``, against the other tree's (``scripts/ab_tree.py``).

    python scripts/floors_one_gpu.py [--seq 8192 32768] [--ring-seq 8192] [--json P] [--dump P]
                                     [--shapes]
    python scripts/floors_one_gpu.py --ab REV|PATH [--rounds 2] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _one_gpu  # noqa: E402

ROOT = _one_gpu.use_tree(sys.argv)

import torch  # noqa: E402

from attncomm.bench import ring_kernels  # noqa: E402
from attncomm.bench import ulysses_fill as bench_fill  # noqa: E402
from attncomm.ring import merge as ring_merge  # noqa: E402
from attncomm.ulysses import fill_epilogue, fp8  # noqa: E402


def e4m3_all_patterns() -> dict:
    """Mismatches of ``e4m3_kernel`` against the rule over all 2³² fp32 bit patterns."""
    bad, first, chunk = 0, [], 1 << 28
    for lo in range(0, 1 << 32, chunk):
        bits = torch.arange(lo, lo + chunk, dtype=torch.int64, device="cuda")
        x = bits.to(torch.int32).view(torch.float32)  # two's-complement wrap: every pattern
        got = torch.empty(chunk, dtype=torch.uint8, device="cuda")
        fill_epilogue.e4m3_kernel[(chunk // 1024,)](x, got, chunk, BLOCK=1024)
        want = x.clamp(-448.0, 448.0).to(fp8.FP8_DTYPE).view(torch.uint8)
        want = torch.where(torch.isfinite(x), want, 0x7F)
        diff = (got != want).nonzero().flatten()
        bad += diff.numel()
        first += [f"{int(bits[i]) & 0xFFFFFFFF:#010x}: {int(got[i]):#x} vs {int(want[i]):#x}"
                  for i in diff[:5 - len(first)].tolist()]
        del bits, x, got, want
    return {"key": "e4m3 all fp32 patterns", "mismatches": bad, "first": first}


#: Launch shapes ``--shapes`` times besides the default (16, 2, 4), (rows, heads, warps) per
#: program, for the fills that are not at their floor (FP8, and bf16 with norm + RoPE): 8 or
#: 16 elements per thread (sm_90: 32–56 registers, against 76–80 at the default's 32), and
#: the default's 32 over more, smaller programs; and 4 heads per program, where one load of a
#: row's cos/sin serves twice the heads (up to 45 % of the FP8 norm fill's L2 reads).
SHAPES = ((4, 2, 2), (8, 1, 2), (8, 1, 4), (8, 2, 2), (8, 2, 4), (16, 1, 4), (16, 2, 8),
          (32, 2, 8), (4, 4, 2), (4, 4, 4), (8, 4, 2), (8, 4, 4), (16, 4, 8))


def fill_case(seq, norm, payload, bw, label, dump, shapes=()) -> list:
    """The fill at the default launch shape, then at each of ``shapes``: records with the
    time, the floor and whether the bytes equal the torch path's."""
    parts, cos, sin, _ = bench_fill._case(seq, 56, 128, 2, norm, "cuda", torch.bfloat16,
                                          seq + norm)
    run = bench_fill._Run(parts, cos, sin, payload, torch.device("cuda"), 5)
    key = f"fill seq={seq} norm={int(norm)} {'fp8' if payload else 'bf16'}"
    floor = run.moved / bw * 1e6
    same = run._same()
    dump.add(key, run.out_k)
    recs = []
    for shape in ((None,) + tuple(shapes)):
        kw = {} if shape is None else dict(zip(("block_s", "heads_per_program", "num_warps"),
                                               shape))
        if shape is not None:
            same = run._same(**kw)
        t = bench_fill.device_us(lambda: run.triton_call(**kw))  # noqa: B023 - called at once
        recs.append(dict(label=label, key=key if shape is None else f"{key} shape={shape}",
                         gpu_us=t, floor_us=floor, x_floor=t / floor, bytes=run.moved,
                         bitwise_equal=same))
    return recs


def merge_case(seq, bw, label, dump) -> dict:
    g = torch.Generator(device="cpu").manual_seed(seq)
    h, d = 24, 128
    o = torch.randn(1, seq, h, d, generator=g).to("cuda", torch.bfloat16)
    lse = torch.randn(1, h, seq, generator=g).to("cuda").transpose(1, 2)  # SDPA's layout
    lse[0, ::97, 3] = float("-inf")
    acc0, lse0 = ring_merge.new_state(1, seq, h, d, "cuda")
    acc0.copy_(torch.randn(1, seq, h, d, generator=g))
    lse0.copy_(torch.randn(1, seq, h, generator=g))
    ref = (acc0.clone(), lse0.clone())
    ring_merge.merge_block_torch(*ref, o, lse)
    got = (acc0.clone(), lse0.clone())
    ring_merge.merge_block_triton(*got, o, lse)
    # Not bits: the kernel's exp/log and fused multiply-adds round differently from torch's
    # (the ring's GPU test holds them to 1e-5, as here).
    live = ~torch.isneginf(ref[1])
    err = max((got[0][live] - ref[0][live]).abs().max().item(),
              (got[1][live] - ref[1][live]).abs().max().item())
    same_empty = torch.equal(torch.isneginf(got[1]), ~live)
    key = f"merge seq={seq}"
    dump.add(key + " acc", got[0])
    dump.add(key + " lse", got[1])
    acc, acc_lse = got

    def step():  # a live state: both sources read (the output is the input's merge again)
        ring_merge.merge_block_triton(acc, acc_lse, o, lse)

    nbytes = acc.numel() * (4 + 4 + 2) + acc_lse.numel() * 4 * 3
    t = bench_fill.device_us(step)
    t_bench = ring_kernels.device_us(step, torch.device("cuda"), 20)  # the ring bench's clock
    floor = nbytes / bw * 1e6
    return dict(label=label, key=key, gpu_us=t, bench_us=t_bench, floor_us=floor,
                x_floor=t / floor, bench_x_floor=t_bench / floor, bytes=nbytes,
                host_us=_one_gpu.host_us(step), max_abs_err=err,
                within_tolerance=same_empty and err < 1e-5)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--ring-seq", type=int, default=8192)
    p.add_argument("--shapes", action="store_true",
                   help="also time the fills at the launch shapes of SHAPES (bits checked)")
    _one_gpu.add_run_arguments(p, "write every output (digests) here")
    return p


def report(out: str) -> None:
    """The A/B's medians with each tree's ×floor (from its own runs' copy bandwidth)."""
    with open(os.path.join(out, "floors_one_gpu-summary.json")) as f:
        state = json.load(f)
    rows = {}
    for label, recs in state["runs"].items():
        for r in recs:
            if "floor_us" in r:
                rows.setdefault(r["key"], {}).setdefault(label, []).append(r)
    print(f"\n{'key':>30} {'base µs':>9} {'×floor':>7} {'this µs':>9} {'×floor':>7}")
    med = statistics.median  # as ab_tree's summary (of two rounds: their mean)
    for k, by in rows.items():
        cells = []
        for label in ("base", "this"):
            rs = by.get(label, [])
            cells.append(f"{med([r['gpu_us'] for r in rs]):>9.1f} "
                         f"{med([r['x_floor'] for r in rs]):>7.3f}" if rs else " " * 17)
        print(f"{k:>30} {cells[0]} {cells[1]}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parser().parse_args(argv)
    if a.ab:
        import ab_tree
        rc = ab_tree.main(__file__, a.ab, argv, rounds=a.rounds, out=a.out)
        if a.out:
            report(a.out)
        return rc
    if _one_gpu.device() != "cuda":
        print("floors_one_gpu: needs a CUDA GPU", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name(0)
    print(f"{a.label} ({ROOT}): kernels against their floors on one {gpu}", flush=True)
    bw = bench_fill.copy_bandwidth("cuda")
    recs, dump = [dict(label=a.label, key="copy bandwidth", gbps=bw / 1e9)], _one_gpu.Dump()
    if a.dump:  # the first round only
        recs.append(dict(e4m3_all_patterns(), label=a.label))
        print(json.dumps(recs[-1]), flush=True)
    for seq in a.seq:
        for norm in (True, False):
            for payload in (None, fp8.FP8_DTYPE):
                shapes = SHAPES if a.shapes and (norm or payload) else ()
                for rec in fill_case(seq, norm, payload, bw, a.label, dump, shapes):
                    recs.append(rec)
                    print(json.dumps(rec), flush=True)
    recs.append(merge_case(a.ring_seq, bw, a.label, dump))
    print(json.dumps(recs[-1]), flush=True)
    dump.save(a.dump)
    if a.json:
        meta = {"gpu": gpu, "torch": torch.__version__, "copy_gbps": bw / 1e9,
                "triton": __import__("triton").__version__, "tree": ROOT}
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "records": recs}, f, indent=1)
    ok = all(r.get("bitwise_equal", True) and r.get("within_tolerance", True)
             and not r.get("mismatches") for r in recs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
