"""Patterns of the fill kernel's PTX that the CPU tests (compiled for sm_90 without a GPU) and
the GPU tests (the kernels a launch compiled) look for."""
from __future__ import annotations

import re

#: A 32-bit store from registers (``fill_epilogue._store_words``' asm, its operands
#: substituted; Triton's own stores read ``st.global.b32 [ %rd1 + 0 ], { %r1 }``).
REG_STORE = re.compile(r"st\.global\.b32 \[%rd\d+\], %r\d+;")
#: The same store predicated on its word's mask (the asm's masked form).
REG_STORE_MASKED = re.compile(r"@live st\.global\.b32 \[%rd\d+\], %r\d+;")
