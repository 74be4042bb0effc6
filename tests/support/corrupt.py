"""Damaged copies of a file, for the loaders' tests (tests/test_corrupt_files.py, tests/lab/test_trace_corrupt.py)."""

from __future__ import annotations


def flips(raw: bytes, every: int):
    """(position, corrupted bytes) for one flipped bit at every `every`-th byte, two bit positions each."""
    for pos in range(0, len(raw), every):
        for bit in (0, 6):
            b = bytearray(raw)
            b[pos] ^= 1 << bit
            yield pos, bytes(b)


def cuts(raw: bytes):
    """Lengths to truncate `raw` to: empty, the first bytes, a third, half, all but the last bytes."""
    return sorted({0, 1, 2, len(raw) // 3, len(raw) // 2, len(raw) - 2, len(raw) - 1})
