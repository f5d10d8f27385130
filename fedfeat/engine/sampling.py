"""Client sampling at cross-device scale: ``np.random.RandomState(seed).choice(n, m, replace=False)``, the same
clients bit for bit, in one compiled loop.

``choice`` without replacement is ``permutation(n)[:m]``: a Fisher-Yates shuffle of ``arange(n)`` that draws, for
``i = n-1 .. 1``, ``j = random_interval(i)`` -- the generator's next 32-bit word under the smallest all-ones mask
``>= i``, drawn again while the result exceeds ``i`` (numpy's ``distributions.c``). Every word of the stream is
needed (how many a draw consumes depends on the rejections), so the work stays ``O(n)`` a round; numpy spends
~25 ns a client on it plus ~0.6 ms building the ``RandomState`` (3 ms a round at 100,000 clients, as much as
training 100 clients of 5 rows). Here the legacy seeding (``mt19937_seed``), the MT19937 words (``mt19937_gen``,
tempering) and the shuffle run in one numba function: the same words, the same clients (``tests/test_scale.py``
compares both with numpy), several times faster. Memory: the ``[n]`` int64 permutation, freed when it returns.
"""

from __future__ import annotations

import numpy as np

from fedfeat.engine.numba_cache import cached

_N, _M = 624, 397
_MATRIX_A, _UPPER, _LOWER = 0x9908B0DF, 0x80000000, 0x7FFFFFFF
_M32 = 0xFFFFFFFF


@cached()
def _seed(key, seed):  # pragma: no cover - compiled
    """numpy's legacy ``mt19937_seed``: the key of ``RandomState(seed)`` for an int seed in [0, 2**32)."""
    s = np.uint64(seed) & np.uint64(_M32)
    for pos in range(_N):
        key[pos] = s
        s = (np.uint64(1812433253) * (s ^ (s >> np.uint64(30))) + np.uint64(pos + 1)) & np.uint64(_M32)


@cached()
def _gen(key):  # pragma: no cover - compiled
    """numpy's ``mt19937_gen``: the next 624 untempered words, in place (uint64 holding 32-bit values)."""
    for i in range(_N):
        y = (key[i] & np.uint64(_UPPER)) | (key[(i + 1) % _N] & np.uint64(_LOWER))
        v = key[(i + _M) % _N] ^ (y >> np.uint64(1))
        if y & np.uint64(1):
            v ^= np.uint64(_MATRIX_A)
        key[i] = v


@cached()
def _choice(seed, n, m):  # pragma: no cover - compiled
    key = np.empty(_N, dtype=np.uint64)
    _seed(key, seed)
    pos = _N
    a = np.arange(n).astype(np.int32)  # n < 2**31 (legacy_choice): half the bytes of the random swaps
    for i in range(n - 1, 0, -1):
        mask = np.uint64(i)
        mask |= mask >> np.uint64(1)
        mask |= mask >> np.uint64(2)
        mask |= mask >> np.uint64(4)
        mask |= mask >> np.uint64(8)
        mask |= mask >> np.uint64(16)
        while True:
            if pos == _N:
                _gen(key)
                pos = 0
            y = key[pos]
            pos += 1
            y ^= y >> np.uint64(11)
            y ^= (y << np.uint64(7)) & np.uint64(0x9D2C5680)
            y ^= (y << np.uint64(15)) & np.uint64(0xEFC60000)
            y ^= y >> np.uint64(18)
            v = y & mask
            if v <= np.uint64(i):
                break
        j = np.int64(v)
        t = a[i]
        a[i] = a[j]
        a[j] = t
    return a[:m].astype(np.int64)


def legacy_choice(seed: int, n: int, m: int) -> np.ndarray:
    """``np.random.RandomState(seed).choice(n, m, replace=False)`` (int64 ``[m]``, in its order), bit for bit."""
    seed, n, m = int(seed), int(n), int(m)
    if not (0 <= seed < 1 << 32 and 0 <= m <= n < 1 << 31) or n < 2:
        return np.random.RandomState(seed).choice(n, m, replace=False)
    return _choice(seed, n, m)
