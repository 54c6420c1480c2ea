"""Print, as JSON ``{"pdl": ptx, "plain": ptx}``, the PTX of a symm_a2a kernel compiled for
sm_90 with and without PDL: ``python tests/_symm_ptx.py flag|ll``. Needs no GPU (Triton's own
ptxas), but a process without TRITON_INTERPRET (used by tests/test_symm_cpu.py)."""
from __future__ import annotations

import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import attncomm.dcp.lse_merge.symm_kernels as mod

_PTR_TYPES = {"out_ptr": "*bf16", "lse_ptr": "*fp32", "res_ptr": "*bf16", "res_lse_ptr": "*fp32",
              "slab": "*u8", "desc": "*i64", "state_ptr": "*i32", "err_ptr": "*i32"}
# The geometry of the merges the checks compile (constexprs).
_SHAPE = dict(RANK=0, W=2, H=64, HS=32, D=512)


def sm90_ptx(kernel, consts: dict, num_warps: int) -> str:
    names = kernel.arg_names
    types = {n: ("constexpr" if n in consts else _PTR_TYPES.get(n, "i32")) for n in names}
    div16 = [n for n in names if n in _PTR_TYPES]
    src = ASTSource(fn=kernel, signature=types,
                    constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in div16})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps}).asm["ptx"]


def main(kind: str) -> int:
    if kind == "flag":
        kernel, consts, warps = mod.merge_flag_kernel, dict(_SHAPE, BR=32, BD=512, STAGGER=50), 16
    else:
        kernel, consts, warps = mod.merge_ll_kernel, dict(_SHAPE, BR=2, BW=256), 4
    print(json.dumps({"pdl": sm90_ptx(kernel, dict(consts, PDL=True), warps),
                      "plain": sm90_ptx(kernel, dict(consts, PDL=False), warps)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
