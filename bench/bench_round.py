"""The round beyond training: how much of a FedAvg round at 100 clients x 10 % participation is not local training
(evaluation, aggregation's bookkeeping, metrics), with every-round evaluation, with ``--eval-every 10``, and per run
of ten runs stacked into one program (every-round evaluation).

    python bench/bench_round.py        # ~1 min on 2 CPU cores; writes bench/results/round.md

Setting: the default synthetic CIFAR-10 store under RN50 (50,000 x 1024 train, 10,000 x 1024 test; built if
missing), ``fedfeat train --method fedavg`` defaults (Dirichlet alpha 0.1, 100 clients, 10 %, batch 50, one local
epoch: ~5,000 samples a round), fused CPU kernel. ``train`` is ``train_seconds`` of a round's metrics row (local
updates, aggregation, server step); ``round`` its ``seconds`` (+ the test evaluation and the row's bookkeeping).
Means over rounds 2..R of ``--repeats`` processes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import machine, write_table  # noqa: E402


def eval_vs_matmul(data, repeats: int) -> dict[str, float]:
    """Median ms of the class-major matmul alone, of ``engine.rounds.evaluate`` on a trained-looking head, of a plain
    PyTorch evaluation and of the float16-blocks design, interleaved on one thread."""
    import time

    import torch
    import torch.nn.functional as F

    from fedfeat.engine.data import build_context
    from fedfeat.engine.rounds import evaluate
    from fedfeat.methods import get_method

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    m = get_method("fedavg", {})
    ctx = build_context(data, m, 0, torch.device("cpu"))
    glob = m.init_global(ctx)
    y, K = data.test_y, len(data.class_names)
    W, b, XT, X, x16 = glob["W"], glob["b"], ctx.test_xT(), ctx.test_x, data.test_x

    def matmul():
        return torch.addmm(b.unsqueeze(1), W, XT)

    def plain():
        pred = (X @ W.T + b).argmax(1)
        right = pred == y
        return float(right.float().mean()), [float(right[y == k].float().mean()) for k in range(K)]

    def f16(B=1024):
        out = torch.empty(K, x16.shape[0])
        for a in range(0, x16.shape[0], B):
            out[:, a : a + B] = torch.addmm(b.unsqueeze(1), W, F.normalize(x16[a : a + B].float(), dim=-1).T)
        return out.argmax(0)

    fns = {"matmul": matmul, "fedfeat": lambda: evaluate(m, ctx, glob, y, K), "plain": plain, "f16": f16}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    torch.set_num_threads(threads)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default=str(ROOT / "cache" / "synth-cifar10.zarr"))
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "round.md"))
    args = ap.parse_args()
    from fedfeat.store.urls import is_store

    if not is_store(args.store):
        subprocess.run([sys.executable, "-m", "fedfeat", "synth", "--out", args.store], check=True, cwd=ROOT)
    lines = [
        "## The round beyond training (FedAvg, 100 clients x 10 %)",
        "",
        f"Machine: {machine()}. Command: `python bench/bench_round.py` (default synthetic CIFAR-10 store, fedavg "
        f"defaults, fused kernel; means of rounds 2..{args.rounds} over {args.repeats} processes).",
        "",
        "| evaluation | train ms / round | round ms / round | not training |",
        "|---|---|---|---|",
    ]
    for every in (1, 10):
        train, rnd = [], []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                cmd = [sys.executable, "-m", "fedfeat", "train", "--method", "fedavg", "--store", args.store,
                       "--rounds", str(args.rounds), "--eval-every", str(every), "--out", tmp, "--quiet"]  # fmt: skip
                subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True)
                (run,) = [p for p in Path(tmp).iterdir() if not p.name.startswith(".")]
                rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][2:]
                train += [r["train_seconds"] for r in rows]
                rnd += [r["seconds"] for r in rows]
        t, r = statistics.mean(train), statistics.mean(rnd)  # means: evaluated and plain rounds alike
        label = "every round" if every == 1 else f"every {every}th round (`--eval-every {every}`)"
        lines.append(f"| {label} | {1e3 * t:.2f} | {1e3 * r:.2f} | {100 * (1 - t / r):.0f} % |")
        print(lines[-1], flush=True)
    # a third design: ten runs stacked (fedfeat sweep's default for seeds and hyperparameter grids): one evaluation
    # product for the ten heads reads the test features once per round for all of them
    from fedfeat.engine.data import load_run_data
    from fedfeat.methods import get_method
    from fedfeat.partition.make import make_partition
    from fedfeat.runs.stack import run_stacked
    from fedfeat.store.featurestore import FeatureStore

    st = FeatureStore.open(args.store)
    data = load_run_data(st, make_partition(st.labels("train"), "dirichlet", clients=100, alpha=0.1, seed=0))
    R = 10
    train, rnd = [], []
    for rep in range(args.repeats + 1):  # the first: warm-up
        res = run_stacked([get_method("fedavg", {}) for _ in range(R)], data, rounds=args.rounds, participation=0.1,
                          seeds=list(range(R)))  # fmt: skip
        if rep:
            for i in range(2, args.rounds + 1):
                train.append(res[0][1][i]["train_seconds"])  # the stack's training time / R
                rnd.append(max(r[1][i]["seconds"] for r in res) / R)  # the stack's whole round / R
    t, r = statistics.mean(train), statistics.mean(rnd)
    lines.append(
        f"| every round, {R} runs stacked (per run) | {1e3 * t:.2f} | {1e3 * r:.2f} | {100 * (1 - t / r):.0f} % |"
    )
    print(lines[-1], flush=True)
    # one evaluation against its matmul and against a plain PyTorch evaluation of the same head (the peer), in one
    # process on one thread (what the fused path gives torch's ops), interleaved, medians
    ev = eval_vs_matmul(data, repeats=60)
    lines += [
        "",
        "| one evaluation (10,000 x 1024 test set, 10 classes, 1 thread) | ms | / its matmul | goal |",
        "|---|---|---|---|",
        f"| the matmul alone (`addmm`, class-major) | {ev['matmul']:.2f} | 1.00 | - |",
        f"| fedfeat's evaluation (`engine.rounds.evaluate`: logits, argmax, all counts, one host transfer) | "
        f"{ev['fedfeat']:.2f} | {ev['fedfeat'] / ev['matmul']:.2f} | <= 2 |",
        f"| peer: a plain PyTorch evaluation (`x @ W.T + b`, argmax, accuracy, a per-class loop) | {ev['plain']:.2f} | "
        f"{ev['plain'] / ev['matmul']:.2f} | - |",
        f"| design tried: the float16 test set upcast and normalised in blocks of 1,024 rows | {ev['f16']:.2f} | "
        f"{ev['f16'] / ev['matmul']:.2f} | - |",
    ]
    print("\n".join(lines[-6:]), flush=True)
    lines += [
        "",
        "The evaluation is one product of the 10,000 x 1024 test features with the [10, 1024] head. Two designs were "
        "measured: class-major logits `W @ X^T` on a cached transposed test set (adopted: 9.6 -> 6.0 ms on one "
        "thread) and the product on both threads (slower here: 11.7 ms, the OpenMP hand-off costs more than it "
        "saves at this size). It stops near the memory floor: the 41 MB of float32 test features are read once per "
        "evaluation, ~4 ms at the ~10 GB/s one thread draws on this machine, against ~5 ms of training for 5,000 "
        "samples. Every-round evaluation therefore stays above the 25 % goal at this shape; `--eval-every N` is the "
        "remedy for long runs (and `fedfeat reproduce` evaluates only at rounds 0 and last). The third design "
        "removes the floor's cause where a study has several runs: stacked runs (`fedfeat sweep`'s default, "
        "`fedfeat.runs.stack`) evaluate all their heads in one [R x 10, 1024] product, so the test features are read once "
        "per round for the R runs (at R x 10 rows the product is compute-bound, so it gets both threads), and each "
        "run's Python bookkeeping is shared too (the first table's third row), still above the goal. The class argmax reads a "
        "contiguous copy of the logits (0.45 instead of 1.44 ms at 10,000 x 10, both engines). A fourth design read "
        "half the bytes: the test set held as stored (float16) and upcast + normalised a block at a time inside the "
        "evaluation; it is slower (the table's last row: the upcast and the norms cost more than the bandwidth they "
        "save on one thread) and not bitwise equal to the product on the whole array, so it was dropped. Every "
        "count of an evaluation (per class, validation rows, each client's local rows) is summed on the device and "
        "brought to the host in one transfer, so on a GPU an evaluated round waits once for its metrics.",
        "",
    ]
    write_table(Path(args.out), lines)


if __name__ == "__main__":
    main()
