"""The fp64 reference of the DCP merge, shared by the CPU, interpreter and GPU tests (it lives in
attncomm.testing.reference, where the fuzz uses it too)."""
from __future__ import annotations

from attncomm.testing.reference import ref_merge

__all__ = ["ref_merge"]
