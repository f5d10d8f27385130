"""GPU benchmark: the batched torch engine against the loop engine, stacked runs against one by one, the engines'
agreement and peak GPU memory, on one device, in one process (``make bench-gpu`` on a GPU machine).

    PYTHONPATH=. python3 bench/bench_gpu.py --out bench/results/gpu.md                 # ~3-5 min on one H100
    PYTHONPATH=. python bench/bench_gpu.py --device cpu --quick --out /tmp/gpu_cpu.md   # the CPU smoke check

Device-agnostic (``--device cuda|cpu``, default cuda when torch sees one). The program is the torch one on every
device (``--kernel torch``: what ``--kernel auto`` picks on a GPU; the fused kernels are CPU-only), so a CPU run
checks the very code a GPU runs. Stores (built if missing, ~2 s each): the synthetic CIFAR-10 shape (50,000 x 1024,
10 classes) and a CIFAR-100 shape (50,000 x 1024, 100 classes, ``s = 0.1`` as the 102-class preset). ``--quick``:
small stores (1,000 x 128), 20 clients, 3 runs stacked, one timed round a cell, a lighter CReFF / CLIP2FL, a
shorter budget, one torch thread on a CPU.

* a. Seconds of training per round (``train_seconds``: local updates, aggregation, server step; the engine
  synchronises CUDA before it reads the clock, and the round before ends with a host sync), median of the timed
  rounds after one warm-up round, batched engine vs loop engine (one client at a time), ``iid`` partition, 100
  clients at 10 % and 100 % participation. CReFF and CLIP2FL run a lighter server step (``LIGHT``: 30 re-training
  epochs and 10 matching steps a round instead of 300 / 100; the same code in both engines); their local steps
  are the defaults. A cell stops after the round in which it passed ``--cell-cap`` seconds: the slow loop cells
  time fewer rounds (in parentheses after each figure; ``warm-up only``: the warm-up round is the figure).
* b. Ten runs stacked (``runs.stack.run_stacked``: what ``fedfeat sweep`` does by default) against the same ten
  runs one by one (``engine.run_federated``) and one run: whole programs, ``torch.cuda.synchronize`` on both sides
  of the clock, median of ``--repeats`` interleaved after a warm-up (fewer where a repeat would pass
  ``--cell-cap``); Dirichlet alpha 0.1, 100 clients (the sweep bench's setting), 10 % participation (fedavg also
  100 %), runs differing in seed (fedavg also in lr, seed 0). The open question (BENCHMARKS.md,
  "Stacked runs inside the engine"): the lockstep program launches R times as many small kernels per step; is it
  still faster than one by one on a GPU?
* c. Agreement: batched vs loop engine final test accuracy (within 1e-4?) and the largest weight difference,
  ``--check-rounds`` rounds of the Dirichlet setting at 10 %; part a's rows report theirs too.
* d. Peak GPU memory of each cell (``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``; it
  includes the data held on the device, given above each table).

``--budget`` (seconds from the start): the cells left once it is spent are skipped, and named. Parts run in the
order a (light methods), b, c, a (CReFF, CLIP2FL), a (100 classes), and the results file is rewritten after each,
so a run that is killed still leaves what it measured.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the GPU machine has no network; nothing here downloads
T0 = time.perf_counter()

# CReFF / CLIP2FL: their local steps at the defaults, the server step lighter (300 re-training epochs and 100
# matching steps a round by default, ~1 s a round on a CPU, the same code in both engines)
LIGHT = {"crt_epochs": "30", "match_steps": "10"}
LIGHT_QUICK = {"crt_epochs": "2", "match_steps": "2", "local_epochs": "2"}
LIGHT_METHODS = ["fedavg", "fedprox", "fst-cbdg", "fedntd"]
HEAVY_METHODS = ["creff", "clip2fl"]
LRS = [0.002, 0.003, 0.005, 0.007, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05]


class Stop(Exception):
    """Raised from ``on_round`` to end a cell after the round in which it passed its cap."""


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {msg}", flush=True)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev: torch.device):
    """(``fn()``, wall seconds), CUDA synchronised before and after."""
    sync(dev)
    t = time.perf_counter()
    out = fn()
    sync(dev)
    return out, time.perf_counter() - t


def mem_reset(dev: torch.device) -> None:
    if dev.type == "cuda":
        sync(dev)
        torch.cuda.reset_peak_memory_stats(dev)


def mem_peak(dev: torch.device) -> float | None:
    """Peak GPU MiB allocated since ``mem_reset`` (None on a CPU)."""
    return torch.cuda.max_memory_allocated(dev) / 2**20 if dev.type == "cuda" else None


def mem_now(dev: torch.device) -> float | None:
    """GPU MiB allocated now (None on a CPU)."""
    return torch.cuda.memory_allocated(dev) / 2**20 if dev.type == "cuda" else None


def mib(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def wdiff(a: dict | None, b: dict | None) -> float | None:
    """Largest absolute difference between two weight dicts (their common tensors); None if one is missing."""
    if a is None or b is None:
        return None
    d = 0.0
    for k in a.keys() & b.keys():
        if torch.is_tensor(a[k]) and torch.is_tensor(b[k]) and a[k].shape == b[k].shape:
            d = max(d, float((a[k].double() - b[k].double()).abs().max()))
    return d


def sci(v: float | None) -> str:
    return "-" if v is None else f"{v:.1e}"


def shown(method: str, sets: dict) -> str:
    return method + (f" ({', '.join(f'{k}={v}' for k, v in sets.items())})" if sets else "")


class Budget:
    def __init__(self, seconds: float):
        self.seconds, self.skipped = seconds, []

    def ok(self, what: str) -> bool:
        if time.perf_counter() - T0 < self.seconds:
            return True
        self.skipped.append(what)
        log(f"budget spent: skipped {what}")
        return False


def machine(dev: torch.device) -> str:
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        what = f"GPU {torch.cuda.get_device_name(dev)} ({p.total_memory / 2**30:.0f} GiB), CUDA {torch.version.cuda}"
    else:
        what = "no GPU (CPU run)"
    return (
        f"{what}, {os.cpu_count()} CPU cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"Python {platform.python_version()}"
    )


def env_check(dev: torch.device) -> str:
    """open_clip imported through fedfeat's torchvision remedy (first import of torchvision in this process), then
    torchvision's compiled ``nms`` run on the device: where torchvision works the remedy must leave it alone
    (``native``) and ``nms`` must run; ``stub`` means torchvision's compiled ops do not load with this torch."""
    parts = []
    try:
        from fedfeat.encoders.remedy import apply_torchvision_remedy, import_open_clip

        parts.append(f"torchvision remedy `{apply_torchvision_remedy()}`")
        oc = import_open_clip()
        import torchvision

        parts.append(f"open_clip {oc.__version__}, torchvision {torchvision.__version__} imported")
    except Exception as e:  # reported, not fatal: training does not import open_clip
        return ", ".join([*parts, f"open_clip import FAILED: {type(e).__name__}: {str(e)[:150]}"])
    try:
        boxes = torch.tensor([[0.0, 0, 10, 10], [1, 1, 11, 11], [50, 50, 60, 60]], device=dev)
        keep = torchvision.ops.nms(boxes, torch.tensor([0.9, 0.8, 0.7], device=dev), 0.5).tolist()
        parts.append(f"`torchvision.ops.nms` on {dev.type}: {'ok' if keep == [0, 2] else f'WRONG {keep}'}")
    except Exception as e:
        parts.append(
            f"`torchvision.ops.nms` on {dev.type}: unavailable ({type(e).__name__}: {str(e)[:60]}...)"
        )
    return ", ".join(parts)


def env_in_subprocess(device: str) -> str:
    """``env_check`` in a fresh process: torchvision not yet imported there, and a crash cannot end the bench."""
    try:
        p = subprocess.run([sys.executable, __file__, "--env-check", "--device", device], capture_output=True,
                           text=True, timeout=240)  # fmt: skip
    except subprocess.TimeoutExpired:
        return "open_clip / torchvision check timed out (240 s)"
    lines = p.stdout.strip().splitlines()
    if p.returncode or not lines:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
        return f"open_clip / torchvision check FAILED (exit {p.returncode}: {tail[:150]})"
    return lines[-1]


def stores(args) -> dict:
    from fedfeat.store.synth import SynthParams, write_synthetic_store

    cache = ROOT / "cache"
    if args.quick:
        specs = {
            "c10": (cache / "synth-gpu-quick.zarr", SynthParams(dim=128, train_per_class=100, test_per_class=50, templates=2)),
            "c100": (cache / "synth-gpu-quick100.zarr", SynthParams(classes=100, dim=128, train_per_class=10, test_per_class=5, templates=2, s=0.1)),
        }  # fmt: skip
    else:
        specs = {
            "c10": (Path(args.store), SynthParams()),
            "c100": (cache / "synth-cifar100.zarr", SynthParams(classes=100, train_per_class=500, test_per_class=100, s=0.1)),
        }  # fmt: skip
    out = {}
    for k, (path, p) in specs.items():
        t = time.perf_counter()
        # kept as is when complete with these parameters; the quick stores are this bench's own (replaced if they differ)
        write_synthetic_store(path, p, stats=False, log=lambda *a: None, force=args.quick)
        out[k] = (path, p)
        log(
            f"store {path} ({p.classes} classes x {p.train_per_class} train, D {p.dim}): {time.perf_counter() - t:.1f} s"
        )
    return out


def load(path, scheme: str, dev: torch.device, clients: int, **kw):
    from fedfeat.engine.data import load_run_data
    from fedfeat.partition.stored import store_partition
    from fedfeat.store.featurestore import FeatureStore

    st = FeatureStore.open(path)
    _, part = store_partition(st, scheme=scheme, clients=clients, save=False, **kw)
    data = load_run_data(st, part, device=dev)
    sync(dev)
    return data


def run_one(method, sets, data, *, rounds, part, seed, engine, dev, kernel, on_round=None):
    from fedfeat.engine.rounds import run_federated
    from fedfeat.methods import get_method

    return run_federated(
        get_method(method, sets), data, rounds=rounds, participation=part, seed=seed, engine=engine, device=dev,
        kernel=kernel, on_round=on_round,
    )  # fmt: skip


def cell(method, sets, data, *, part, engine, rounds, dev, kernel, cap) -> dict:
    """One (method, participation, engine): ``rounds`` rounds (the first a warm-up), stopped after the round in
    which the cell passed ``cap`` seconds. Accuracy by round, the final weights if it ran to the end."""
    rows: list[dict] = []
    t0 = time.perf_counter()

    def on_round(row):
        rows.append(row)
        if 1 <= row["round"] < rounds and time.perf_counter() - t0 > cap:
            raise Stop

    mem_reset(dev)
    w = None
    try:
        w, _ = run_one(method, sets, data, rounds=rounds, part=part, seed=0, engine=engine, dev=dev, kernel=kernel,
                       on_round=on_round)  # fmt: skip
    except Stop:
        pass
    sync(dev)
    timed_rows = rows[2:] or rows[1:]  # after the warm-up round; the warm-up itself if nothing else ran
    secs = [r["train_seconds"] for r in timed_rows]
    return {
        "sec": statistics.median(secs),
        "best": min(secs),
        "timed": len(rows) - 2,
        "acc": {r["round"]: r["test_acc"] for r in rows},
        "last": rows[-1]["round"],
        "w": w,
        "peak": mem_peak(dev),
        "wall": time.perf_counter() - t0,
        "sampled": len(rows[-1]["clients"]),
    }


def compare(b: dict, lo: dict) -> tuple[int, float, float, float | None]:
    """(round, batched acc, loop acc, max abs weight diff) at the last round both reached (weights: both ended)."""
    rnd = min(b["last"], lo["last"])
    dw = wdiff(b["w"], lo["w"]) if b["last"] == lo["last"] else None
    return rnd, b["acc"][rnd], lo["acc"][rnd], dw


def part_a(args, dev, data, methods, budget, tag="a") -> list[str]:
    rows = []
    for method in methods:
        sets = args.light if method in HEAVY_METHODS else {}
        for part in (0.1, 1.0):
            res = {}
            for engine in ("batched", "loop"):
                what = f"{tag} {method} {args.clients}x{part:g} {engine}"
                if not budget.ok(what):
                    continue
                try:
                    r = res[engine] = cell(method, sets, data, part=part, engine=engine, rounds=args.rounds + 1,
                                           dev=dev, kernel=args.kernel, cap=args.cell_cap)  # fmt: skip
                    log(f"{what}: {r['sec']:.4f} s/round (best {r['best']:.4f}, {r['timed']} timed), acc at round "
                        f"{r['last']} {r['acc'][r['last']]:.4f}, peak {mib(r['peak'])} MiB, cell {r['wall']:.1f} s")  # fmt: skip
                except Exception as e:
                    traceback.print_exc()
                    res[engine] = {"error": f"FAILED {type(e).__name__}: {str(e)[:100]}"}
                    log(f"{what}: {res[engine]['error']}")
            b, lo = res.get("batched"), res.get("loop")
            if b is None and lo is None:
                continue

            def sec(r):
                if r is None:
                    return "skipped"
                if "error" in r:
                    return r["error"]
                return f"{r['sec']:.4f} ({r['timed'] or 'warm-up only'})"

            ok = [r for r in (b, lo) if r is not None and "error" not in r]
            if len(ok) == 2:
                rnd, ab, al, dw = compare(b, lo)
                warm = " (warm-up)" if min(b["timed"], lo["timed"]) < 1 else ""
                ratio, accs = f"**{lo['sec'] / b['sec']:.1f}x**{warm}", f"{ab:.2f} / {al:.2f} (round {rnd})"
                dacc = sci(abs(ab - al) / 100)  # test_acc is in percent
            else:
                ratio = accs = dacc = dw = "-"  # fmt: skip
            rows.append(
                f"| {shown(method, sets)} | {args.clients} x {part * 100:g}% | {ok[0]['sampled'] if ok else '-'} | "
                f"{sec(b)} | {sec(lo)} | {ratio} | {accs} | {dacc} | {sci(dw) if dw != '-' else '-'} | "
                f"{mib(b.get('peak') if b else None)} / {mib(lo.get('peak') if lo else None)} |"
            )
    return rows


def stack_row(args, dev, data, method: str, label: str, runs: list, part: float) -> str:
    """One row of part b: ``runs`` (method, settings, seed) one by one and stacked, and the first alone."""
    from fedfeat.methods import get_method
    from fedfeat.runs.stack import run_stacked

    R = args.stack_rounds

    def one():
        m, s, sd = runs[0]
        return run_one(
            m, s, data, rounds=R, part=part, seed=sd, engine="batched", dev=dev, kernel=args.kernel
        )

    def ten():
        return [run_one(m, s, data, rounds=R, part=part, seed=sd, engine="batched", dev=dev, kernel=args.kernel)
                for m, s, sd in runs]  # fmt: skip

    def stacked():
        out = run_stacked([get_method(m, s) for m, s, _ in runs], data, seeds=[sd for *_, sd in runs], rounds=R,
                          participation=part, device=dev, kernel=args.kernel)  # fmt: skip
        bad = [o for o in out if isinstance(o, Exception)]
        if bad:
            raise bad[0]
        return out

    mem_reset(dev)
    _, t_one = timed(one, dev)  # warm-up
    peak_one = mem_peak(dev)
    mem_reset(dev)
    _, t_stack = timed(stacked, dev)
    peak_stack = mem_peak(dev)
    # a repeat is about 11 runs and a stack: as many repeats as fit the cap (at least one)
    repeats = max(1, min(args.repeats, int(args.cell_cap // ((len(runs) + 1) * t_one + t_stack))))
    res: dict[str, list[float]] = {"one": [], "ten": [], "stack": []}
    last = {}
    for _ in range(repeats):  # interleaved: a slow spell of the host hits all three
        for k, fn in (("one", one), ("ten", ten), ("stack", stacked)):
            last[k], dt = timed(fn, dev)
            res[k].append(dt)
    o, t, s = (statistics.median(res[k]) for k in ("one", "ten", "stack"))
    pairs = list(zip(last["ten"], last["stack"]))
    dacc = max(
        abs(a[1][-1]["test_acc"] - b[1][-1]["test_acc"]) / 100 for a, b in pairs
    )  # percent -> fraction
    dw = max(wdiff(a[0], b[0]) for a, b in pairs)
    log(f"b {method} ({label}, {part:g}): 1 run {o:.3f} s, {len(runs)} one by one {t:.3f} s, stacked {s:.3f} s "
        f"({t / s:.2f}x), {repeats} repeats, peak {mib(peak_one)} / {mib(peak_stack)} MiB, stacked vs alone "
        f"{dacc:.1e} / {dw:.1e}")  # fmt: skip
    return (
        f"| {method} | {label} | {part * 100:g}% | {R} | {repeats} | {o:.3f} | {t:.3f} | {s:.3f} | **{t / s:.2f}x** | "
        f"{s / o:.1f}x | {mib(peak_one)} / {mib(peak_stack)} | {dacc:.1e} / {dw:.1e} |"
    )


def part_b(args, dev, data, budget) -> list[str]:
    R = args.stack_runs
    seeds, lrs = list(range(R)), LRS[:: max(1, len(LRS) // R)][:R]
    sd = f"seed (0-{R - 1})"
    specs = [
        ("fedavg", sd, [("fedavg", {}, s) for s in seeds], 0.1),
        (
            "fedavg",
            f"lr ({lrs[0]:g}-{lrs[-1]:g}), seed 0",
            [("fedavg", {"lr": str(lr)}, 0) for lr in lrs],
            0.1,
        ),
        ("fedavg", sd, [("fedavg", {}, s) for s in seeds], 1.0),
        ("fed-focal", sd, [("fed-focal", {}, s) for s in seeds], 0.1),
        ("fst-cbdg", sd, [("fst-cbdg", {}, s) for s in seeds], 0.1),
    ]
    if args.quick:  # the CPU smoke check: every kind of row once
        specs = [sp for sp in specs if sp[3] < 1]
    rows = []
    for method, label, runs, part in specs:
        what = f"b {method} ({label}, {part:g})"
        if not budget.ok(what):
            continue
        try:
            rows.append(stack_row(args, dev, data, method, label, runs, part))
        except Exception as e:
            traceback.print_exc()
            rows.append(f"| {method} | {label} | {part * 100:g}% | {args.stack_rounds} | FAILED: "
                        f"{type(e).__name__}: {str(e)[:100]} | | | | | | | |")  # fmt: skip
            log(f"{what}: FAILED {e}")
    return rows


def part_c(args, dev, data, budget) -> list[str]:
    rows = []
    for method in ("fedavg", "fst-cbdg", "fedntd"):
        what = f"c {method}"
        if not budget.ok(what):
            continue
        try:
            res = {
                engine: cell(
                    method,
                    {},
                    data,
                    part=0.1,
                    engine=engine,
                    rounds=args.check_rounds,
                    dev=dev,
                    kernel=args.kernel,
                    cap=args.cell_cap,
                )  # fmt: skip
                for engine in ("batched", "loop")
            }
            rnd, ab, al, dw = compare(res["batched"], res["loop"])
            d = abs(ab - al) / 100  # test_acc is in percent; the check is on the fraction of the test set
            rows.append(f"| {method} | {rnd} | {ab:.4f} | {al:.4f} | {d:.1e} | {sci(dw)} | "
                        f"{'yes' if d <= 1e-4 else '**no**'} |")  # fmt: skip
            log(
                f"{what}: round {rnd}: batched acc {ab:.4f} %, loop acc {al:.4f} %, |d| {d:.1e}, max |dW| {sci(dw)}"
            )
        except Exception as e:
            traceback.print_exc()
            rows.append(f"| {method} | FAILED: {type(e).__name__}: {str(e)[:100]} | | | | | |")
            log(f"{what}: FAILED {e}")
    return rows


# (setting, full run, --quick): each flag left unset takes one of these
DEFAULTS = [
    ("clients", 100, 20),
    ("rounds", 3, 1),
    ("stack_runs", 10, 3),
    ("stack_rounds", 10, 2),
    ("check_rounds", 10, 3),
    ("repeats", 3, 1),
    ("cell_cap", 25, 8),
    ("budget", 270, 100),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = ap.add_argument
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    add(
        "--quick",
        action="store_true",
        help="small stores, 20 clients, 3 runs stacked, 1 timed round (CPU check)",
    )
    add("--out", default=str(ROOT / "bench" / "results" / "gpu.md"))
    add("--store", default=str(ROOT / "cache" / "synth-cifar10.zarr"), help="the CIFAR-10-shaped store")
    add("--kernel", default="torch", help="torch (the GPU program; default) or auto")
    add("--clients", type=int, help="clients of every partition")
    add("--rounds", type=int, help="timed rounds a cell of part a, after a warm-up round")
    add("--stack-runs", type=int, help="runs stacked in part b")
    add("--stack-rounds", type=int, help="rounds of each run in part b")
    add("--check-rounds", type=int, help="rounds of part c")
    add("--repeats", type=int, help="interleaved repeats of part b")
    add("--cell-cap", type=float, help="seconds after which a cell stops at the end of its round")
    add("--budget", type=float, help="seconds from the start; then the cells left are skipped")
    add("--env-check", action="store_true", help=argparse.SUPPRESS)
    ap.epilog = "defaults (full run / --quick): " + ", ".join(
        f"--{k.replace('_', '-')} {f:g} / {q:g}" for k, f, q in DEFAULTS
    )
    args = ap.parse_args()
    q = args.quick
    for k, full, quick in DEFAULTS:
        if getattr(args, k) is None:
            setattr(args, k, quick if q else full)
    args.light = LIGHT_QUICK if q else LIGHT
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    if args.env_check:
        print(env_check(dev), flush=True)
        return
    if (
        q and dev.type == "cpu"
    ):  # tiny ops on a shared CPU: a second thread only waits (bench_sweep.py: 10x slower)
        torch.set_num_threads(1)
    budget = Budget(args.budget)
    out = Path(args.out)
    cmd = "python " + " ".join(["bench/bench_gpu.py", *sys.argv[1:]])
    log(machine(dev))
    env = env_in_subprocess(args.device)
    log(env)
    st = stores(args)
    N = args.clients
    head = [
        f"## GPU: batched vs loop engine, stacked runs, agreement, peak memory ({dev.type}{', quick' if q else ''})",
        "",
        f"Machine: {machine(dev)}. Environment: {env}.",
        "",
        f"Command: `{cmd}` (on the GPU machine: `make bench-gpu PY=python3`, after `bash scripts/device_wheels.sh` "
        f"here). Program: `--kernel {args.kernel}` (the batched torch program, what a GPU runs). Seconds are "
        "wall-clock, `torch.cuda.synchronize` before each reading of the clock. What each part runs: "
        "`bench/bench_gpu.py`'s docstring.",
        "",
    ]
    a_cols = [
        "| method | clients x participation | sampled | batched s/round (timed rounds) | loop s/round (timed rounds) | "
        "loop / batched | test acc % batched / loop | abs diff acc (fraction) | max abs diff W | peak GPU MiB batched / "
        "loop |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    sec: dict[str, list[str]] = {"a": [], "a-heavy": [], "b": [], "c": [], "a100": []}
    heads: dict[str, list[str]] = {}

    def write(final: bool = False) -> None:
        lines = list(head)
        for k in ("a", "b", "c", "a100"):
            if k in heads:
                lines += heads[k] + sec[k] + (sec["a-heavy"] if k == "a" else []) + [""]
        lines.append(f"Wall time of the bench: {time.perf_counter() - T0:.0f} s{'' if final else ' so far (it did not finish)'}.")  # fmt: skip
        if budget.skipped:
            lines.append(
                f"Skipped once the --budget of {args.budget:g} s was spent: {', '.join(budget.skipped)}."
            )
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(lines) + "\n")

    path, p = st["c10"]
    data = load(path, "iid", dev, N)
    heads["a"] = [
        f"### a. Seconds per round, batched vs loop engine ({p.classes} classes, {p.classes * p.train_per_class:,} x "
        f"{p.dim}, iid, {N} clients)",
        "",
        f"Median `train_seconds` of the timed rounds after a warm-up round (at most {args.rounds}; a cell stops after "
        f"the round that passed {args.cell_cap:g} s: `warm-up only` = the figure is the warm-up round, which the "
        "batched cell before it already warmed for the loop), seed 0; test accuracy at the last round both engines "
        "reached, weights compared where both ran every round. "
        f"CReFF / CLIP2FL: server step lighter ({args.light}). Data on the device before the cells: "
        f"{mib(mem_now(dev))} MiB (in every peak).",
        "",
        *a_cols,
    ]
    log("part a")
    sec["a"] = part_a(args, dev, data, LIGHT_METHODS, budget)
    write()
    del data

    data = load(path, "dirichlet", dev, N, alpha=0.1, seed=0)
    heads["b"] = [
        f"### b. {args.stack_runs} runs stacked vs one by one ({p.classes} classes, Dirichlet alpha 0.1, {N} clients)",
        "",
        "Whole programs (data loaded once), seconds, median of the repeats (interleaved, after a warm-up). "
        "`diff stacked vs alone`: the largest abs difference of final test accuracy (fraction) / weights between each "
        "stacked "
        f"run and the same run made alone. Data on the device: {mib(mem_now(dev))} MiB.",
        "",
        f"| method | runs differ in | participation | rounds | repeats | 1 run | {args.stack_runs} one by one | {args.stack_runs} stacked | "
        "one by one / stacked | stacked / 1 run | peak GPU MiB 1 run / stacked | diff stacked vs alone (acc / W) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    log("part b")
    sec["b"] = part_b(args, dev, data, budget)
    write()

    heads["c"] = [
        f"### c. Agreement: batched vs loop engine ({p.classes} classes, Dirichlet alpha 0.1, {N} clients x 10 %, "
        f"{args.check_rounds} rounds, seed 0)",
        "",
        "| method | round compared | test acc % batched | test acc % loop | abs diff (fraction) | max abs diff W | "
        "within 1e-4 |",
        "|---|---|---|---|---|---|---|",
    ]
    log("part c")
    sec["c"] = part_c(args, dev, data, budget)
    write()
    del data

    data = load(path, "iid", dev, N)
    log("part a, CReFF and CLIP2FL")
    sec["a-heavy"] = part_a(args, dev, data, HEAVY_METHODS, budget)
    write()
    del data

    path, p = st["c100"]
    data = load(path, "iid", dev, N)
    heads["a100"] = [
        f"### a (100 classes). Seconds per round, batched vs loop ({p.classes} classes, "
        f"{p.classes * p.train_per_class:,} x {p.dim}, iid, {N} clients)",
        "",
        f"As part a; K = 100 outputs make the per-client GEMMs less thin. Data on the device: {mib(mem_now(dev))} MiB.",
        "",
        *a_cols,
    ]
    log("part a, 100 classes")
    sec["a100"] = part_a(args, dev, data, ["fedavg", "fst-cbdg"], budget, tag="a100")
    write(final=True)
    log(f"wrote {out}")
    print(out.read_text(), flush=True)


if __name__ == "__main__":
    main()
