"""Domain federations against a single-store run of the same size: seconds per round of ``fedfeat train`` with
clients = domains (``--partition domain``: 4 domains x 5 clients, FedOTP's Dirichlet inside a domain), on a store
combined from two datasets (``fedfeat combine``, each dataset a domain, 10 clients each), and on one store without
domains (``--partition dirichlet``, 20 clients) -- all 50,000 training rows, D = 512, 10 classes per dataset.

    python bench/bench_domain.py       # ~2 min on 2 CPU cores; writes bench/results/domain.md

The stores are synthetic (``fedfeat synth``: ``--domains 4`` for the domain store; two 25,000-row stores combined);
every client trains every round (participation 1), fedavg's defaults (batch 50, one local epoch), the default kernel.
``train`` is a round's ``train_seconds`` (local updates, aggregation, server step), ``round`` its ``seconds`` (+ the
test evaluation, per-domain accuracy included). Means of rounds 2..R over ``--repeats`` processes.
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


def fedfeat(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "fedfeat", *args], check=True, cwd=ROOT, capture_output=True)


def stores(root: Path) -> dict[str, str]:
    """The three stores (built once under ``root``)."""
    from fedfeat.store.urls import is_store

    out = {"domains": root / "domains4.zarr", "single": root / "single.zarr", "a": root / "a.zarr",
           "b": root / "b.zarr", "combined": root / "combined.zarr"}  # fmt: skip
    common = ["--classes", "10", "--dim", "512", "--templates", "1", "--no-stats"]
    if not is_store(out["domains"]):
        fedfeat("synth", "--out", str(out["domains"]), "--domains", "4", "--train-per-class", "1250",
                "--test-per-class", "250", *common)  # fmt: skip
    if not is_store(out["single"]):
        fedfeat(
            "synth",
            "--out",
            str(out["single"]),
            "--train-per-class",
            "5000",
            "--test-per-class",
            "1000",
            *common,
        )
    for k, seed in (("a", "0"), ("b", "1")):
        if not is_store(out[k]):
            fedfeat("synth", "--out", str(out[k]), "--train-per-class", "2500", "--test-per-class", "500",
                    "--seed", seed, *common)  # fmt: skip
    if not is_store(out["combined"]):
        fedfeat("combine", str(out["combined"]), str(out["a"]), str(out["b"]), "--name", "a", "--name", "b")
    return {k: str(v) for k, v in out.items()}


def timed(store: str, partition: list[str], rounds: int, repeats: int) -> tuple[float, float]:
    train, rnd = [], []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            fedfeat("train", "--method", "fedavg", "--store", store, *partition, "--participation", "1",
                    "--rounds", str(rounds), "--out", tmp, "--quiet")  # fmt: skip
            (run,) = [p for p in Path(tmp).iterdir() if not p.name.startswith(".")]
            rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][2:]
            train += [r["train_seconds"] for r in rows]
            rnd += [r["seconds"] for r in rows]
    return statistics.mean(train), statistics.mean(rnd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=str(ROOT / "cache" / "bench-domain"))
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "domain.md"))
    args = ap.parse_args()
    s = stores(Path(args.root))
    cells = [
        ("one store, `--partition dirichlet --alpha 0.1`, 20 clients", s["single"],
         ["--partition", "dirichlet", "--alpha", "0.1", "--clients", "20"]),
        ("4 domains x 5 clients, `--partition domain --per-domain 5` (FedOTP's split, alpha 0.1)", s["domains"],
         ["--partition", "domain", "--per-domain", "5", "--clients", "20"]),
        ("2 datasets combined x 10 clients, `--partition domain --per-domain 10` (per-dataset vocabulary)",
         s["combined"], ["--partition", "domain", "--per-domain", "10", "--clients", "20", "--min-require-size", "0"]),
    ]  # fmt: skip
    lines = [
        "## Domain federations: seconds per round beside one store of the same size (FedAvg, 20 clients, all train)",
        "",
        f"Machine: {machine()}. Command: `python bench/bench_domain.py` (synthetic stores, 50,000 x 512 train, "
        f"10,000 test; means of rounds 2..{args.rounds} over {args.repeats} processes).",
        "",
        "| federation | train ms / round | round ms / round | / one store (round) |",
        "|---|---|---|---|",
    ]
    base = None
    for label, store, part in cells:
        t, r = timed(store, part, args.rounds, args.repeats)
        base = base or r
        lines.append(f"| {label} | {1e3 * t:.1f} | {1e3 * r:.1f} | {r / base:.2f}x |")
        print(lines[-1], flush=True)
    lines += [
        "",
        "A domain federation is the same batched program: the partition (domains, their clients) is drawn once, the "
        "round trains every client at once, and the evaluation adds one `index_add` per round for the per-domain "
        "accuracy (and, on a combined store, one mask of each test row's dataset vocabulary). The combined store "
        "has 20 classes (10 + 10), so its heads and evaluation are twice as wide as the others'.",
        "",
    ]
    write_table(Path(args.out), lines)


if __name__ == "__main__":
    main()
