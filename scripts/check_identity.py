#!/usr/bin/env python3
"""Byte-identity check: the same commands and seeds give the same run directories in two versions of fedfeat.

Every method of ``fedfeat methods`` is trained by the command line (``python -m fedfeat train ...``) once with the
code of a git ref (default: ``a0ed124``, the last commit before the package was re-laid by data flow) and once
with the working tree, from the same working directory and with the same arguments, so that the recorded command
and cwd are equal too. Then, run by run:

* ``metrics.jsonl``: every line equal, after dropping timing keys (``seconds``, ``*_seconds``, ``seconds_*``,
  ``sec_*``) and the process's measured memory (``peak_rss_bytes``, ``rss_bytes_at_end``, ``peak_device_bytes``);
* ``summary.json``: equal, after dropping the same timing keys, ``provenance.git_commit`` (the ref's copy is an
  archive, not a checkout, so it has none; the working tree may have one) and the recorded command's argv[0] (each
  tree's own ``fedfeat/__main__.py``);
* ``config.toml``, ``weights.safetensors`` and ``partition.json``: byte for byte.

Linear-head and feature-synthesis methods run on a small synthetic store (both kernels where a method has a fused
one, and the per-client loop engine for one); the prompt methods (promptfl, fedtpg, fedcopl) on a store encoded by
a tiny open_clip model from fake CIFAR-10 pickles (written by ``tests/helpers_clip.py``), with pixels for
fedcopl; plus one stacked sweep. Nothing is downloaded. Exit status 0 when all runs are identical, 1 otherwise.

Usage::

    python scripts/check_identity.py                  # the move's base commit vs the working tree
    python scripts/check_identity.py --base HEAD~3    # any ref
    python scripts/check_identity.py --head HEAD      # a commit instead of the working tree
    python scripts/check_identity.py --only fedavg,fst-cbdg --keep /tmp/ident
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = ".fedfeat-identity"  # in a work directory this script made (and may remove)
BASE = "a0ed124"  # the last commit before the re-layout (issue: the house by its data flow)

SYNTH = ["--clients", "10", "--participation", "0.5", "--rounds", "3", "--seed", "1", "--partition", "dirichlet",
         "--alpha", "0.5"]  # fmt: skip
CLIP = ["--clients", "3", "--participation", "1.0", "--rounds", "2", "--seed", "2", "--partition", "dirichlet",
        "--alpha", "1.0"]  # fmt: skip
SMALL_SYNTHESIS = ["--set", "match_steps=5", "--set", "crt_epochs=5", "--set", "local_epochs=2"]
PROMPT = ["--set", "batch_size=8", "--set", "n_ctx=2"]
OPEN_VOCAB = ["--partition", "disjoint-classes", "--clients", "3", "--shots", "5", "--rounds", "2", "--participation",
              "1.0", "--seed", "3"]  # fmt: skip

# (run name, store key, argv after `train`): every registered method at least once
RUNS: list[tuple[str, str, list[str]]] = [
    ("zeroshot", "synth", ["--method", "zeroshot", *SYNTH]),
    ("fedavg", "synth", ["--method", "fedavg", *SYNTH]),
    ("fedavg-torch", "synth", ["--method", "fedavg", "--kernel", "torch", *SYNTH]),
    ("fedavg-loop", "synth", ["--method", "fedavg", "--engine", "loop", *SYNTH]),
    ("centralized", "synth", ["--method", "centralized", *SYNTH]),
    ("fedprox", "synth", ["--method", "fedprox", *SYNTH, "--set", "mu=0.1"]),
    ("fedprox-torch", "synth", ["--method", "fedprox", "--kernel", "torch", *SYNTH, "--set", "mu=0.1"]),
    ("fedavgm", "synth", ["--method", "fedavgm", *SYNTH]),
    ("fedntd", "synth", ["--method", "fedntd", *SYNTH]),
    ("fedntd-torch", "synth", ["--method", "fedntd", "--kernel", "torch", *SYNTH]),
    ("fst-cbdg", "synth", ["--method", "fst-cbdg", *SYNTH]),
    ("fst-cbdg-torch", "synth", ["--method", "fst-cbdg", "--kernel", "torch", *SYNTH]),
    ("creff", "synth", ["--method", "creff", *SYNTH, *SMALL_SYNTHESIS]),
    ("clip2fl", "synth", ["--method", "clip2fl", *SYNTH, *SMALL_SYNTHESIS]),
    ("fedclip", "synth", ["--method", "fedclip", *OPEN_VOCAB]),
    ("fed-mp", "synth", ["--method", "fed-mp", *OPEN_VOCAB]),
    ("copl-linear", "synth", ["--method", "copl-linear", *SYNTH]),
    ("promptfl", "clip", ["--method", "promptfl", *CLIP, *PROMPT]),
    ("fedtpg", "clip", ["--method", "fedtpg", *CLIP, "--set", "batch_size=8"]),
    (
        "fedcopl",
        "clip-px",
        [
            "--method",
            "fedcopl",
            *CLIP,
            "--set",
            "batch_size=8",
            "--set",
            "n_ctx=2",
            "--set",
            "pseudo=fpl",
            "--set",
            "pseudo_k=4",
        ],
    ),  # fmt: skip
]
# one stacked sweep (one process, runs stacked along a run axis): names are derived by fedfeat
SWEEP = ["--method", "fedavg,fst-cbdg", "--seed", "0-1", "--clients", "10", "--participation", "0.5", "--rounds",
         "2", "--partition", "shard"]  # fmt: skip


MEMORY = (
    "peak_rss_bytes",
    "rss_bytes_at_end",
    "peak_device_bytes",
)  # a process's memory, measured like a time


def _is_timing(key: str) -> bool:
    return (
        key == "seconds" or key.endswith("_seconds") or key.startswith(("seconds_", "sec_")) or key in MEMORY
    )


# keys that say how a run was made, not what it computed: the commit, and (issue 35) the thread count and why
# (``env.threads``) and the divergence verdict (``diverged``, derived from the compared metrics)
UNCOMPARED = {"git_commit", "threads", "diverged"}
# summary keys a version may predate: compared where both summaries have them (issue 36: ``weights_sha256``, the
# sha256 of weights.safetensors -- deterministic, so compared, but a base from before it has none)
ADDED = {"weights_sha256", "trainable_params"}
# metrics.jsonl row keys a version may predate (issue 37: ``images``, each round's training images; ``trainable_params``)
ROW_ADDED = {"images", "trainable_params"}


# settings and method parameters a version may predate, at the value that means what the older version did: a key
# only the working tree's config.toml / summary params hold, at this value, is left out (issue 38: the base-to-novel
# protocol's switch; fedclip / fed-mp's server weights, "size" as before; issue 40: the prompt methods' shared-prefix
# text tower, off as before)
CONFIG_ADDED = {"base_novel": False}
PARAMS_ADDED = {"aggregation": "size", "shared_prefix": False}


def _same_config(fa: Path, fb: Path) -> bool:
    """config.toml byte for byte, or equal once the head's ``CONFIG_ADDED`` / ``PARAMS_ADDED`` keys at their old
    meaning are left out."""
    import tomllib

    if fa.read_bytes() == fb.read_bytes():
        return True
    a, b = (tomllib.loads(f.read_text()) for f in (fa, fb))
    for section, added in (("run", CONFIG_ADDED), ("params", PARAMS_ADDED)):
        ta, tb = a.get(section, {}), b.get(section, {})
        for k, v in added.items():
            if k not in ta and tb.get(k) == v:
                tb.pop(k)
    return a == b


def _drop_added(la: list, lb: list) -> None:
    """Leave out of both versions' rows the ``ROW_ADDED`` keys that only one of them records."""
    for x, y in zip(la, lb):
        if isinstance(x, dict) and isinstance(y, dict):
            for k in ROW_ADDED:
                if (k in x) != (k in y):
                    x.pop(k, None), y.pop(k, None)


def _strip(obj):
    if isinstance(obj, dict):
        out = {k: _strip(v) for k, v in obj.items() if not _is_timing(k) and k not in UNCOMPARED}
        if isinstance(out.get("command"), str):  # argv[0] is the tree's own fedfeat/__main__.py
            out["command"] = out["command"].split(" ", 1)[-1]
        return out
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def export_tree(ref: str, dest: Path) -> Path:
    """The files of ``ref`` (git archive: no .git, so no git_commit in provenance)."""
    dest.mkdir(parents=True)
    tar = dest.with_suffix(".tar")
    subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", "-o", str(tar), ref], check=True)
    with tarfile.open(tar) as t:
        t.extractall(dest, filter="data")
    tar.unlink()
    return dest


def env_for(tree: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), HF_HUB_OFFLINE="1", MPLBACKEND="Agg", OMP_NUM_THREADS="1")
    env.pop("PYTHONHASHSEED", None)
    return env


def fedfeat(tree: Path, cwd: Path, args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedfeat", *args], cwd=cwd, env=env_for(tree),
                          capture_output=True, text=True)  # fmt: skip


def make_stores(work: Path, need_clip: bool) -> dict[str, str]:
    """The synthetic store, and (for prompt methods) a tiny-CLIP store with and without pixels."""
    stores = {"synth": "stores/synth.zarr"}
    r = fedfeat(ROOT, work, ["synth", "--out", stores["synth"], "--classes", "10", "--dim", "64",
                             "--train-per-class", "60", "--test-per-class", "20", "--templates", "3", "--no-stats"])  # fmt: skip
    if r.returncode:
        sys.exit(f"synth failed: {r.stderr.strip().splitlines()[-1:]}")
    if not need_clip:
        return stores
    code = (
        "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]);"
        "from helpers_clip import make_tiny_clip, write_cifar10;"
        "tc = make_tiny_clip(Path('tiny')); fx = write_cifar10(Path('data/cifar-10-batches-py'), n_train=60, n_test=20);"
        "print(tc.config, tc.weights, fx.root)"
    )
    r = subprocess.run([sys.executable, "-c", code, str(ROOT / "tests")], cwd=work, env=env_for(ROOT),
                       capture_output=True, text=True)  # fmt: skip
    if r.returncode:
        sys.exit(f"tiny CLIP fixture failed: {r.stderr.strip()}")
    config, weights, root = r.stdout.split()
    for key, extra in (("clip", []), ("clip-px", ["--pixels"])):
        out = f"stores/{key}"
        r = fedfeat(ROOT, work, ["encode", "--dataset", "cifar10", "--root", root, "--backbone", config,
                                 "--pretrained", weights, "--out", out, "--device", "cpu", *extra])  # fmt: skip
        if r.returncode:
            sys.exit(f"encode failed: {r.stderr.strip()}")
        stores[key] = str(next((work / out).glob("*/*.zarr")).relative_to(work))
    return stores


def run_all(tree: Path, work: Path, stores: dict, runs: list, sweep: bool) -> dict[str, str]:
    """Every run of ``runs`` (and the sweep) with ``tree``'s code into ``work/runs``; returns failures."""
    failed = {}
    for name, store, args in runs:
        r = fedfeat(tree, work, ["train", *args, "--store", stores[store], "--out", "runs", "--name", name])
        print(f"  {name:<16} {'ok' if r.returncode == 0 else 'FAILED'}", flush=True)
        if r.returncode:
            failed[name] = (r.stderr.strip().splitlines() or ["?"])[-1]
    if sweep:
        r = fedfeat(
            tree, work, ["sweep", *SWEEP, "--store", stores["synth"], "--out", "runs/sweep", "--quiet"]
        )
        print(f"  {'sweep':<16} {'ok' if r.returncode == 0 else 'FAILED'}", flush=True)
        if r.returncode:
            failed["sweep"] = (r.stderr.strip().splitlines() or ["?"])[-1]
    return failed


def compare(a: Path, b: Path) -> list[str]:
    """Differences between two run trees (``a`` the ref's, ``b`` the working tree's)."""
    diffs = []
    dirs_a = sorted(p.parent.relative_to(a) for p in a.rglob("summary.json"))
    dirs_b = sorted(p.parent.relative_to(b) for p in b.rglob("summary.json"))
    if dirs_a != dirs_b:
        diffs.append(f"run directories differ: {sorted(set(dirs_a) ^ set(dirs_b))}")
    for d in sorted(set(dirs_a) & set(dirs_b)):
        ra, rb = a / d, b / d
        la = [_strip(json.loads(x)) for x in (ra / "metrics.jsonl").read_text().splitlines()]
        lb = [_strip(json.loads(x)) for x in (rb / "metrics.jsonl").read_text().splitlines()]
        _drop_added(la, lb)
        if la != lb:
            bad = next(i for i, (x, y) in enumerate(zip(la + [None] * 99, lb + [None] * 99)) if x != y)
            diffs.append(f"{d}: metrics.jsonl differs from line {bad + 1}")
        sa, sb = (_strip(json.loads((r / "summary.json").read_text())) for r in (ra, rb))
        for k in ADDED:
            if (k in sa) != (k in sb):
                sa.pop(k, None), sb.pop(k, None)
        pa, pb = sa.get("params"), sb.get("params")
        if isinstance(pa, dict) and isinstance(pb, dict):
            for k, v in PARAMS_ADDED.items():
                if k not in pa and pb.get(k) == v:
                    pb.pop(k)
        if sa != sb:
            keys = sorted(k for k in set(sa) | set(sb) if sa.get(k) != sb.get(k))
            diffs.append(f"{d}: summary.json differs in {keys}")
        for f in ("config.toml", "weights.safetensors", "partition.json"):
            fa, fb = ra / f, rb / f
            same = fa.exists() == fb.exists() and (
                not fa.exists()
                or (_same_config(fa, fb) if f == "config.toml" else fa.read_bytes() == fb.read_bytes())
            )
            if not same:
                diffs.append(f"{d}: {f} differs")
    return diffs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default=BASE, help=f"git ref of the code to compare against (default {BASE})")
    ap.add_argument("--head", default="", help="git ref to check (default: the working tree)")
    ap.add_argument("--only", default="", help="comma-separated run names (default: all, and the sweep)")
    ap.add_argument("--keep", default="", help="work directory to keep (default: a temporary one, removed)")
    a = ap.parse_args()
    runs = [r for r in RUNS if not a.only or r[0] in a.only.split(",")]
    sweep = not a.only or "sweep" in a.only.split(",")
    for ref in filter(None, (a.base, a.head)):
        ok = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "-q", f"{ref}^{{commit}}"],
                            capture_output=True).returncode == 0  # fmt: skip
        if not ok:
            sys.exit(f"error: {ref} is not a commit of this repository; give a branch, tag or hash (git log)")
    work = Path(a.keep or tempfile.mkdtemp(prefix="fedfeat-identity-")).resolve()
    if a.keep and work.exists() and any(work.iterdir()):
        if not (work / MARKER).is_file():  # never delete a directory this script did not make
            sys.exit(
                f"error: --keep {work} exists and was not made by this script; give a new or empty directory"
            )
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    (work / MARKER).write_text("made by scripts/check_identity.py\n")
    try:
        base = export_tree(a.base, work / "base-tree")
        head = export_tree(a.head, work / "head-tree") if a.head else ROOT
        print(f"stores in {work}/stores", flush=True)
        stores = make_stores(work, need_clip=any(s.startswith("clip") for _, s, _ in runs))
        results = {}
        for label, tree in (("base " + a.base, base), (a.head or "working tree", head)):
            print(f"{label}:", flush=True)
            failed = run_all(tree, work, stores, runs, sweep)
            if failed:
                for k, v in failed.items():
                    print(f"  {k}: {v}")
            shutil.move(str(work / "runs"), str(work / f"runs-{'base' if tree == base else 'head'}"))
            results[label] = failed
        if any(results.values()):
            print("FAILED: a run did not finish (above)")
            return 1
        diffs = compare(work / "runs-base", work / "runs-head")
        n = len(list((work / "runs-head").rglob("summary.json")))
        for d in diffs:
            print("DIFF", d)
        print(f"{n} runs compared: {'identical' if not diffs else f'{len(diffs)} differences'} "
              f"(metrics.jsonl and summary.json without timings; config, weights, partition byte for byte)")  # fmt: skip
        return 1 if diffs else 0
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
