"""Counter-based randomness: every random number is a function of (run seed, round, epoch, item).

The same run seed gives the same numbers whatever the engine (batched or loop), the batch of clients
trained together, or which other clients were sampled: a client's shuffle in round r depends only on
(seed, r, epoch, its samples' positions). The hash is splitmix64's finaliser on int64 tensors (wrapping
multiplies; logical right shifts emulated by masking).
"""

from __future__ import annotations

import numpy as np
import torch

# splitmix64's constants (unsigned); the tensor hash uses their int64 bit patterns. Three implementations share
# them: ``_mix`` (int64 tensors), ``_mix_u64`` (python ints), ``fedfeat.engine.kernels._uniform_key`` (numba, uint64).
GOLDEN, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _int64(u: int) -> int:
    """The int64 value of a 64-bit pattern ``u`` in [0, 2^64)."""
    return u - (1 << 64) if u >> 63 else u


_GOLDEN, _MIX1, _MIX2 = _int64(GOLDEN), _int64(MIX1), _int64(MIX2)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _MIX1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _MIX2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


_M64 = (1 << 64) - 1


def _mix_u64(u: int) -> int:
    """``_mix`` on one python int in [0, 2^64) (the int64 bit pattern): no tensor per call."""
    u ^= u >> 30
    u = (u * MIX1) & _M64
    u ^= u >> 27
    u = (u * MIX2) & _M64
    return u ^ (u >> 31)


def _mix_int(*parts: int) -> int:
    """Hash a tuple of python ints to one int64 (chained splitmix; bit for bit the tensor ``_mix``)."""
    u = 0x1234567
    for p in parts:
        u = _mix_u64((u + _GOLDEN + (int(p) & ((1 << 62) - 1))) & _M64)
    return _int64(u)


def stream_key(*parts: int) -> int:
    """A 63-bit key naming one random stream, e.g. ``stream_key(seed, round, epoch, TAG)``."""
    return _mix_int(*parts) & ((1 << 63) - 1)


def uniform_keys(key: int, items: torch.Tensor) -> torch.Tensor:
    """One pseudo-random int64 (>= 0) per item id, a pure function of ``(key, item)``."""
    x = _mix(items.to(torch.int64) * _GOLDEN + key)
    return x & ((1 << 62) - 1)


def generator(*parts: int, device: str | torch.device = "cpu") -> torch.Generator:
    """A ``torch.Generator`` seeded from ``parts`` (for draws that are the same for every client)."""
    g = torch.Generator(device=device)
    g.manual_seed(stream_key(*parts))
    return g


def numpy_rng(*parts: int) -> np.random.RandomState:
    """A numpy ``RandomState`` seeded from ``parts`` (client sampling)."""
    return np.random.RandomState(stream_key(*parts) % (2**32))


# tags that keep streams of different purposes apart
TAG_SAMPLE_CLIENTS = 1
TAG_SHUFFLE = 2
TAG_SYNTH_ORDER = 3
TAG_SYNTH_NOISE = 4
TAG_SYNTH_OFFSET = 5
