"""First run: how long a fresh clone's first ``fedfeat train`` takes to start training, with numba's kernel cache
cold (no ``fedfeat compile`` yet: the run compiles) and warm (after ``fedfeat compile``, which ``make install`` runs).

    python bench/bench_startup.py        # ~2 min on 2 CPU cores (one cold compile); writes bench/results/startup.md

Each command runs in a fresh process with its own empty ``NUMBA_CACHE_DIR`` (cold) or one that ``fedfeat compile``
filled (warm). ``startup`` is the run's ``startup_seconds`` (``summary.json``: the process's age when round 1
starts -- interpreter, imports, store, partition, loading, kernels, round 0's evaluation), ``compile`` its
``compile_seconds``, and round 1's end the start-up plus round 1's ``seconds`` (a cold cache's compile falls there). The floor beside them: a process that only imports torch and numpy and reads the store's
train features (``python -c``), which any tool on this data pays. Medians of ``--repeats`` processes.
Setting: ``fedfeat train --method fedavg`` on the default synthetic store (Dirichlet 0.1, 100 clients), 1 round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import machine, write_table  # noqa: E402

FLOOR = (
    "import time, numpy, torch, zarr; g = zarr.open_group({store!r}, mode='r'); x = g['train/features'][:]; "
    "print(torch.from_numpy(x).float().shape)"
)


def _train(store: str, env: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "fedfeat", "train", "--method", "fedavg", "--store", store, "--rounds", "1",
             "--out", tmp, "--quiet"],
            check=True, cwd=ROOT, env=env, capture_output=True,
        )  # fmt: skip
        wall = time.perf_counter() - t
        (run,) = [p for p in Path(tmp).iterdir() if not p.name.startswith(".")]
        s = json.loads((run / "summary.json").read_text())
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        first = next(r for r in rows if r["round"] == 1)["seconds"]  # round 1, a first use's compile included
        return {"startup": s["startup_seconds"], "compile": s["compile_seconds"], "wall": wall,
                "done": s["startup_seconds"] + first}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default=str(ROOT / "cache" / "synth-cifar10.zarr"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "startup.md"))
    args = ap.parse_args()
    from fedfeat.store.urls import is_store

    if not is_store(args.store):
        subprocess.run([sys.executable, "-m", "fedfeat", "synth", "--out", args.store], check=True, cwd=ROOT)
    base = dict(os.environ, HF_HUB_OFFLINE="1")
    rows: dict[str, list[dict]] = {"cold": [], "warm": []}
    compile_s = []
    floor = []
    for rep in range(args.repeats + 1):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(base, NUMBA_CACHE_DIR=cache)
            if rep == 0:  # one cold run: it compiles its kernel itself
                rows["cold"].append(_train(args.store, env))
                continue
            t = time.perf_counter()
            subprocess.run(
                [sys.executable, "-m", "fedfeat", "compile", "--quiet"], check=True, cwd=ROOT, env=env
            )
            compile_s.append(time.perf_counter() - t)
            rows["warm"].append(_train(args.store, env))
        t = time.perf_counter()
        subprocess.run(
            [sys.executable, "-c", FLOOR.format(store=args.store)], check=True, capture_output=True
        )
        floor.append(time.perf_counter() - t)
        print(rows["warm"][-1], compile_s[-1], floor[-1], flush=True)
    med = {
        k: {f: statistics.median(r[f] for r in v) for f in ("startup", "compile", "wall", "done")}
        for k, v in rows.items()
    }
    fl = statistics.median(floor)
    comp = statistics.median(compile_s)
    cold, warm = med["cold"], med["warm"]
    lines = [
        "## First run: start-up to training, numba's kernel cache cold and warm",
        "",
        f"Machine: {machine()}. Command: `python bench/bench_startup.py` (`fedfeat train --method fedavg`, default "
        f"synthetic store, Dirichlet 0.1, 100 clients, 1 round; a fresh process per figure, its own "
        f"`NUMBA_CACHE_DIR`; medians of {args.repeats} warm processes, each after its own `fedfeat compile`; one cold).",
        "",
        "| first `fedfeat train` | start-up to round 1's start (s) | to round 1's end (s) | compiling (s) | whole "
        "command (s) | goal |",
        "|---|---|---|---|---|---|",
        f"| cold cache (no `fedfeat compile`) | {cold['startup']:.1f} | {cold['done']:.1f} | {cold['compile']:.1f} | "
        f"{cold['wall']:.1f} | - |",
        f"| warm cache (after `make install`'s `fedfeat compile`) | {warm['startup']:.1f} | {warm['done']:.1f} | "
        f"{warm['compile']:.1f} | {warm['wall']:.1f} | <= 5 s |",
        f"| floor: a process that imports torch and reads the store's train features | {fl:.1f} | - | - | {fl:.1f} "
        "| - |",
        "",
        "A cold cache starts round 1 as early, then compiles inside it (numba compiles a kernel on its first call): "
        "the first round ends only after the compile. "
        f"`fedfeat compile` itself (cold cache, the two kernels and their stacked form; median): {comp:.1f} s. The warm "
        f"start-up is {warm['startup'] / fl:.1f}x the floor: what it adds is fedfeat's imports (typer, zarr, numba, "
        "the method registry), the partition, the client-major copy of the features and round 0's evaluation.",
    ]
    write_table(Path(args.out), lines)


if __name__ == "__main__":
    main()
