"""Print, as JSON ``{name: ptx}``, the PTX of the ``symm`` gather kernels compiled for sm_90
(bf16, RoPE on; flag kernel with and without ORDERED; LL kernel; both with FP8 output), as the
launcher compiles them (``enable_fp_fusion=False``), and under ``flag_spills`` the spill bytes
ptxas reports for the flag kernel's tiles. Needs no GPU (Triton's own ptxas), but a process
without TRITON_INTERPRET (tests/test_gather_symm_cpu.py runs it)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import attncomm.dcp.query_gather.symm_kernels as kern
from attncomm.dcp.query_gather.symm import column_block
from attncomm.symm import num_warps

_PTR_TYPES = {"q_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "scale_ptr": "*fp32",
              "slab": "*u8", "desc": "*i64", "state_ptr": "*i32", "err_ptr": "*i32"}
# The geometry of the gathers the checks compile (constexprs): MLA's 576 = 512 + a 64-dim tail.
_SHAPE = dict(H=64, HS=32, D=576, R=64)


def sm90_ptx(kernel, consts: dict, num_warps: int) -> str:
    names = kernel.arg_names
    ptrs = _PTR_TYPES
    types = {n: ("constexpr" if n in consts else ptrs.get(n, "i32")) for n in names}
    div16 = [n for n in names if n in ptrs]
    src = ASTSource(fn=kernel, signature=types,
                    constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in div16})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps,
                                   "enable_fp_fusion": False}).asm["ptx"]


def ptxas_spill_bytes(ptx: str) -> int | None:
    """Bytes of spill stores ``ptxas -v`` (Triton's own, sm_90a) reports for ``ptx``; None when
    Triton ships no ptxas (which the test counts as a failure)."""
    exe = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(exe):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        proc = subprocess.run([exe, "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "k.o")],
                              capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    spills = re.findall(r"(\d+) bytes spill stores", proc.stderr)
    if not spills or not re.search(r"Used \d+ registers", proc.stderr):
        raise RuntimeError(f"ptxas -v printed no register/spill report: {proc.stderr[-2000:]}")
    return sum(int(n) for n in spills)


def flag_tiles(head_dim: int = 576) -> dict:
    """Spill bytes of the flag kernel for the tiles the launcher picks (``column_block``,
    ``num_warps``) at head_dim 576 (MLA), bf16 and FP8 output."""
    out = {}
    for fp8 in (False, True):
        for br in (2, 8, 32, 64):
            bd = column_block(head_dim, br)
            consts = dict(_SHAPE, D=head_dim, RANK=0, W=2, BR=br, BD=bd, ORDERED=False, FP8=fp8)
            ptx = sm90_ptx(kern.gather_flag_kernel, consts, num_warps(br * bd * 2))
            out[f"{'fp8' if fp8 else 'bf16'} [{br}, {bd}]"] = ptxas_spill_bytes(ptx)
    return out


def main() -> int:
    flag = dict(_SHAPE, RANK=0, W=2, BR=32, BD=column_block(576, 32))
    ll = dict(_SHAPE, H=48, HS=16, RANK=1, W=3, BR=4, BW=512)
    out = {"flag": sm90_ptx(kern.gather_flag_kernel, dict(flag, ORDERED=False, FP8=False), 16),
           "flag_ordered": sm90_ptx(kern.gather_flag_kernel, dict(flag, ORDERED=True, FP8=False),
                                    16),
           "ll": sm90_ptx(kern.gather_ll_kernel, dict(ll, PACK=2, FP8=False), 4),
           "flag_fp8": sm90_ptx(kern.gather_flag_kernel, dict(flag, ORDERED=False, FP8=True), 16),
           "ll_fp8": sm90_ptx(kern.gather_ll_kernel, dict(ll, BW=256, PACK=4, FP8=True), 4),
           "flag_spills": flag_tiles()}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
