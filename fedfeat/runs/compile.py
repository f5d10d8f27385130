"""Compile the fused CPU kernels ahead of their first use: ``fedfeat compile`` (``make install`` runs it).

numba compiles ``fedfeat.engine.kernels`` the first time a run needs them (~25 s on a 2-core machine, more on a
loaded one) and caches the machine code on disk: next to the kernels' source when that folder is writable (a git
checkout, an editable install), else in numba's per-user cache (``NUMBA_CACHE_DIR`` overrides both). The cache is
valid for this machine's CPU, numba version and the kernels' source file as it is; a new machine or a changed
kernel compiles again. Doing it at install time means a fresh clone's first ``fedfeat train`` starts its first
round within a few seconds (BENCHMARKS.md, "First run").

How: ``compile_kernels`` runs the real engine, one round, on a tiny in-memory run (4 clients, float16 features held
as a store holds them, float32 computation) for one method per compiled kernel -- ``fedavg`` (``linear_epoch``: the
loss mode, FedProx's ``mu`` and the other linear-head variants are run-time arguments of one signature),
``fst-cbdg`` (``fst_epoch``, ``argmax_counts``) -- and a stacked pair of each (``fedfeat.runs.stack``), so that
every signature a float32 run asks for is the one compiled (``tests/test_compile.py`` checks that a run after
``compile_kernels`` compiles nothing). float64 runs (the exactness tests) compile on their first use.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from fedfeat.errors import FedfeatError

METHODS = ("fedavg", "fst-cbdg")  # one method per compiled kernel (module docstring)


def _tiny_data():
    from fedfeat.engine.data import RunData

    g = torch.Generator().manual_seed(0)
    K, D, per = 3, 16, 12
    text = torch.nn.functional.normalize(torch.randn(1, K, D, generator=g), dim=-1)
    y = torch.arange(4 * per) % K
    x = (text[0][y] + 0.3 * torch.randn(len(y), D, generator=g)).half()  # as a store holds them
    ty = torch.arange(2 * K) % K
    tx = (text[0][ty] + 0.3 * torch.randn(len(ty), D, generator=g)).half()
    return RunData(
        train_x=x, train_y=y, offsets=torch.arange(0, 4 * per + 1, per), test_x=tx, test_y=ty, text_all=text,
        clip_logit_scale=100.0, class_names=[f"c{k}" for k in range(K)], train_counts=torch.bincount(y, minlength=K),
    )  # fmt: skip


def signatures() -> dict[str, int]:
    """How many compiled signatures each fused kernel has in this process (loaded from the cache or compiled)."""
    from fedfeat.engine import kernels

    return {
        name: len(getattr(kernels, name).signatures)
        for name in ("_linear_epoch", "_fst_epoch", "_argmax_counts")
    }


def compile_kernels(log: Callable[[str], None] = lambda s: None) -> dict:
    """Compile (or load from numba's disk cache) every fused-kernel signature a float32 CPU run uses.

    Returns ``{"seconds": wall seconds, "compile_seconds": numba's own compile time (0 when all came from the
    cache), "signatures": {kernel: count}, "cache": where numba keeps them}``."""
    try:
        from fedfeat.engine import kernels
    except ImportError as e:  # numba is a dependency; a broken install says so in one line
        raise FedfeatError(
            f"the fused CPU kernels need numba, which does not import ({e}); reinstall fedfeat"
        ) from None
    from fedfeat.engine.rounds import run_federated
    from fedfeat.methods import get_method
    from fedfeat.runs.stack import run_stacked
    from fedfeat.runs.writers import compile_clock

    t0 = time.perf_counter()
    box = [0.0]
    threads = torch.get_num_threads()
    with compile_clock(box):
        for name in METHODS:
            log(f"compiling the fused kernel of {name} ...")
            m = get_method(name, {"batch_size": 5})
            run_federated(m, _tiny_data(), rounds=1, participation=0.5, seed=0, kernel="fused")
            ms = [get_method(name, {"batch_size": 5}) for _ in range(2)]
            run_stacked(ms, _tiny_data(), rounds=1, participation=0.5, seeds=[0, 1], kernel="fused")
    torch.set_num_threads(threads)
    cache = kernels._linear_epoch._cache._cache_path  # numba's cache folder for this module
    return {
        "seconds": time.perf_counter() - t0,
        "compile_seconds": box[0],
        "signatures": signatures(),
        "cache": str(cache),
    }
