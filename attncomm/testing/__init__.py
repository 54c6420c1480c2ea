"""Test tooling shipped with the library: fp64 references, the special-value table of the DCP
merge, and the seeded fuzz (``python -m attncomm.testing.fuzz``). Nothing here is imported by
the exchanges themselves."""
