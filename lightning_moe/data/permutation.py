"""A keyed pseudo-random permutation of ``[0, n)`` evaluated at any positions, in constant memory.

``feistel_permutation(positions, n, key)[i]`` is where position ``positions[i]`` of the permutation
points. The permutation is a balanced Feistel network of :data:`ROUNDS` rounds over the smallest
even number of bits that covers ``n`` (a bijection of ``[0, 2**bits)``), restricted to ``[0, n)`` by
cycle walking: a value that lands at ``n`` or above is permuted again until it lands inside (as
``2**bits < 4 n``, a few steps at most on average). The round function is the SplitMix64 finalizer
of the right half xor a round key; the round keys come from ``numpy.random.SeedSequence(key)``, so
the order depends only on ``key`` and ``n``, on every platform. Nothing of size ``n`` is ever made.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ROUNDS", "feistel_permutation"]

ROUNDS = 6
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _network(x: np.ndarray, half: int, keys: np.ndarray) -> np.ndarray:
    mask, shift = np.uint64((1 << half) - 1), np.uint64(half)
    left, right = x >> shift, x & mask
    for key in keys:
        left, right = right, left ^ (_mix(right ^ key) & mask)
    return (left << shift) | right


def feistel_permutation(positions: np.ndarray, n: int, key: int) -> np.ndarray:
    """int64 images of ``positions`` (each in ``[0, n)``) under the permutation of ``[0, n)`` keyed by ``key``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"feistel_permutation: n={n!r} must be a positive int (the dataset length).")
    pos = np.asarray(positions, dtype=np.int64)
    if pos.size and (int(pos.min()) < 0 or int(pos.max()) >= n):
        got = f"{int(pos.min())}..{int(pos.max())}"
        raise ValueError(f"feistel_permutation: positions must lie in [0, n={n}); got {got}.")
    bits = max(2, (n - 1).bit_length())
    half = (bits + 1) // 2
    keys = np.random.SeedSequence(key % (1 << 64)).generate_state(ROUNDS, dtype=np.uint64)
    out = _network(pos.astype(np.uint64), half, keys)
    outside = out >= np.uint64(n)
    while outside.any():
        out[outside] = _network(out[outside], half, keys)
        outside = out >= np.uint64(n)
    return out.astype(np.int64)
