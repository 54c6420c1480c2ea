"""Print, as JSON ``{"pdl": ptx, "plain": ptx}``, the PTX of a symm_a2a kernel compiled for
sm_90 with and without PDL: ``python tests/_symm_ptx.py flag|ll``. Needs no GPU (Triton's own
ptxas), but a process without TRITON_INTERPRET (used by tests/test_symm_cpu.py)."""
from __future__ import annotations

import json
import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import attncomm.dcp.lse_merge.symm_kernels as mod

_PTR_TYPES = {"out_ptr": "*bf16", "lse_ptr": "*fp32", "res_ptr": "*bf16", "res_lse_ptr": "*fp32",
              "slab_o": "*bf16", "slab_l": "*fp32", "slab_f": "*i32", "slab_llo": "*i64",
              "slab_lll": "*i64", "delta_o": "*i64", "delta_w": "*i64", "delta_q": "*i64",
              "state_ptr": "*i64", "err_ptr": "*i32", "out_w": "*i32", "lse_w": "*i32",
              "res_w": "*i32"}
# Integers the launcher passes divisible by 16 (Triton specialises them): shapes and strides.
_DIV16 = ("H", "HS", "D", "DW", "o_cell", "l_cell", "f_cell", "llo_cell", "lll_cell")


def sm90_ptx(kernel, consts: dict, num_warps: int) -> str:
    names = kernel.arg_names
    types = {n: ("constexpr" if n in consts else _PTR_TYPES.get(n, "i32")) for n in names}
    div16 = [n for n in names if n in _PTR_TYPES or n in _DIV16]
    src = ASTSource(fn=kernel, signature=types,
                    constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in div16})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps}).asm["ptx"]


def main(kind: str) -> int:
    if kind == "flag":
        kernel, consts, warps = mod.merge_flag_kernel, dict(RANK=0, W=2, BR=32, BD=512,
                                                              STAGGER=50), 16
    else:
        kernel, consts, warps = mod.merge_ll_kernel, dict(RANK=0, W=2, BR=2, BW=256, PACK=2,
                                                            DTYPE=tl.bfloat16), 4
    print(json.dumps({"pdl": sm90_ptx(kernel, dict(consts, PDL=True), warps),
                      "plain": sm90_ptx(kernel, dict(consts, PDL=False), warps)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
