"""Ten runs in one ``fedfeat sweep`` process against ten ``fedfeat train`` processes and against one run.

    python bench/bench_sweep.py        # ~1 min on 2 CPU cores; writes bench/results/sweep.md

Setting: the default synthetic CIFAR-10 store (built if missing), ``fedavg`` and ``fst-cbdg`` defaults (Dirichlet
alpha 0.1, 100 clients, 10 %, 10 rounds), seeds 0..9: wall-clock time of the whole command, median of
``--repeats``. The sweep shares the interpreter, the compiled kernels, the store's verified features and the
partition between its runs; it makes them one after another (stacking runs along a run axis in one batched program
is not implemented).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import machine, write_table  # noqa: E402


def timed(cmds: list[list[str]]) -> float:
    t = time.perf_counter()
    for c in cmds:
        subprocess.run(c, check=True, cwd=ROOT, capture_output=True)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default=str(ROOT / "cache" / "synth-cifar10.zarr"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "sweep.md"))
    args = ap.parse_args()
    from fedfeat.store import is_store

    py = [sys.executable, "-m", "fedfeat"]
    if not is_store(args.store):
        subprocess.run([*py, "synth", "--out", args.store], check=True, cwd=ROOT)
    lines = [
        "## Sweeps: ten runs in one process",
        "",
        f"Machine: {machine()}. Command: `python bench/bench_sweep.py` (default synthetic store, 100 clients x 10 %, "
        f"10 rounds, seeds 0-9; wall-clock of the whole command, median of {args.repeats}).",
        "",
        "| method | 1 run (`train`) s | 10 runs, 10 `train` processes s | 10 runs, one `sweep` s | 10 processes / sweep |",
        "|---|---|---|---|---|",
    ]
    for method in ("fedavg", "fst-cbdg"):
        res = {"one": [], "procs": [], "sweep": []}
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                base = ["--method", method, "--store", args.store]
                one = [[*py, "train", *base, "--seed", "0", "--out", f"{tmp}/a", "--quiet"]]
                procs = [
                    [*py, "train", *base, "--seed", str(s), "--out", f"{tmp}/b", "--quiet"] for s in range(10)
                ]
                sweep = [[*py, "sweep", *base, "--seed", "0-9", "--out", f"{tmp}/c", "--quiet"]]
                res["one"].append(timed(one))
                res["procs"].append(timed(procs))
                res["sweep"].append(timed(sweep))
        o, p, s = (statistics.median(res[k]) for k in ("one", "procs", "sweep"))
        lines.append(f"| {method} | {o:.1f} | {p:.1f} | {s:.1f} | {p / s:.1f}x |")
        print(lines[-1], flush=True)
    lines += [
        "",
        "A `train` process spends most of its seconds starting (the interpreter, torch, the kernels' compiled code "
        "loaded from numba's cache, the store's features read and verified); a sweep pays that once. Stacking the "
        "ten runs into one batched program (a run axis) is the next step and not implemented: the sweep's runs are "
        "made one after another.",
        "",
    ]
    write_table(Path(args.out), lines)


if __name__ == "__main__":
    main()
