"""Open-vocabulary benchmark: seconds per round of ``fedclip`` and ``fed-mp``, batched vs loop, at the shape of
`make demo-open-vocab`.

    python bench/bench_openvocab.py        # ~1 min on 2 CPU cores; writes bench/results/openvocab.md

Setting: the synthetic Caltech101-shaped ViT-L/14@336 store (102 classes, D = 768; built if missing), Fed-MP's
split (``--preset caltech101``: 10 clients x 9 classes x 10 shots, 8 of them training), all clients, the methods'
defaults (Adam, batch 18, 2 local epochs). A round = local training of all clients + aggregation + the
evaluation over the novel query set (Fed-MP's multimodal prototypes included) and the base test images. Each
(method, engine) runs ``--rounds`` rounds in ``--repeats`` fresh processes; the figure is the median round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import machine, write_table  # noqa: E402  (one description of the machine for every table)


def one(store: str, method: str, engine: str, rounds: int) -> list[float]:
    """Round times of one process (rounds 1..R; round 0 is the evaluation before training)."""
    from fedfeat.engine.data import load_run_data
    from fedfeat.engine.rounds import run_federated
    from fedfeat.methods import get_method
    from fedfeat.partition.stored import store_partition
    from fedfeat.store.featurestore import FeatureStore

    st = FeatureStore.open(store)
    _, part = store_partition(st, scheme="disjoint-classes", clients=10, shots=10, seed=0, save=False)
    data = load_run_data(st, part)
    rows = []
    run_federated(get_method(method), data, rounds=rounds, participation=1.0, seed=0, engine=engine,
                  on_round=rows.append)  # fmt: skip
    return [r["seconds"] for r in rows[1:]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default=str(ROOT / "cache" / "synth-caltech101-vitl14.zarr"))
    ap.add_argument("--methods", default="fedclip,fed-mp")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes per cell")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "openvocab.md"))
    ap.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.store, args.one[0], args.one[1], int(args.one[2]))))
        return
    from fedfeat.store.synth import PRESETS, write_synthetic_store
    from fedfeat.store.urls import is_store

    if not is_store(args.store):
        write_synthetic_store(args.store, PRESETS["caltech101-vitl14"], stats=False, log=lambda *a: None)
    lines = [
        "## Open vocabulary (Fed-MP's setting)",
        "",
        f"Machine: {machine()}. Command: `python bench/bench_openvocab.py` (synthetic Caltech101 under "
        "ViT-L/14@336, D = 768; 10 clients x 9 classes x 8 training shots, all clients; median round over "
        f"{args.repeats} processes x {args.rounds} rounds; a round includes the evaluation).",
        "",
        "| method | batched s / round | loop s / round | loop / batched |",
        "|---|---|---|---|",
    ]
    for m in args.methods.split(","):
        times = {"batched": [], "loop": []}
        for _ in range(args.repeats):
            for eng in times:  # interleaved: a slow spell of the host hits both engines
                out = subprocess.run(
                    [sys.executable, __file__, "--store", args.store, "--one", m, eng, str(args.rounds)],
                    check=True, capture_output=True, text=True, cwd=ROOT,
                )  # fmt: skip
                times[eng] += json.loads(out.stdout.strip().splitlines()[-1])
        b, lo = statistics.median(times["batched"]), statistics.median(times["loop"])
        lines.append(f"| {m} | {b:.4f} | {lo:.4f} | {lo / b:.1f}x |")
        print(lines[-1], flush=True)
    lines += [
        "",
        "At this shape one client's step is already a large matrix program (two [768, 768] adapter layers, Adam over "
        "1.2 M parameters), so on a CPU batching the 10 clients saves only their per-client overhead: the batched "
        "and loop rounds cost the same. A step measured ~35-40 ms of forward and backward and ~56 ms of Adam (its "
        "memory traffic over 10 x 1.2 M parameters x 4 arrays); the batched program is for the GPU, where one kernel "
        "launch per op for all clients is what pays.",
        "",
    ]
    write_table(Path(args.out), lines)


if __name__ == "__main__":
    main()
