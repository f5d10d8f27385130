"""GPU benchmark: the batched torch engine against the loop engine, stacked runs against one by one, the engines'
agreement and peak GPU memory, encoding images/s, the prompt methods' local step and rounds, on one device, in one
process (``make bench-gpu`` on a GPU machine).

    PYTHONPATH=. python3 bench/bench_gpu.py --out bench/results/gpu.md                 # ~7-8 min on one H100
    PYTHONPATH=. python bench/bench_gpu.py --device cpu --quick --out /tmp/gpu_cpu.md   # the CPU smoke check (~20 s)
    PYTHONPATH=. python3 bench/bench_gpu.py --parts ef --out /tmp/gpu_ef.md            # only parts e and f

Device-agnostic (``--device cuda|cpu``, default cuda when torch sees one). The program is the torch one on every
device (``--kernel torch``: what ``--kernel auto`` picks on a GPU; the fused kernels are CPU-only), so a CPU run
checks the very code a GPU runs. Stores (built if missing, ~2 s each): the synthetic CIFAR-10 shape (50,000 x 1024,
10 classes) and a CIFAR-100 shape (50,000 x 1024, 100 classes, ``s = 0.1`` as the 102-class preset). ``--quick``:
small stores (1,000 x 128), 20 clients, 3 runs stacked, one timed round a cell, a lighter CReFF / CLIP2FL, a
shorter budget, one torch thread on a CPU, the live stand-in's tiny CLIP (``fedfeat.runs.standin``: a ViT of width
64, 2 layers, 32 px) in parts e and f. Nothing downloads (``HF_HUB_OFFLINE=1``): every CLIP here has random weights.

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
* e. Encode images/s of RN50, ViT-B-32 and ViT-L-14, each with random weights (seed 0) saved as safetensors and
  loaded back through fedfeat's path (``resolve_backbone``, ``resolve_weights``, ``load_model``), per precision
  (fp32, and bf16 with the weights cast as ``encode --precision bf16`` does; fp32 only on a CPU): (i) the forward
  alone, ``ClipModel.encode_images`` on a pre-made input batch on the device; (ii) the PIL feed, ``fedfeat
  encode``'s DataLoader (``_Rows``, its collate, its worker count: up to 8 on a GPU) with the model's open_clip eval
  transform, on PIL images made from CIFAR-sized 32 x 32 uint8 arrays and from ~500 x 375 JPEG bytes decoded in
  the workers; (iii) the device feed, the workers decoding to uint8 only and ``device_feed_batch`` resizing and
  normalising on the device (``fedfeat.encoders.feed``; the cells read ``device feed: not available in this
  checkout`` where it is absent). Peak GPU memory of the forward.
* f. Prompt methods. PromptFL's local step on the text side (the class text features from the CoOp contexts,
  n_ctx = 16, one client; CLIP-scale logits of 32 image features, CE, the gradient to the contexts) through
  ViT-B-32's random-init text tower at K = 100 and 1,000 classes, ``PromptLearner(shared_prefix=...)`` off and on,
  fp32 and fp16 (promptfl's ``precision=auto`` on a GPU): ms per step and the step's peak GPU memory. Then
  promptfl and fedcopl seconds per round through the engine (``run_federated``) on a live stand-in store
  (``fedfeat.runs.standin.live_standin``: synthetic 32-px images encoded with ``--pixels`` by the tiny random ViT
  through the real ``encode``; built once under ``cache/bench-gpu``, 100 classes x 30 images, 10 clients).
* g. A stacked sweep: part b (``run_stacked`` is the sweep's default path); no separate part.
* h. Differential privacy (issue 41): fedavg s/round on the Dirichlet setting without DP, with client-level
  DP-FedAvg and with sample-level DP-SGD, the torch program, the counter-based noise drawn on the device
  (``fedfeat.engine.privacy.gaussian``'s torch path); the ratio to no DP.

The header records the device, its NVIDIA driver (``nvidia-smi``), CUDA and torch versions. ``--parts`` picks the
parts (letters; default ``abcef``). ``--budget`` (seconds from the start): the cells left once it is spent are
skipped, and named. Parts run in the order a (light methods), b, c, e, f, a (CReFF, CLIP2FL), a (100 classes), and
the results file is rewritten after each, so a run that is killed still leaves what it measured.
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


def gpu_driver() -> str:
    """The NVIDIA driver's version (``nvidia-smi --query-gpu=driver_version``; NVML's where nvidia-smi is absent),
    and the CUDA version that driver supports (``cudaDriverGetVersion`` through torch)."""
    ver = None
    try:
        p = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=30)  # fmt: skip
        lines = p.stdout.strip().splitlines()
        ver = lines[0].strip() if p.returncode == 0 and lines else None
    except (OSError, subprocess.TimeoutExpired):
        pass
    if ver is None:
        try:
            import pynvml

            pynvml.nvmlInit()
            ver = pynvml.nvmlSystemGetDriverVersion()
            ver = ver.decode() if isinstance(ver, bytes) else str(ver)
        except Exception:
            ver = "unknown (no nvidia-smi, no NVML)"
    try:
        api = int(torch._C._cuda_getDriverVersion())  # e.g. 13000
        ver += f" (supports CUDA {api // 1000}.{api % 1000 // 10})"
    except Exception:
        pass
    return ver


def machine(dev: torch.device) -> str:
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        what = (
            f"GPU {torch.cuda.get_device_name(dev)} ({p.total_memory / 2**30:.0f} GiB), driver {gpu_driver()}, "
            f"CUDA {torch.version.cuda} (torch's runtime)"
        )
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


def run_one(method, sets, data, *, rounds, part, seed, engine, dev, kernel, on_round=None, dp=None):
    from fedfeat.engine.rounds import run_federated
    from fedfeat.methods import get_method

    return run_federated(
        get_method(method, sets), data, rounds=rounds, participation=part, seed=seed, engine=engine, device=dev,
        kernel=kernel, on_round=on_round, dp=dp,
    )  # fmt: skip


def part_h(args, dev, data, budget) -> list[str]:
    """h. Differential privacy's cost on the device: fedavg s/round without DP, with client-level DP-FedAvg and
    with sample-level DP-SGD (the torch program; ``fedfeat.engine.privacy``, its noise drawn on the device)."""
    from fedfeat.engine.privacy import DPConfig

    rows = []
    for part in (0.1, 1.0):
        base = None
        for label, dp in (("none", None), ("client", DPConfig("client", 1.0, 0.1)),
                          ("sample", DPConfig("sample", 1.0, 1.0))):  # fmt: skip
            if not budget.ok(f"h fedavg {label} {part:.0%}"):
                continue
            c = cell("fedavg", {}, data, part=part, engine="batched", rounds=args.rounds, dev=dev, kernel="torch",
                     cap=args.cell_cap, dp=dp)  # fmt: skip
            base = c["sec"] if dp is None else base
            ratio = "-" if dp is None or base is None else f"**{c['sec'] / base:.2f}x**"
            rows.append(f"| fedavg | {part:.0%} | {label} | {c['sec']:.4f} ({c['timed']}) | {ratio} | "
                        f"{c['acc'][c['last']]:.2f} | {mib(c['peak'])} |")  # fmt: skip
    return rows


def cell(method, sets, data, *, part, engine, rounds, dev, kernel, cap, dp=None) -> dict:
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
                       on_round=on_round, dp=dp)  # fmt: skip
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


# ---------------------------------------------------------------------------------------- e. encode images/s
ENC_MODELS = ["RN50", "ViT-B-32", "ViT-L-14"]
QUICK_MODEL = (
    ROOT / "cache" / "bench-gpu" / "standin"
)  # --quick: the live stand-in's tiny ViT, config + weights
FEED_MODULE = "fedfeat.encoders.feed"
FEED_NA = "device feed: not available in this checkout"
# the batch-preprocess names looked for in FEED_MODULE (device_feed_batch below is the one place to wire it up)
FEED_NAMES = ("preprocess_batch", "batch_preprocess", "device_preprocess", "preprocess")


class FeedUnavailable(Exception):
    """``device_feed_batch`` has nothing to call in this checkout."""


def _feed_fn():
    """The batch-preprocess function of ``fedfeat.encoders.feed`` where the module exists (``find_spec``) and
    exposes one of ``FEED_NAMES``; raises ``FeedUnavailable`` otherwise."""
    import importlib
    import importlib.util

    try:
        spec = importlib.util.find_spec(FEED_MODULE)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise FeedUnavailable(FEED_NA)
    mod = importlib.import_module(FEED_MODULE)
    for name in FEED_NAMES:
        fn = getattr(mod, name, None)
        if callable(fn):
            return fn
    raise FeedUnavailable(f"{FEED_NA} ({FEED_MODULE} has none of {', '.join(FEED_NAMES)})")


# ======================================================================================== WIRE UP HERE
def device_feed_batch(images_uint8: torch.Tensor, preprocess_cfg: dict, dev: torch.device) -> torch.Tensor:
    """The device feed of part e: ``images_uint8  # [B, 3, H, W]`` uint8 (decoded in the DataLoader workers, not
    resized; pinned on a GPU run) -> the model input ``[B, 3, S, S]`` on ``dev`` (resize, centre crop and
    normalise by ``preprocess_cfg``, ``ClipModel.preprocess``: size, mean, std, interpolation, resize_mode), what
    ``ClipModel.encode_images`` takes. Raises ``FeedUnavailable`` where ``fedfeat.encoders.feed`` is absent (the
    cells then read ``device feed: not available in this checkout``). The call below guesses the signature:
    adapt it to feed.py's API."""
    fn = _feed_fn()
    return fn(images_uint8.to(dev, non_blocking=True), preprocess_cfg, dev)


# ========================================================================================


def feed_status() -> str | None:
    """None where the device feed can run, else the line its cells show."""
    try:
        _feed_fn()
    except FeedUnavailable as e:
        return str(e)
    except Exception as e:  # feed.py half-written: an import error is a cell, not a crash
        return f"device feed: import failed ({type(e).__name__}: {str(e)[:80]})"
    return None


class MemImages:
    """An ``ImageDataset`` stand-in for ``fedfeat.runs.encode._Rows``: ``load_image(split, i)`` -> a PIL image,
    from ``[n, H, W, 3]`` uint8 arrays (CIFAR's pickles hold such rows) or from JPEG bytes, cycled."""

    def __init__(self, arrays=None, jpegs=None):
        self.arrays, self.jpegs = arrays, jpegs

    def load_image(self, split: str, i: int):
        from PIL import Image

        if self.arrays is not None:
            return Image.fromarray(self.arrays[i % len(self.arrays)])
        import io

        return Image.open(io.BytesIO(self.jpegs[i % len(self.jpegs)])).convert("RGB")


def _identity(img):
    return img


def feed_sources(quick: bool) -> dict:
    """The two image sources of part e: CIFAR-sized 32 x 32 uint8 arrays, and ~500 x 375 JPEG bytes (smooth
    random pictures at quality 90, ~40-70 KB each: decoding them is the real work), seeded."""
    import io

    import numpy as np
    from PIL import Image

    rs = np.random.RandomState(0)
    small = rs.randint(0, 256, size=(256 if not quick else 32, 32, 32, 3), dtype=np.uint8)
    jpegs = []
    for _ in range(64 if not quick else 8):
        base = rs.uniform(0, 255, size=(12, 16, 3)).astype(
            np.uint8
        )  # blocky colours, then noise: a photo's detail
        img = np.asarray(Image.fromarray(base).resize((500, 375), Image.BICUBIC), dtype=np.float32)
        img = np.clip(img + rs.normal(0, 12, img.shape), 0, 255).astype(np.uint8)
        b = io.BytesIO()
        Image.fromarray(img).save(b, format="JPEG", quality=90)
        jpegs.append(b.getvalue())
    return {
        "32x32 arrays": (MemImages(arrays=small), (32, 32)),
        "500x375 JPEG": (MemImages(jpegs=jpegs), (375, 500)),
    }


def random_checkpoint(spec: str, folder: Path, quick: bool) -> tuple[str, Path, float]:
    """(``--backbone``, ``--pretrained`` file, seconds): ``spec``'s architecture with random weights (seed 0) saved
    as safetensors; at ``--quick`` the live stand-in's tiny ViT (``fedfeat.runs.standin``, config + weights)."""
    import logging

    from safetensors.torch import save_file

    from fedfeat.encoders.backbones import resolve_backbone
    from fedfeat.encoders.openclip import import_open_clip

    t = time.perf_counter()
    if quick:
        from fedfeat.runs.standin import standin_model

        cfg, w = standin_model(QUICK_MODEL)  # written once (seed 0), kept under cache/
        return str(cfg), w, time.perf_counter() - t
    oc = import_open_clip()
    bb = resolve_backbone(spec)
    quiet = logging.getLogger().level
    logging.getLogger().setLevel(
        logging.ERROR
    )  # open_clip's "no pretrained weights": random ones are the point
    try:
        torch.manual_seed(0)
        model = oc.create_model(bb.name)
    finally:
        logging.getLogger().setLevel(quiet)
    w = folder / f"{bb.name}-random.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(w))
    del model
    return spec, w, time.perf_counter() - t


def feed_loader(ds, n: int, batch: int, transform, size, dtype, workers: int, dev):
    """``fedfeat encode``'s loader (``fedfeat.runs.encode``: ``_Rows``, its collate, a batch sampler of keys,
    pinned memory on a GPU) over ``n`` images of ``ds``."""
    from functools import partial

    from fedfeat.runs.encode import _collate, _Rows

    keys = [("train", i) for i in range(n)]
    return torch.utils.data.DataLoader(
        _Rows(ds, transform), batch_sampler=[keys[s : s + batch] for s in range(0, n, batch)],
        num_workers=workers, collate_fn=partial(_collate, size=size, dtype=dtype), pin_memory=dev.type == "cuda",
    )  # fmt: skip


def feed_rate(clip, loader, dev, prep=None) -> float:
    """Images/s of a whole pass of ``loader`` into ``clip.encode_images`` (the workers' start included, as in
    ``encode``), after ``prep`` (the device feed) where given."""
    n = 0
    sync(dev)
    t = time.perf_counter()
    for images, _ in loader:
        if prep is not None:
            images = prep(images)
        n += len(clip.encode_images(images))  # its .cpu() waits for the device
    return n / (time.perf_counter() - t)


def forward_rate(clip, B: int, reps: int, dev) -> tuple[float, float | None]:
    """(images/s, peak MiB) of ``clip.encode_images`` on a pre-made ``[B, 3, S, S]`` batch on the device, ``reps``
    batches after 2 warm-up batches (cuDNN's algorithm search, the allocator)."""
    x = torch.randn(B, 3, *clip.input_size, device=dev)
    mem_reset(dev)
    for _ in range(2):
        clip.encode_images(x)
    _, dt = timed(lambda: [clip.encode_images(x) for _ in range(reps)], dev)
    return reps * B / dt, mem_peak(dev)


def encode_row(args, dev, spec: str, folder: Path, sources: dict) -> str:
    """One row of part e: load ``spec`` (random weights from a file) per precision through fedfeat's loading path
    (``resolve_backbone``, ``resolve_weights``, ``load_model``); the forward alone on pre-made input tensors; the
    PIL feed of each source; the device feed of each source."""
    from fedfeat.encoders.backbones import resolve_backbone
    from fedfeat.encoders.openclip import load_model
    from fedfeat.encoders.weights import resolve_weights
    from fedfeat.runs.encode import _Pixels

    B, q = args.enc_batch, args.quick
    backbone, wfile, t_save = random_checkpoint(spec, folder, q)
    bb = resolve_backbone(backbone)
    t = time.perf_counter()
    w = resolve_weights(bb, str(wfile))  # a file: sha256, what encode fingerprints
    t_resolve = time.perf_counter() - t
    # the feeds run the last: bf16 on a GPU (weights cast, as `encode --precision bf16`), fp32 on a CPU
    precisions = ["fp32", "bf16"] if dev.type == "cuda" else ["fp32"]
    fwd, peak, loads, clip = {}, {}, {}, None
    for prec in precisions:
        clip = None  # the model of the precision before freed before the next loads
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        t = time.perf_counter()
        clip = load_model(bb, w, device=dev, precision=prec)
        sync(dev)
        loads[prec] = time.perf_counter() - t
        fwd[prec], peak[prec] = forward_rate(clip, B, args.enc_forward, dev)
        log(
            f"e {bb.name} {prec}: load {loads[prec]:.1f} s, forward {fwd[prec]:,.0f} img/s, peak {mib(peak[prec])} MiB"
        )
    pil, devfeed = {}, {}
    na = feed_status()
    for name, (ds, size) in sources.items():
        n = args.enc_images
        try:
            r = feed_rate(clip, feed_loader(ds, n, B, clip.transform, clip.input_size, torch.float32, args.enc_workers, dev), dev)  # fmt: skip
            pil[name] = f"{r:,.0f}"
        except Exception as e:
            traceback.print_exc()
            pil[name] = f"FAILED {type(e).__name__}: {str(e)[:80]}"
        if na is not None:
            devfeed[name] = FEED_NA
        else:
            try:
                raw = feed_loader(ds, n, B, _Pixels(_identity), size, torch.uint8, args.enc_workers, dev)
                r = feed_rate(clip, raw, dev, prep=lambda im: device_feed_batch(im, clip.preprocess, dev))
                devfeed[name] = f"{r:,.0f}"
            except Exception as e:
                traceback.print_exc()
                devfeed[name] = f"FAILED {type(e).__name__}: {str(e)[:80]}"
        log(
            f"e {bb.name} {name}: PIL feed {pil[name]} img/s, {na or 'device feed ' + devfeed[name] + ' img/s'}"
        )
    size = "x".join(str(s) for s in clip.input_size)
    clip = None
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    fw = " | ".join(f"{fwd[p]:,.0f}" if p in fwd else "-" for p in ("fp32", "bf16"))
    names = list(sources)
    return (
        f"| {bb.name} | {size} | {t_save + t_resolve:.1f} / {' / '.join(f'{loads[p]:.1f}' for p in precisions)} | "
        f"{fw} | {' | '.join(pil[k] for k in names)} | {' | '.join(devfeed[k] for k in names)} | "
        f"{' / '.join(mib(peak[p]) for p in precisions)} |"
    )


def part_e(args, dev, budget) -> list[str]:
    import tempfile

    rows = []
    sources = feed_sources(args.quick)
    models = ["tiny ViT (fedfeat.runs.standin)"] if args.quick else ENC_MODELS
    with tempfile.TemporaryDirectory(prefix="bench-gpu-e-") as tmp:
        for spec in models:
            what = f"e {spec}"
            if not budget.ok(what):
                continue
            try:
                rows.append(encode_row(args, dev, spec, Path(tmp), sources))
            except Exception as e:
                traceback.print_exc()
                rows.append(f"| {spec} | FAILED: {type(e).__name__}: {str(e)[:100]} | | | | | | | | |")
                log(f"{what}: FAILED {e}")
    return rows


# ---------------------------------------------------------------------------------------- f. prompt methods
def text_model(args, dev):
    """(model, tokenizer, name) whose text tower part f's step runs: open_clip's ViT-B-32 with random weights (seed
    0; the image tower dropped), or at ``--quick`` the live stand-in's tiny config (text width 64, 2 layers)."""
    import logging

    from fedfeat.encoders.openclip import import_open_clip

    oc = import_open_clip()
    name = "ViT-B-32"
    if args.quick:
        from fedfeat.runs.standin import STANDIN_NAME, standin_model

        cfg, _ = standin_model(QUICK_MODEL)
        oc.add_model_config(cfg)
        name = STANDIN_NAME
    quiet = logging.getLogger().level
    logging.getLogger().setLevel(logging.ERROR)
    try:
        torch.manual_seed(0)
        model = oc.create_model(name)
    finally:
        logging.getLogger().setLevel(quiet)
    model.visual = None  # the text tower only: its step never touches the image tower
    model = model.to(dev).eval().requires_grad_(False)
    return model, oc.get_tokenizer(name), name


def prompt_step(model, tok, K: int, shared: bool, dtype, dev, steps: int) -> dict:
    """PromptFL's local step on the text side, one client: the class text features from the CoOp contexts (n_ctx =
    16; ``PromptLearner(shared_prefix=...)``), CLIP-scale logits of a batch of 32 unit image features, CE, the
    gradient to the contexts (``autograd.grad``, as the engine). Median seconds of ``steps`` after one warm-up step,
    the peak device MiB above what was allocated before (weights and prompts excluded)."""
    import torch.nn.functional as F

    from fedfeat.encoders.prompt import PromptLearner, TextTower

    tower = TextTower.of(model, tok)
    if dtype != torch.float32:
        tower = tower.cast(dtype)  # promptfl's precision=auto on a GPU (fp16, as OpenAI's CLIP)
    pl = PromptLearner(tower, [f"class {k}" for k in range(K)], 16, shared_prefix=shared)
    g = torch.Generator().manual_seed(0)
    ctx = pl.init_context(g).unsqueeze(0).requires_grad_(True)  # [1, 16, W]
    D = int(tower.text_projection.shape[1]) if torch.is_tensor(tower.text_projection) else tower.width
    x = F.normalize(torch.randn(1, 32, D, generator=g), dim=-1).to(dev, dtype)  # [1, 32, D]
    y = torch.randint(0, K, (32,), generator=g).to(dev)

    def step():
        t = F.normalize(pl.features(ctx), dim=-1)  # [1, K, D]
        logits = 100.0 * torch.bmm(x, t.transpose(1, 2))  # [1, 32, K]
        loss = F.cross_entropy(logits[0].float(), y)
        (grad,) = torch.autograd.grad(loss, ctx)
        return grad

    sync(dev)
    base = mem_now(dev)
    mem_reset(dev)
    step()
    times = [timed(step, dev)[1] for _ in range(steps)]
    peak = mem_peak(dev)
    return {
        "sec": statistics.median(times),
        "peak": None if peak is None else peak - base,
        "shared": pl.shared_prefix,
        "L": int(pl.prefix.shape[1] + 16 + pl.suffix.shape[1]),
    }


def part_f_steps(args, dev, budget) -> list[str]:
    rows = []
    if not budget.ok("f step (the text tower)"):
        return rows
    model, tok, name = text_model(args, dev)
    dtypes = [torch.float32, torch.float16] if dev.type == "cuda" else [torch.float32]
    for K in args.prompt_classes:
        for dtype in dtypes:
            res = {}
            for shared in (False, True):
                what = f"f step K={K} {str(dtype)[6:]} shared_prefix={shared}"
                if not budget.ok(what):
                    continue
                try:
                    res[shared] = prompt_step(model, tok, K, shared, dtype, dev, args.prompt_steps)
                    r = res[shared]
                    log(
                        f"{what}: {1e3 * r['sec']:.2f} ms/step, peak {mib(r['peak'])} MiB (prompt length {r['L']})"
                    )
                except Exception as e:  # an OOM is a cell
                    traceback.print_exc()
                    res[shared] = {"error": f"FAILED {type(e).__name__}: {str(e)[:80]}"}
                    log(f"{what}: {res[shared]['error']}")
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            for shared, r in res.items():
                if "error" in r:
                    rows.append(
                        f"| {K} | {str(dtype)[6:]} | {'on' if shared else 'off'} | {r['error']} | | | |"
                    )
                    continue
                on = ("on" if r["shared"] else "on (not taken: the tower cannot share)") if shared else "off"
                other = res.get(not shared)
                ratio = "-"
                if shared and other and "error" not in other:
                    ratio = f"**{other['sec'] / r['sec']:.2f}x**"
                rows.append(f"| {K} | {str(dtype)[6:]} | {on} | {1e3 * r['sec']:.2f} | {ratio} | {mib(r['peak'])} | "
                            f"{r['L']} |")  # fmt: skip
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    args.prompt_model = name
    return rows


PROMPT_ROWS = [
    ("promptfl", {}),
    ("promptfl", {"optimizer_state": "fresh"}),
    ("promptfl", {"optimizer_state": "fresh", "shared_prefix": "true"}),
    ("fedcopl", {}),
]


def part_f_rounds(args, dev, budget) -> tuple[list[str], str]:
    """promptfl / fedcopl seconds per round through the engine (``run_federated``, batched) on the live stand-in
    store (``fedfeat.runs.standin.live_standin``: synthetic 32-px images encoded with ``--pixels`` by the tiny random
    ViT through the real ``encode``; its text tower rebuilt by ``load_live_text``)."""
    from fedfeat.encoders.live import load_live_text
    from fedfeat.engine.data import load_run_data
    from fedfeat.partition.stored import store_partition
    from fedfeat.runs.standin import LIVE_TRAIN, live_standin
    from fedfeat.store.featurestore import FeatureStore

    if not budget.ok("f rounds (live stand-in store)"):
        return [], ""
    K, N = args.live_classes, 10
    t = time.perf_counter()
    path = live_standin(ROOT / "cache" / "bench-gpu", f"gpu-live-c{K}", {"classes": K}, log=lambda m: log(m))
    st = FeatureStore.open(path)
    _, part = store_partition(st, scheme="iid", clients=N, save=False)
    data = load_run_data(st, part, device=dev)
    data.live = load_live_text(st, device=dev)
    sync(dev)
    desc = (f"{K} classes x {LIVE_TRAIN} train images (32 px), {N} iid clients x 100 %, store and text tower "
            f"ready in {time.perf_counter() - t:.1f} s; data and the tiny CLIP on the device: {mib(mem_now(dev))} MiB")  # fmt: skip
    log(f"f rounds: {desc}")
    rows = []
    for method, sets in PROMPT_ROWS:
        sets = {**args.prompt_light, **sets}
        what = f"f {shown(method, sets)}"
        if not budget.ok(what):
            continue
        try:
            r = cell(method, sets, data, part=1.0, engine="batched", rounds=args.rounds + 1, dev=dev,
                     kernel=args.kernel, cap=args.cell_cap)  # fmt: skip
            log(f"{what}: {r['sec']:.3f} s/round ({r['timed']} timed), acc {r['acc'][r['last']]:.2f}, peak "
                f"{mib(r['peak'])} MiB")  # fmt: skip
            rows.append(f"| {shown(method, sets)} | {r['sampled']} | {r['sec']:.3f} ({r['timed'] or 'warm-up only'}) | "
                        f"{r['acc'][r['last']]:.2f} (round {r['last']}) | {mib(r['peak'])} |")  # fmt: skip
        except Exception as e:
            traceback.print_exc()
            rows.append(f"| {shown(method, sets)} | FAILED: {type(e).__name__}: {str(e)[:100]} | | | |")
            log(f"{what}: FAILED {e}")
    del data
    return rows, desc


# (setting, full run, --quick): each flag left unset takes one of these
DEFAULTS = [
    ("clients", 100, 20),
    ("rounds", 3, 1),
    ("stack_runs", 10, 3),
    ("stack_rounds", 10, 2),
    ("check_rounds", 10, 3),
    ("repeats", 3, 1),
    ("cell_cap", 25, 8),
    ("enc_batch", 256, 16),
    ("enc_forward", 10, 2),
    ("enc_images", 3072, 32),
    ("prompt_steps", 5, 2),
    ("live_classes", 100, 10),
    ("budget", 380, 100),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = ap.add_argument
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    add(
        "--quick",
        action="store_true",
        help="small stores, 20 clients, 3 runs stacked, 1 timed round, tiny CLIP models (CPU check)",
    )
    add("--out", default=str(ROOT / "bench" / "results" / "gpu.md"))
    add("--store", default=str(ROOT / "cache" / "synth-cifar10.zarr"), help="the CIFAR-10-shaped store")
    add("--kernel", default="torch", help="torch (the GPU program; default) or auto")
    add(
        "--parts", default="abcefh", help="which parts run (letters of a, b, c, e, f, h; default all; g is b)"
    )
    add("--clients", type=int, help="clients of every partition")
    add("--rounds", type=int, help="timed rounds a cell of parts a and f, after a warm-up round")
    add("--stack-runs", type=int, help="runs stacked in part b")
    add("--stack-rounds", type=int, help="rounds of each run in part b")
    add("--check-rounds", type=int, help="rounds of part c")
    add("--repeats", type=int, help="interleaved repeats of part b")
    add("--cell-cap", type=float, help="seconds after which a cell stops at the end of its round")
    add("--enc-batch", type=int, help="part e: images per forward")
    add(
        "--enc-forward", type=int, help="part e: timed batches of the forward alone (after 2 warm-up batches)"
    )
    add("--enc-images", type=int, help="part e: images of each feed")
    add(
        "--enc-workers",
        type=int,
        help="part e: DataLoader workers (default: encode's, up to 8 on a GPU; 1 on a CPU)",
    )
    add("--prompt-classes", help="part f: class counts of the local step (default 100,1000 / --quick 10,20)")
    add("--prompt-steps", type=int, help="part f: timed local steps a cell (after one warm-up step)")
    add("--live-classes", type=int, help="part f: classes of the live stand-in store")
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
    args.prompt_light = {"local_epochs": "1"} if q else {}
    args.prompt_classes = [int(k) for k in (args.prompt_classes or ("10,20" if q else "100,1000")).split(",")]
    bad = set(args.parts) - set("abcefgh")
    if bad:
        ap.error(f"--parts: unknown part(s) {', '.join(sorted(bad))}; letters of a, b, c, e, f, h")
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    if (
        args.enc_workers is None
    ):  # fedfeat encode's rule on a GPU; one worker on a CPU (the worker path, checked)
        args.enc_workers = min(8, os.cpu_count() or 1) if dev.type == "cuda" else 1
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
    parts = args.parts
    st = stores(args) if set(parts) & set("abcgh") else {}
    N = args.clients
    head = [
        f"## GPU: batched vs loop engine, stacked runs, agreement, peak memory, encode, prompt methods "
        f"({dev.type}{', quick' if q else ''})",
        "",
        f"Machine: {machine(dev)}. Environment: {env}.",
        "",
        f"Command: `{cmd}` (on the GPU machine: `make bench-gpu PY=python3`, after `bash scripts/device_wheels.sh` "
        f"here). Program: `--kernel {args.kernel}` (the batched torch program, what a GPU runs). Seconds are "
        "wall-clock, `torch.cuda.synchronize` before each reading of the clock. What each part runs: "
        "`bench/bench_gpu.py`'s docstring. Part g (a stacked sweep) is part b: `runs.stack.run_stacked` is what "
        "`fedfeat sweep` runs by default.",
        "",
    ]
    a_cols = [
        "| method | clients x participation | sampled | batched s/round (timed rounds) | loop s/round (timed rounds) | "
        "loop / batched | test acc % batched / loop | abs diff acc (fraction) | max abs diff W | peak GPU MiB batched / "
        "loop |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = ("a", "b", "c", "h", "e", "f", "f-rounds", "a100")
    sec: dict[str, list[str]] = {k: [] for k in (*order, "a-heavy")}
    heads: dict[str, list[str]] = {}

    def write(final: bool = False) -> None:
        lines = list(head)
        for k in order:
            if k in heads:
                lines += heads[k] + sec[k] + (sec["a-heavy"] if k == "a" else []) + [""]
        lines.append(f"Wall time of the bench: {time.perf_counter() - T0:.0f} s{'' if final else ' so far (it did not finish)'}.")  # fmt: skip
        if budget.skipped:
            lines.append(
                f"Skipped once the --budget of {args.budget:g} s was spent: {', '.join(budget.skipped)}."
            )
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(lines) + "\n")

    if set(parts) & set("abcgh"):
        path, p = st["c10"]
    if "a" in parts:
        data = load(path, "iid", dev, N)
        heads["a"] = [
            f"### a. Seconds per round, batched vs loop engine ({p.classes} classes, {p.classes * p.train_per_class:,} "
            f"x {p.dim}, iid, {N} clients)",
            "",
            f"Median `train_seconds` of the timed rounds after a warm-up round (at most {args.rounds}; a cell stops "
            f"after the round that passed {args.cell_cap:g} s: `warm-up only` = the figure is the warm-up round, which "
            "the batched cell before it already warmed for the loop), seed 0; test accuracy at the last round both "
            "engines reached, weights compared where both ran every round. "
            f"CReFF / CLIP2FL: server step lighter ({args.light}). Data on the device before the cells: "
            f"{mib(mem_now(dev))} MiB (in every peak).",
            "",
            *a_cols,
        ]
        log("part a")
        sec["a"] = part_a(args, dev, data, LIGHT_METHODS, budget)
        write()
        del data

    if set(parts) & set("bcgh"):
        data = load(path, "dirichlet", dev, N, alpha=0.1, seed=0)
    if "b" in parts or "g" in parts:
        heads["b"] = [
            f"### b. {args.stack_runs} runs stacked vs one by one ({p.classes} classes, Dirichlet alpha 0.1, {N} "
            "clients; g. the stacked sweep)",
            "",
            "Whole programs (data loaded once), seconds, median of the repeats (interleaved, after a warm-up). "
            "`diff stacked vs alone`: the largest abs difference of final test accuracy (fraction) / weights between "
            "each stacked "
            f"run and the same run made alone. Data on the device: {mib(mem_now(dev))} MiB.",
            "",
            f"| method | runs differ in | participation | rounds | repeats | 1 run | {args.stack_runs} one by one | "
            f"{args.stack_runs} stacked | one by one / stacked | stacked / 1 run | peak GPU MiB 1 run / stacked | "
            "diff stacked vs alone (acc / W) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        log("part b")
        sec["b"] = part_b(args, dev, data, budget)
        write()

    if "c" in parts:
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
    if "h" in parts:
        heads["h"] = [
            f"### h. Differential privacy: fedavg s/round without DP, client-level DP-FedAvg (z = 1, C = 0.1) and "
            f"sample-level DP-SGD (z = 1, C = 1) ({p.classes} classes, Dirichlet alpha 0.1, {N} clients, the torch "
            "program; the noise drawn on the device)",
            "",
            "| method | participation | DP | s/round (timed rounds) | / no DP | test acc % (last round) | peak GPU MiB |",
            "|---|---|---|---|---|---|---|",
        ]
        log("part h")
        sec["h"] = part_h(args, dev, data, budget)
        write()
    if set(parts) & set("bcgh"):
        del data

    if "e" in parts:
        na = feed_status()
        prec = "fp32 and bf16 (weights cast, as `encode --precision bf16`)" if dev.type == "cuda" else "fp32"
        models = "the live stand-in's tiny ViT (32 px)" if q else ", ".join(ENC_MODELS)
        heads["e"] = [
            f"### e. Encode images/s ({models}; random weights from a safetensors file, loaded by fedfeat's path)",
            "",
            "Each model: random weights (seed 0) saved to a file, then `resolve_backbone` / `resolve_weights` (its "
            f"sha256) / `load_model` per precision ({prec}). Forward: `ClipModel.encode_images` on a pre-made input "
            f"batch on the device, {args.enc_forward} batches of {args.enc_batch} after 2 warm-up batches. PIL feed: "
            f"`fedfeat encode`'s loader (`_Rows`, its collate, {args.enc_workers} DataLoader worker(s), pinned memory "
            f"on a GPU) with the model's open_clip eval transform on PIL images, {args.enc_images:,} images a source "
            "(the workers' start included), into `encode_images` at the last precision: `32x32 arrays` = PIL images "
            "from CIFAR-sized uint8 arrays (as CIFAR's pickles), `500x375 JPEG` = JPEG bytes decoded in the workers. "
            "Device feed: the workers decode to uint8 only and `device_feed_batch` (`fedfeat.encoders.feed`) resizes "
            f"and normalises on the device{' (here: ' + na + ')' if na else ''}. Load s: writing the random checkpoint + "
            "resolving it / `load_model` per precision.",
            "",
            "| model | input px | load s (write + resolve / load per precision) | forward fp32 img/s | forward bf16 "
            "img/s | PIL feed 32x32 img/s | PIL feed 500x375 JPEG img/s | device feed 32x32 img/s | device feed "
            "500x375 JPEG img/s | peak GPU MiB (forward, per precision) |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        log("part e")
        sec["e"] = part_e(args, dev, budget)
        write()

    if "f" in parts:
        tower = "the live stand-in's tiny text tower (width 64, 2 layers)" if q else "ViT-B-32's text tower"
        dts = (
            "fp32 and fp16 (promptfl's `precision=auto` on a GPU: `TextTower.cast`)"
            if dev.type == "cuda"
            else "fp32"
        )
        heads["f"] = [
            f"### f. Prompt methods: the PromptFL local step ({tower}, random weights, n_ctx = 16, one client)",
            "",
            "One step: the class text features from the CoOp contexts (`PromptLearner(shared_prefix=...)`; on: "
            "`TextTower.forward_shared`, the [SOS] + contexts once per client), CLIP-scale logits of 32 unit image "
            "features, CE, `autograd.grad` to the contexts (what promptfl's `step_loss` and the engine do on the text "
            f"side); median of {args.prompt_steps} steps after one warm-up, in {dts}. Peak: device MiB above what was "
            "allocated before the step (the tower's weights excluded); `-` on a CPU. Prompt length: tokens of the "
            "longest prompt after truncation.",
            "",
            "| classes | dtype | shared_prefix | ms / step | off / on | peak GPU MiB (step) | prompt length |",
            "|---|---|---|---|---|---|---|",
        ]
        log("part f, the local step")
        sec["f"] = part_f_steps(args, dev, budget)
        write()
        log("part f, rounds on the live stand-in")
        rows, desc = part_f_rounds(args, dev, budget)
        heads["f-rounds"] = [
            "#### f. promptfl and fedcopl seconds per round (the engine on a live stand-in store)",
            "",
            "`run_federated` (batched engine; promptfl's default `optimizer_state=carried` runs one client at a time) "
            "on the live stand-in (`fedfeat.runs.standin`: synthetic 32-px images encoded with `--pixels` by a tiny "
            "random ViT through the real `encode`, its text tower rebuilt by `load_live_text`): the engine's cost on "
            "the device with a tiny CLIP, not a real model's. Median `train_seconds` of the timed rounds after a "
            f"warm-up round (at most {args.rounds}; cell cap {args.cell_cap:g} s); methods' defaults otherwise "
            f"{('(' + str(args.prompt_light) + ')') if args.prompt_light else ''}. {desc}.",
            "",
            "| method | sampled | s/round (timed rounds) | test acc % | peak GPU MiB |",
            "|---|---|---|---|---|",
        ]
        sec["f-rounds"] = rows
        write()

    if "a" in parts:
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
            f"As part a; K = 100 outputs make the per-client GEMMs less thin. Data on the device: {mib(mem_now(dev))} "
            "MiB.",
            "",
            *a_cols,
        ]
        log("part a, 100 classes")
        sec["a100"] = part_a(args, dev, data, ["fedavg", "fst-cbdg"], budget, tag="a100")
        del data
    write(final=True)
    log(f"wrote {out}")
    print(out.read_text(), flush=True)


if __name__ == "__main__":
    main()
