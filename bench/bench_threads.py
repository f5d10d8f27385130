"""Thread policy benchmark: seconds per round of creff, clip2fl and fedclip at fedfeat's default (the thread policy,
``fedfeat.runs.threads``) and at fixed thread counts, with 1, 2 and 4 jobs running at once on this machine.

    python bench/bench_threads.py          # make bench-threads; writes bench/results/threads.md
    python bench/bench_threads.py --tiny   # a check that it runs: tiny stores, 2 rounds; not a measurement

Time: 27 cells on 2 cores (3 methods x 1/2/4 jobs x auto/1/2 threads), each N processes of 3 rounds; estimated
~10 min on a quiet 2-core machine. On a loaded one the fixed counts above the free cores hit the oversubscription
cliff (the --tiny check took 12 min on a 2-core machine shared with other work: 2 threads ran 18-89 s per round
where 1 thread ran ~1 s), so run it when the machine is otherwise idle.

Each cell starts N ``fedfeat train`` processes together (N = jobs: several terminals, or a launcher's jobs, sharing
the machine), each with ``--threads auto`` (the default) or ``--threads k``, and without ``OMP_NUM_THREADS`` /
``FEDFEAT_THREADS`` in their environment (so that ``auto`` is the policy's choice, which each process makes on its
own from the machine it sees). A job's figure is the median of its rounds 2..R (round 1 holds one-time costs); a
cell's is the median over its jobs' rounds, and the table also gives the thread counts the policy chose. Cells of
one (method, jobs) are interleaved over ``--repeats`` so that a slow spell of the host hits every setting. "best"
is the fastest fixed count on this machine; "default / best" is what the policy loses against it (the goal: within
1.3x for creff and clip2fl, alone and with 4 jobs).

Settings: creff / clip2fl as ``make demo-clip2fl`` (synthetic CIFAR-10 shape at ViT-B/32's D = 512, long tail IF
100, ``dirichlet-equal`` alpha 0.5, 20 clients x 40 %, the methods' defaults: 10 local epochs, 100 matching steps,
300 re-training epochs); fedclip as ``make demo-open-vocab`` (synthetic Caltech101 under ViT-L/14@336, D = 768,
Fed-MP's split: 10 clients x 9 classes x 8 shots, all clients). Stores are built if missing.
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
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import machine, write_table  # noqa: E402  (one description of the machine for every table)

from fedfeat.runs.threads import usable_cores  # noqa: E402

LT = ["--partition", "dirichlet-equal", "--alpha", "0.5", "--imbalance-factor", "100", "--clients", "20",
      "--participation", "0.4"]  # fmt: skip
OPEN_VOCAB = ["--preset", "caltech101", "--class-order", "store"]
# method: (store name, SynthParams fields, train flags); --tiny shrinks the stores (D = 64, fewer samples)
SETTINGS = {
    "creff": ("synth-cifar10-vitb32.zarr", {"dim": 512}, LT),
    "clip2fl": ("synth-cifar10-vitb32.zarr", {"dim": 512}, LT),
    "fedclip": ("synth-caltech101-vitl14.zarr", "caltech101-vitl14", OPEN_VOCAB),
}
TINY = {"synth-cifar10-vitb32.zarr": {"dim": 64, "train_per_class": 400, "test_per_class": 50, "templates": 2},
        "synth-caltech101-vitl14.zarr": {"dim": 64}}  # fmt: skip


def store_for(method: str, tiny: bool, root: Path) -> Path:
    from dataclasses import replace

    from fedfeat.store.synth import PRESETS, SynthParams, write_synthetic_store
    from fedfeat.store.urls import is_store

    name, params, _ = SETTINGS[method]
    p = PRESETS[params] if isinstance(params, str) else SynthParams(**params)
    if tiny:
        p = replace(p, **TINY[name])
    path = root / name
    if not is_store(path):
        write_synthetic_store(path, p, stats=False, log=lambda *a: None)
    return path


def cell(method: str, store: Path, jobs: int, threads: str, rounds: int) -> tuple[list[float], list[int]]:
    """``jobs`` train processes started together: every job's round times (rounds 2..R) and the threads each ran."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "FEDFEAT_THREADS")}
    env["HF_HUB_OFFLINE"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for j in range(jobs):
            cmd = [sys.executable, "-m", "fedfeat", "train", "--method", method, "--store", str(store),
                   *SETTINGS[method][2], "--rounds", str(rounds), "--seed", str(j), "--threads", threads,
                   "--out", f"{tmp}/{j}", "--name", "run", "--quiet"]  # fmt: skip
            procs.append(
                subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            )
        times, chosen = [], []
        for j, p in enumerate(procs):
            _, err = p.communicate()
            if p.returncode:
                raise SystemExit(
                    f"{method} jobs={jobs} threads={threads}: job {j} failed:\n{err.decode()[-2000:]}"
                )
            run = Path(tmp) / str(j) / "run"
            rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
            times += [r["seconds"] for r in rows if r["round"] >= 2]
            chosen.append(json.loads((run / "summary.json").read_text())["env"]["threads"]["n"])
    return times, chosen


def counts(cores: int) -> list[int]:
    """1, 2, 4, ... up to the usable cores, and the cores themselves."""
    out, k = [], 1
    while k < cores:
        out.append(k)
        k *= 2
    return [*out, cores]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="creff,clip2fl,fedclip")
    ap.add_argument("--jobs", default="1,2,4", help="how many jobs run at once, comma-separated")
    ap.add_argument("--threads", default=None, help="fixed counts to compare (default: 1, 2, 4, ..., cores)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per job; rounds 2..R are timed")
    ap.add_argument("--repeats", type=int, default=1, help="interleaved repeats of each cell")
    ap.add_argument(
        "--tiny", action="store_true", help="tiny stores in a temporary folder, 2 rounds: a check"
    )
    ap.add_argument("--out", default=None, help="default bench/results/threads.md (--tiny: not written)")
    args = ap.parse_args()
    cores = usable_cores()
    fixed = [int(x) for x in args.threads.split(",")] if args.threads else counts(cores)
    rounds = 2 if args.tiny else args.rounds
    out = args.out or (None if args.tiny else str(ROOT / "bench" / "results" / "threads.md"))
    t0 = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) if args.tiny else ROOT / "cache"
        for method in args.methods.split(","):
            store = store_for(method, args.tiny, root)
            for jobs in (int(x) for x in args.jobs.split(",")):
                settings = ["auto", *map(str, fixed)]
                res: dict[str, list[float]] = {s: [] for s in settings}
                chosen: list[int] = []
                for _ in range(args.repeats):
                    for s in settings:  # interleaved
                        times, ch = cell(method, store, jobs, s, rounds)
                        res[s] += times
                        chosen += ch if s == "auto" else []
                med = {s: statistics.median(v) for s, v in res.items()}
                best = min(fixed, key=lambda k: med[str(k)])
                rows.append((method, jobs, med, best, sorted(set(chosen))))
                print(f"{method} x{jobs}: " + ", ".join(f"{s} {v:.3f}" for s, v in med.items())
                      + f" (auto chose {sorted(set(chosen))}; {time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
    lines = [
        "## Threads: seconds per round at fedfeat's default and at fixed thread counts, with jobs at once",
        "",
        f"Machine: {machine()}; {cores} usable cores. Command: `python bench/bench_threads.py"
        f"{' ' + ' '.join(sys.argv[1:]) if sys.argv[1:] else ''}` (`make bench-threads`): each cell starts N "
        "`fedfeat train` processes together, without OMP_NUM_THREADS / FEDFEAT_THREADS, each with `--threads auto` "
        f"(the policy, deciding on its own) or `--threads k`; median round over rounds 2..{rounds} of every job"
        f"{f' and {args.repeats} interleaved repeats' if args.repeats > 1 else ''}. creff / clip2fl: the "
        "demo-clip2fl setting (D = 512, IF 100, 20 clients x 40 %); fedclip: the demo-open-vocab setting (D = 768, "
        "10 clients x 9 classes x 8 shots).",
        "",
        "| method | jobs at once | default: s / round (threads chosen) | "
        + " | ".join(f"{k} thread{'s' * (k > 1)}" for k in fixed)
        + " | best | default / best |",
        "|---|---|---|" + "---|" * len(fixed) + "---|---|",
    ]
    for method, jobs, med, best, chosen in rows:
        lines.append(
            f"| {method} | {jobs} | **{med['auto']:.3f}** ({', '.join(map(str, chosen))}) | "
            + " | ".join(f"{med[str(k)]:.3f}" for k in fixed)
            + f" | {best} | {med['auto'] / med[str(best)]:.2f}x |"
        )
    lines += [
        "",
        "The policy (README, CPU threads; `fedfeat/runs/threads.py`): the usable cores divided among the fedfeat "
        "jobs on the machine (a launcher's count, and the register of running fedfeat commands in "
        "`$TMPDIR/fedfeat-jobs-<uid>/`, so that jobs started at the same moment count each other before any of them "
        "keeps a core busy), and fewer while other processes keep cores busy (their runnable threads when the "
        "command starts, averaged over ~50 ms; a core is given up when more than a quarter of it is busy); a job "
        "that ended a moment ago does not count (the 1-minute load average would still show it). The goal (issue "
        "35): the default within 1.3x of the best fixed count for creff and clip2fl, alone and with 4 jobs at once.",
        "",
    ]
    if out:
        write_table(Path(out), lines)
    else:
        print("\n".join(lines))


if __name__ == "__main__":
    main()
