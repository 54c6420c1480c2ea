"""Print, as JSON ``{"fused": ptx, "launched": ptx, "launched_full": ptx}``, the sm_90 PTX of the
Ulysses fill kernel (bf16, norm + RoPE, D=128, the default 16 rows × 2 heads per program) with
FMA contraction on, and with the options the fill's launcher launches it with, masked and on
full blocks (``FULL``), and on full blocks with the norm's tree by warp shuffles (``SHFL_NORM``:
``"launched_shuffle"``).

- Argument ``fp8``: ``{"fp8": ptx, "fp8_full": ptx, "fp8_shuffle": ptx,
  "fp8_shuffle_masked": ptx}`` of the FP8 payload variant (uint8 output, bases not 16-aligned:
  rows of D + 4 bytes) with the launch options; the last two with ``SHFL_NORM`` and so, as the
  host launches them, the bytes stored from their registers (``REG_STORE``).
- Argument ``sm80``: ``{"plain": ptx, "norm": ptx}`` of the FP8 variant compiled for sm_80 (no
  e4m3 conversion instruction: ``HW_E4M3`` off).
- Argument ``layouts``: ``{name: [sizePerThread, threadsPerWarp, order]}``, the register layout
  of ``_ptx_norm_inv``'s operands in the compiled kernel (TTGIR) with ``SHFL_NORM`` for the
  cases the host takes it in (``LAYOUT_CASES``) and for fp32 parts, which it does not; for the
  FP8 cases also that of the bytes' register stores (``"<case> store"``).

Needs no GPU, but a process without TRITON_INTERPRET (tests/test_ulysses_fill.py)."""
from __future__ import annotations

import json
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from attncomm.ulysses.fill import LAUNCH_OPTIONS
from attncomm.ulysses.fill_kernels import fill_kernel

_PTRS = {"x0": "*bf16", "x1": "*bf16", "x2": "*bf16", "out_ptr": "*bf16", "desc": "*i64",
         "w0": "*fp32", "w1": "*fp32", "w2": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32"}
#: Strides as for contiguous q/k/v and cos/sin (fill_kernels' SPEC): batch, row and head
#: strides multiples of 16, unit element strides.
_SPEC = sum(c << (2 * k) for k, c in enumerate([2, 2, 2, 1, 2, 1, 2, 1]))
#: name → (arch, fp8, full, parts' dtype, only the parts' pointers 16-byte aligned)
LAYOUT_CASES = {
    "sm90 bf16": (90, False, False, "bf16", False),
    "sm90 bf16 full": (90, False, True, "bf16", False),
    "sm90 fp16 full": (90, False, True, "fp16", False),
    "sm90 bf16 full, the rest unaligned": (90, False, True, "bf16", True),
    "sm90 fp8": (90, True, False, "bf16", False),
    "sm90 fp8 full": (90, True, True, "bf16", False),
    "sm80 bf16 full": (80, False, True, "bf16", False),
    "sm100 bf16 full": (100, False, True, "bf16", False),
    "sm100 fp8 full": (100, True, True, "bf16", False),
}


def compiled(opts: dict, fp8: bool = False, full: bool = False, shuffle: bool = False,
             dtype: str = "bf16", arch: int = 90, parts_aligned_only: bool = False,
             hw_e4m3: bool = True, norm: bool = True):
    k = fill_kernel
    names = k.arg_names
    # 56 heads in runs of 2 for 2 destinations, 3 parts: 84 entries; the FP8 flags are what
    # the host picks on sm_90 with norm and RoPE
    hw = fp8 and hw_e4m3
    consts = dict(HALF=64, LEVELS=6, BLOCK_S=16, HB=2, ANY_NORM=norm, ANY_ROPE=norm,
                  ALIGNED=not fp8 and not parts_aligned_only, ROPE_BCAST=True, SPEC=_SPEC,
                  ENTRIES=84, FULL=full, FP8=fp8, HW_E4M3=hw, PTX=hw and norm,
                  EXACT=not norm, SHFL_NORM=shuffle, PTX_WIDEN=norm,
                  REG_STORE=shuffle and hw and norm)  # the host's rule (fill._launch)
    ptrs = dict(_PTRS, x0=f"*{dtype}", x1=f"*{dtype}", x2=f"*{dtype}",
                out_ptr="*u8" if fp8 else f"*{dtype}")
    aligned = ("x0", "x1", "x2") if parts_aligned_only else tuple(_PTRS)
    types = {n: "constexpr" if n in consts else ptrs[n] for n in names}
    src = ASTSource(fn=k, signature=types,
                    constexprs={(names.index(a),): v for a, v in consts.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)


def ptx(opts: dict, fp8: bool = False, full: bool = False, shuffle: bool = False) -> str:
    return compiled(opts, fp8, full, shuffle).asm["ptx"]


#: What marks an inline asm in the TTGIR (``norm_layout``): the norm's (``_ptx_norm_inv``)
#: and the FP8 bytes' register stores (``fill_epilogue._store_words``).
ASM = {"norm": r"shfl\.sync\.bfly", "store": r"st\.global\.b32 \[\$2\]"}


def norm_layout(ttgir: str, asm: str = "norm") -> list:
    """``[sizePerThread, threadsPerWarp, order]`` of the blocked layout of the inline asms that
    ``ASM[asm]`` marks (all of them in one layout), from the TTGIR; asms in a slice layout
    (the per-row scales' stores) are not matched."""
    aliases = dict(re.findall(r"^(#\w+) = #ttg\.blocked<(.*)>$", ttgir, re.M))
    (enc,) = {m.group(1) for m in re.finditer(
        r'tt\.elementwise_inline_asm "[^"]*' + ASM[asm]
        + r'[^"]*".*-> tensor<[^,>]+, (#\w+)>', ttgir)}
    fields = dict(re.findall(r"(\w+) = \[([\d, ]*)\]", aliases[enc]))
    return [[int(v) for v in fields[f].split(",")]
            for f in ("sizePerThread", "threadsPerWarp", "order")]


if __name__ == "__main__":
    if sys.argv[1:] == ["fp8"]:
        print(json.dumps({"fp8": ptx(LAUNCH_OPTIONS, fp8=True),
                          "fp8_full": ptx(LAUNCH_OPTIONS, fp8=True, full=True),
                          "fp8_shuffle": ptx(LAUNCH_OPTIONS, fp8=True, full=True,
                                             shuffle=True),
                          "fp8_shuffle_masked": ptx(LAUNCH_OPTIONS, fp8=True, shuffle=True)}))
    elif sys.argv[1:] == ["sm80"]:
        # the FP8 fills where the GPU has no e4m3 conversion (HW_E4M3 off), plain and normed
        out = {}
        for norm in (False, True):
            k = compiled(LAUNCH_OPTIONS, fp8=True, full=True, arch=80, hw_e4m3=False,
                         norm=norm)
            out["norm" if norm else "plain"] = k.asm["ptx"]
        print(json.dumps(out))
    elif sys.argv[1:] == ["layouts"]:
        cases = dict(LAYOUT_CASES, **{"sm90 fp32 full": (90, False, True, "fp32", False)})
        out = {}
        for name, (arch, fp8, full, dtype, only) in cases.items():
            ttgir = compiled(LAUNCH_OPTIONS, fp8, full, True, dtype, arch, only).asm["ttgir"]
            out[name] = norm_layout(ttgir)
            if fp8:
                out[f"{name} store"] = norm_layout(ttgir, "store")
        print(json.dumps(out))
    else:
        print(json.dumps({"fused": ptx(dict(LAUNCH_OPTIONS, enable_fp_fusion=True)),
                          "launched": ptx(LAUNCH_OPTIONS),
                          "launched_full": ptx(LAUNCH_OPTIONS, full=True),
                          "launched_shuffle": ptx(LAUNCH_OPTIONS, full=True, shuffle=True)}))
