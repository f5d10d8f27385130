"""Bad inputs, one table: every case must be refused the same way.

For each case the command (in-process through ``CliRunner``, or in a fresh interpreter where marked ``sub``)
must:

* exit with a status other than 0;
* print exactly one non-empty line, ``error: ...``, and no traceback;
* name the problem and the fix in that line (case-specific patterns, case-insensitive regexes);
* touch nothing outside its targets: every file and directory under the case's ``tmp_path`` (sentinel
  "valuables" included) that is not under a target keeps its size and mtime, nothing new appears there;
* leave nothing looking complete: no new ``summary.json``, no new store whose ``complete`` flag is set, no
  ``.tmp-*``, ``.lock-*``, ``.partial-*`` or ``.old-*`` leftovers under its targets;
* run no code from a malicious file: the marker file its payload would create does not exist (and
  ``test_the_malicious_payloads_would_run`` shows that the payloads are live).

A case is a row: an id, a setup function (``Workspace -> Setup``: prepares files under ``tmp_path`` and
returns argv, targets, markers and extra checks), the patterns the line must contain (problem, fix) and
patterns it must not (harmful advice).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from fedfeat.cli.app import app

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()

# train flags every train case carries (small, fast, no numba compilation)
FAST = ["--kernel", "torch", "--rounds", "1", "--clients", "4", "--quiet"]


# ---------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """Module-wide inputs, never handed to a command directly (cases copy what they use)."""
    root = tmp_path_factory.mktemp("bad-inputs-base")
    store = root / "s.zarr"
    r = runner.invoke(
        app,
        ["synth", "--out", str(store), "--classes", "4", "--dim", "16", "--train-per-class", "60",
         "--test-per-class", "10", "--templates", "2", "--no-stats"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    # one finished run (zero-shot: no training) for the report and same-name cases
    runs = root / "runs"
    r = runner.invoke(
        app,
        ["train", "--method", "zeroshot", "--store", str(store), "--partition", "iid", "--out", str(runs),
         "--name", "good", *FAST],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert (runs / "good" / "summary.json").is_file()
    return {"root": root, "store": store, "run": runs / "good"}


@pytest.fixture(scope="module")
def partial(base):
    """An interrupted run (a real SIGKILL after round 2, checkpoints every round): ``OUT/.partial-part``."""
    root = base["root"] / "interrupted"
    store = root / "s.zarr"
    shutil.copytree(base["store"], store)
    argv = ["train", "--method", "fedavg", "--store", store, "--out", root / "runs", "--name", "part",
            "--partition", "iid", "--kernel", "torch", "--clients", "4", "--rounds", "3",
            "--checkpoint-every", "1", "--quiet"]  # fmt: skip
    p = subprocess.run(
        [sys.executable, "-m", "fedfeat", *map(str, argv)],
        cwd=root,
        env=_env(FEDFEAT_FAULT="after-round-2"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    run = root / "runs" / ".partial-part"
    assert (run / "checkpoint.safetensors").is_file(), (p.returncode, p.stdout, p.stderr)
    for lock in (root / "runs").glob(".lock-*"):  # the killed process's lock (stale: taken over anyway)
        lock.unlink()
    return {"out": root / "runs", "name": "part"}


def _env(**extra) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", **extra)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    """The tiny open_clip model of ``helpers_clip`` (random weights in a file) and a CIFAR-10 fixture."""
    from helpers_clip import make_tiny_clip, write_cifar10

    d = tmp_path_factory.mktemp("bad-inputs-clip")
    tc = make_tiny_clip(d / "tiny")
    c10 = write_cifar10(d / "cifar-10-batches-py", n_train=10, n_test=5)
    return {"tc": tc, "c10": c10.root}


class Evil:
    """A pickle payload: unpickling it runs ``os.system("touch MARKER")``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


def evil_pickle(path: Path, marker: Path) -> None:
    """A CIFAR-batch-shaped pickle whose first global is ``os.system`` (protocol 4: no ``_codecs`` calls for
    the byte strings, so a restricted unpickler meets the payload itself)."""
    path.write_bytes(pickle.dumps({b"data": Evil(marker), b"labels": [0]}, protocol=4))


def evil_checkpoint(path: Path, weights_pt: Path, marker: Path) -> None:
    """The tiny model's state dict (``torch.save``) with one more entry: the payload."""
    import torch

    sd = dict(torch.load(weights_pt, weights_only=True))
    sd["payload"] = Evil(marker)
    torch.save(sd, path)


# ---------------------------------------------------------------------------------------- workspace
@dataclass
class Setup:
    argv: list
    targets: list = field(default_factory=list)  # paths the command may write (and nothing else)
    markers: list = field(default_factory=list)  # files a malicious input would create
    check: Callable | None = None  # extra checks after the run, called with the Workspace


class Workspace:
    def __init__(self, tmp: Path, base: dict, request):
        self.tmp, self._base, self._request = tmp, base, request
        self.valuables = self.keep(tmp / "valuables")

    def keep(self, d: Path) -> Path:
        """A directory of files that nothing may touch."""
        d.mkdir(parents=True, exist_ok=True)
        (d / "thesis.txt").write_text("irreplaceable\n")
        (d / "data.bin").write_bytes(bytes(range(256)))
        return d

    def store(self, name: str = "store.zarr") -> Path:
        dst = self.tmp / name
        shutil.copytree(self._base["store"], dst)
        return dst

    def run_copy(self, dst: Path) -> Path:
        shutil.copytree(self._base["run"], dst)
        return dst

    def partial(self) -> Path:
        """A copy of the interrupted run's OUT (``.partial-part`` inside); returns OUT/part (the run's path)."""
        src = self._request.getfixturevalue("partial")
        out = self.tmp / "runs"
        shutil.copytree(src["out"], out)
        return out / src["name"]

    @property
    def clip(self) -> dict:
        return self._request.getfixturevalue("clip")

    def cifar(self) -> Path:
        dst = self.tmp / "cifar-10-batches-py"
        shutil.copytree(self.clip["c10"], dst)
        return dst

    def train(
        self, *extra, out: Path | None = None, store: Path | None = None, method="fedavg", damaged=False
    ) -> Setup:
        """``fedfeat train`` on a copy of the store (or ``store``). The copy is a target (training stores its
        partition there); a ``damaged`` store is not: a refused store is left as it was."""
        out = out or self.tmp / "out"
        store = store or self.store()
        argv = ["train", "--method", method, "--store", store, "--out", out, *FAST, *extra]
        return Setup(argv, targets=[out] if damaged else [out, store])

    def encode(self, *extra, root: Path | None = None, dataset="cifar10", backbone=None, pretrained=None):
        tc = self.clip["tc"]
        out = self.tmp / "cache"
        argv = ["encode", "--dataset", dataset, "--root", root or self.clip["c10"], "--backbone",
                backbone or tc.config, "--pretrained", pretrained or tc.weights, "--out", out,
                "--device", "cpu", "--chunk-rows", "8", "--batch-size", "4", *extra]  # fmt: skip
        # bad input is refused before a store is created at the target
        return Setup(argv, targets=[out], check=lambda w: _no_store_created(out))

    def encode_flag(self, *extra) -> Setup:
        """A bad numeric/choice flag: refused before anything at all is created at the target."""
        s = self.encode(*extra)
        s.check = lambda w: _nothing_created(s.targets[0])
        return s


def _nothing_created(path: Path) -> None:
    left = sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else []
    assert not left, f"the refused command left files at its target {path}: {left[:10]}"


def _no_store_created(path: Path) -> None:
    left = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()) if path.exists() else []
    assert not left, f"the refused command left files at its target {path}: {left[:10]}"


def _set_attr(store: Path, **attrs) -> None:
    meta = store / "zarr.json"
    d = json.loads(meta.read_text())
    d["attributes"].update(attrs)
    meta.write_text(json.dumps(d))


def _nan_store(w: Workspace, what: str) -> Path:
    """A copy of the store holding non-finite values: train rows 5 and 7 NaN, or one text feature row inf.

    The store's writers refuse non-finite values, so they are written straight through zarr (a store from a
    writer without that check, or damaged consistently); the chunk's checksum, where the store keeps one, is
    recomputed to match, and a ``finite`` record is dropped, so that only the values are wrong."""
    import zarr

    from fedfeat.store import featurestore as S

    path = w.store()
    g = zarr.open_group(str(path), mode="r+")
    name = "train/features" if what == "train" else "text/features"
    a = g[name][...].astype(np.float32)
    if what == "train":
        a[5] = np.nan
        a[7, 3] = np.nan
    else:
        a[1, 2, :] = np.inf
    f16 = np.ascontiguousarray(a.astype(np.float16))
    g[name][...] = f16
    if hasattr(S, "crc") and hasattr(S, "DONE_BIT"):  # format 2: done entries carry the chunk's crc32
        done = g[name.replace("features", "done")]
        if what == "train":
            rows = int(json.loads((path / "zarr.json").read_text())["attributes"]["chunk_rows"])
            for i in range(done.shape[0]):
                done[i] = S.DONE_BIT | S.crc(f16[i * rows : (i + 1) * rows])
        else:
            done[0] = S.DONE_BIT | S.crc(f16)
    meta = path / "zarr.json"
    d = json.loads(meta.read_text())
    d["attributes"].pop("finite", None)
    meta.write_text(json.dumps(d))
    return path


def _config(w: Workspace, body: str, name: str = "config.toml") -> Path:
    p = w.tmp / name
    p.write_text(body)
    return p


def _run_cfg(w: Workspace, store: Path, out: Path, extra: str = "") -> str:
    return (
        "[run]\n"
        f'method = "fedavg"\nstore = "{store}"\nout = "{out}"\npartition = "iid"\n'
        'kernel = "torch"\nclients = 4\nrounds = 1\n' + extra
    )


# ---------------------------------------------------------------------------------------- train: run names
def name_case(name_of: Callable[[Workspace], str]) -> Callable[[Workspace], Setup]:
    """--out sits two levels below tmp, with valuables beside it and above it: ``..``-names land there."""

    def setup(w: Workspace) -> Setup:
        out = w.tmp / "a" / "b" / "out"
        w.keep(w.tmp / "a" / "b" / "sibling")
        w.keep(w.tmp / "a" / "up")
        w.keep(w.tmp / "abs-target")
        (w.tmp / "a" / "b" / "notes.txt").write_text("keep\n")
        return w.train("--name", name_of(w), out=out)

    return setup


def config_abs_name(w: Workspace) -> Setup:
    out, store = w.tmp / "out", w.store()
    victim = w.keep(w.tmp / "victim")
    cfg = _config(w, _run_cfg(w, store, out, f'name = "{victim}"\n'))
    return Setup(["train", "--config", cfg, "--quiet"], targets=[out, store])


def same_name_twice(w: Workspace) -> Setup:
    out = w.tmp / "out"
    first = w.run_copy(out / "dup")
    before = (first / "summary.json").read_bytes()

    def check(w: Workspace) -> None:
        assert (first / "summary.json").read_bytes() == before, "the first run was replaced"

    s = w.train("--name", "dup", "--partition", "iid", out=out)
    s.check = check
    return s


def same_command_twice(w: Workspace) -> Setup:
    s = w.train("--partition", "iid", "--seed", "3")
    first = runner.invoke(app, [str(a) for a in s.argv])
    assert first.exit_code == 0, first.output
    (done,) = [p for p in s.targets[0].iterdir() if (p / "summary.json").is_file()]
    before = {p.name: p.read_bytes() for p in done.iterdir() if p.is_file()}

    def check(w: Workspace) -> None:
        assert {p.name: p.read_bytes() for p in done.iterdir() if p.is_file()} == before, "first run changed"

    s.check = check
    return s


# ---------------------------------------------------------------------------------------- train: store defects
def deleted_chunk(w: Workspace) -> Path:
    path = w.store()
    chunks = sorted(p for p in (path / "train" / "features" / "c").rglob("*") if p.is_file())
    assert chunks, "no chunk files found under train/features/c"
    chunks[0].unlink()
    return path


def damaged_store(how: str) -> Callable[[Workspace], Setup]:
    """``train`` on a store damaged on disk: a truncated feature chunk, its text features' chunk deleted, its
    labels' chunk deleted, or its zarr.json cut short."""

    def setup(w: Workspace) -> Setup:
        path = w.store()
        if how == "meta":
            meta = path / "zarr.json"
            meta.write_bytes(meta.read_bytes()[:100])
        else:
            arr = {"truncated": "train/features", "text": "text/features", "labels": "train/labels"}[how]
            chunks = sorted(p for p in (path / arr / "c").rglob("*") if p.is_file())
            assert chunks, f"no chunk files under {arr}/c"
            if how == "truncated":
                chunks[0].write_bytes(chunks[0].read_bytes()[: chunks[0].stat().st_size // 2])
            else:
                chunks[0].unlink()
        return w.train("--partition", "iid", store=path, damaged=True)

    return setup


def missing_chunk_train(w: Workspace) -> Setup:
    return w.train("--partition", "iid", store=deleted_chunk(w), damaged=True)


def missing_chunk_info(w: Workspace) -> Setup:
    return Setup(["info", "--verify", deleted_chunk(w)])


def other_version(w: Workspace) -> Setup:
    path = w.store()
    _set_attr(path, format_version=99)
    return w.train("--partition", "iid", store=path, damaged=True)


def incomplete(w: Workspace) -> Setup:
    path = w.store()
    _set_attr(path, complete=False)
    return w.train("--partition", "iid", store=path, damaged=True)


def not_a_store(w: Workspace) -> Path:
    d = w.keep(w.tmp / "plain-dir")
    return d


# ---------------------------------------------------------------------------------------- interrupted runs
def resume_case(damage: Callable[[Path, Path], list] | None) -> Callable[[Workspace], Setup]:
    """``train --resume`` of a copy of the interrupted run, its checkpoint damaged by ``damage(ckpt, tmp)``
    (which returns marker files). The run's directory is the target; its config.toml must stay."""

    def setup(w: Workspace) -> Setup:
        run = w.partial()
        ckpt = run.parent / f".partial-{run.name}" / "checkpoint.safetensors"
        markers = damage(ckpt, w.tmp) if damage else []
        cfg = run.parent / f".partial-{run.name}" / "config.toml"
        before = cfg.read_bytes()

        def check(w: Workspace) -> None:
            assert cfg.read_bytes() == before, "the interrupted run's config.toml changed"

        return Setup(
            ["train", "--resume", run, "--quiet"], targets=[run.parent], markers=markers, check=check
        )

    return setup


def random_checkpoint(ckpt: Path, tmp: Path) -> list:
    ckpt.write_bytes(np.random.default_rng(2).bytes(4000))
    return []


def truncated_checkpoint(ckpt: Path, tmp: Path) -> list:
    data = ckpt.read_bytes()
    ckpt.write_bytes(data[: len(data) // 2])
    return []


def pickle_checkpoint(ckpt: Path, tmp: Path) -> list:
    """The checkpoint replaced by a torch pickle carrying the payload (safetensors must never unpickle)."""
    import torch

    marker = tmp / "pwned-resume"
    torch.save({"W": torch.zeros(2), "payload": Evil(marker)}, ckpt)
    return [marker]


def unfinished_exists(w: Workspace) -> Setup:
    """The interrupted run's command again, without --resume: refused, naming --resume."""
    run = w.partial()
    cfg = run.parent / f".partial-{run.name}" / "config.toml"
    return Setup(["train", "--config", cfg, "--out", run.parent, "--name", run.name, "--quiet"],
                 targets=[run.parent])  # fmt: skip


# ---------------------------------------------------------------------------------------- report
def report_case(damage: Callable[[Path], None]) -> Callable[[Workspace], Setup]:
    def setup(w: Workspace) -> Setup:
        runs = w.tmp / "runs"
        bad = w.run_copy(runs / "bad")
        damage(bad)
        return Setup(["report", runs], targets=[])

    return setup


def truncate_summary(run: Path) -> None:
    s = run / "summary.json"
    s.write_bytes(s.read_bytes()[: len(s.read_bytes()) // 2])


def empty_summary(run: Path) -> None:
    (run / "summary.json").write_bytes(b"")


def drop_metrics(run: Path) -> None:
    (run / "metrics.jsonl").unlink()


# ---------------------------------------------------------------------------------------- encode inputs
def corrupt_cifar(w: Workspace) -> Setup:
    root = w.cifar()
    (root / "data_batch_1").write_bytes(np.random.default_rng(0).bytes(3000))
    return w.encode(root=root)


def malicious_cifar(w: Workspace) -> Setup:
    root = w.cifar()
    marker = w.tmp / "pwned-cifar"
    evil_pickle(root / "data_batch_1", marker)
    s = w.encode(root=root)
    s.markers.append(marker)
    return s


def malicious_checkpoint(w: Workspace) -> Setup:
    marker = w.tmp / "pwned-ckpt"
    ck = w.tmp / "evil.pt"
    evil_checkpoint(ck, w.clip["tc"].weights_pt, marker)
    s = w.encode(pretrained=ck)
    s.markers.append(marker)
    return s


def corrupt_checkpoint(w: Workspace) -> Setup:
    ck = w.tmp / "random.pt"
    ck.write_bytes(np.random.default_rng(1).bytes(5000))
    return w.encode(pretrained=ck)


def truncated_safetensors(w: Workspace) -> Setup:
    ck = w.tmp / "cut.safetensors"
    data = Path(w.clip["tc"].weights).read_bytes()
    ck.write_bytes(data[: len(data) // 3])
    return w.encode(pretrained=ck)


# ---------------------------------------------------------------------------------------- the table
@dataclass
class Case:
    id: str
    setup: Callable[[Workspace], Setup]
    problem: tuple  # regexes the error line must match (what is wrong)
    fix: tuple = ()  # regexes the error line must match (what to do)
    sub: bool = False  # run in a fresh interpreter (what a user sees) instead of in-process
    forbid: tuple = ()  # regexes the line must not match (advice that would hurt)


def C(id, setup, problem, fix=(), sub=False, forbid=()) -> Case:
    def as_tuple(x) -> tuple:
        return (x,) if isinstance(x, str) else tuple(x)

    return Case(id, setup, as_tuple(problem), as_tuple(fix), sub, as_tuple(forbid))


UNSAFE_ADVICE = r"weights_only.{0,20}false"
CORRUPT = r"corrupt|truncat|unreadable|damaged|invalid|not a (valid|readable)|cannot (be )?read|incomplete"
T = Workspace.train  # shorthand: ``lambda w: T(w, *flags)``

# fmt: off
CASES = [
    # ---- defect 1: a run name is one path component
    C("name-dotdot", name_case(lambda w: ".."), r"name", r"--name", sub=True),
    C("name-absolute", name_case(lambda w: str(w.tmp / "abs-target")), r"name", r"--name"),
    C("name-up-up", name_case(lambda w: "../../x"), r"name", r"--name"),
    C("name-empty", name_case(lambda w: ""), r"name", r"--name"),
    C("name-slash", name_case(lambda w: "a/b"), r"name", r"--name"),
    C("config-absolute-name", config_abs_name, r"name", r"name"),
    # ---- defect 2: the same name twice
    C("name-exists", same_name_twice, r"dup", r"--overwrite"),
    C("same-command-twice", same_command_twice, r"exists", r"--overwrite"),
    # ---- interrupted runs and their checkpoints
    C("resume-random-checkpoint", resume_case(random_checkpoint), r"checkpoint", r"--overwrite"),
    C("resume-truncated-checkpoint", resume_case(truncated_checkpoint), r"checkpoint", r"--overwrite"),
    C("resume-pickle-checkpoint", resume_case(pickle_checkpoint), r"checkpoint", r"--overwrite"),
    C("resume-missing-run", lambda w: Setup(["train", "--resume", w.tmp / "runs" / "nope", "--quiet"]),
      r"no unfinished run", r"--all|report"),
    C("resume-finished-run", lambda w: Setup(["train", "--resume", w.run_copy(w.tmp / "runs" / "done"),
      "--quiet"]), r"finished"),
    C("unfinished-run-exists", unfinished_exists, r"unfinished", r"--resume"),
    C("checkpoint-every-negative", lambda w: T(w, "--checkpoint-every", "-1"), r"--checkpoint-every",
      r">= ?0"),
    # ---- defect 4: non-finite features and hyperparameters
    C("nan-train-features", lambda w: T(w, "--partition", "iid", store=_nan_store(w, "train"), damaged=True),
      (r"train", r"features", r"\b5\b", r"nan|finite"), r"rebuild|re-?encode|--force"),
    C("inf-text-features", lambda w: T(w, "--partition", "iid", store=_nan_store(w, "text"), damaged=True),
      (r"text", r"features", r"inf|finite"), r"rebuild|re-?encode|--force"),
    C("set-lr-nan", lambda w: T(w, "--set", "lr=nan"), r"\blr\b", r"finite"),
    C("set-logit-scale-inf", lambda w: T(w, "--set", "logit_scale=inf"), r"logit_scale", r"finite"),
    # ---- defect 5: a deleted chunk file
    C("missing-chunk-train", missing_chunk_train, (r"train", r"chunk|missing"), r"rebuild|re-?encode|--force"),
    C("missing-chunk-info-verify", missing_chunk_info, (r"train", r"chunk|missing"), r"rebuild|re-?encode|--force"),
    C("truncated-chunk-train", damaged_store("truncated"), (r"train/features", r"chunk|decode|checksum"),
      r"rebuild|--force"),
    C("missing-text-chunk-train", damaged_store("text"), (r"text", r"chunk|missing|checksum"), r"rebuild|--force"),
    C("missing-labels-chunk-train", damaged_store("labels"), (r"labels", r"missing|checksum"), r"rebuild|--force"),
    C("store-metadata-cut-short", damaged_store("meta"), r"store\.zarr", r"rebuild|--force|synth|encode"),
    # ---- unknown names
    C("unknown-method", lambda w: T(w, method="nope"), r"unknown method 'nope'", r"fedavg"),
    C("unknown-partition", lambda w: T(w, "--partition", "nope"), r"nope", r"dirichlet"),
    C("unknown-kernel", lambda w: T(w, "--kernel", "nope"), r"kernel", r"torch"),
    C("unknown-engine", lambda w: T(w, "--engine", "nope"), r"engine", r"batched|loop"),
    C("unknown-device", lambda w: T(w, "--device", "tpu"), r"device", r"cpu"),
    # ---- bad --set
    C("set-no-equals", lambda w: T(w, "--set", "lr"), r"--set", r"key=value"),
    C("set-unknown-key", lambda w: T(w, "--set", "lrr=1"), r"lrr", r"valid"),
    C("set-lr-abc", lambda w: T(w, "--set", "lr=abc"), r"abc", r"float|number"),
    C("set-lr-negative", lambda w: T(w, "--set", "lr=-1"), r"\blr\b", r"> ?0|positive"),
    C("set-batch-size-zero", lambda w: T(w, "--set", "batch_size=0"), r"batch_size", r">= ?1"),
    C("set-batch-size-fraction", lambda w: T(w, "--set", "batch_size=1.5"), r"1\.5", r"int"),
    C("set-momentum-negative", lambda w: T(w, "--set", "momentum=-1"), r"momentum", r">=? ?0|\[0"),
    C("set-sampling-maybe", lambda w: T(w, "--set", "sampling=maybe", method="fst-cbdg"), r"sampling",
      r"bool|true|false"),
    # ---- partition parameters through train
    C("alpha-zero", lambda w: T(w, "--alpha", "0"), r"alpha", r"positive|> ?0"),
    C("alpha-negative", lambda w: T(w, "--alpha", "-1"), r"alpha", r"positive|> ?0"),
    C("alpha-nan", lambda w: T(w, "--alpha", "nan"), r"alpha", r"finite|positive|> ?0"),
    C("imbalance-factor-below-one", lambda w: T(w, "--imbalance-factor", "0.5"), r"imbalance", r">= ?1"),
    C("clients-zero", lambda w: T(w, "--clients", "0"), r"clients", r">= ?1|at least|positive"),
    C("clients-more-than-samples", lambda w: T(w, "--partition", "iid", "--clients", "100000"),
      r"clients", r"at most"),
    C("shards-do-not-divide", lambda w: T(w, "--partition", "shard", "--shards", "3", "--clients", "7"),
      r"shard", r"multiple|choose"),
    C("shards-zero", lambda w: T(w, "--partition", "shard", "--shards", "0"), r"shards", r">= ?1"),
    C("participation-zero", lambda w: T(w, "--participation", "0"), r"participation", r"\(0, ?1\]",
      sub=True),
    C("participation-above-one", lambda w: T(w, "--participation", "1.5"), r"participation", r"\(0, ?1\]"),
    C("participation-negative", lambda w: T(w, "--participation", "-0.1"), r"participation",
      r"\(0, ?1\]"),
    C("rounds-negative", lambda w: T(w, "--rounds", "-1"), r"rounds", r">= ?0"),
    C("shot-thresholds-garbage", lambda w: T(w, "--shot-thresholds", "many"), r"shot.thresholds",
      r"1500,200"),
    # ---- stores
    C("store-missing", lambda w: T(w, store=w.tmp / "nope.zarr"), r"no store", r"fedfeat synth"),
    C("store-not-a-store", lambda w: T(w, store=not_a_store(w)), r"not a fedfeat store",
      r"fedfeat synth|fedfeat encode"),
    C("store-other-format-version", other_version, r"format version 99", r"--force"),
    C("store-incomplete", incomplete, r"incomplete", r"re-run|resume"),
    # ---- config files
    C("config-wrong-type", lambda w: Setup(["train", "--config", _config(w, _run_cfg(
        w, w.store(), w.tmp / "out").replace("rounds = 1", 'rounds = "ten"')), "--quiet"],
        targets=[w.tmp / "out", w.tmp / "store.zarr"]), r"rounds", r"int"),
    C("config-is-directory", lambda w: Setup(["train", "--config", w.keep(w.tmp / "cfgdir"), "--quiet"]),
      r"config", r"file|toml"),
    C("config-missing", lambda w: Setup(["train", "--config", w.tmp / "none.toml", "--quiet"]),
      r"not found", r"config"),
    C("config-invalid-toml", lambda w: Setup(["train", "--config", _config(w, "[run]\nrounds = = 3\n"),
      "--quiet"]), r"not valid TOML", r"config"),
    C("config-unknown-key", lambda w: Setup(["train", "--config", _config(w, "[run]\nbogus = 1\n"),
      "--quiet"]), r"bogus", r"valid"),
    C("config-params-wrong-type", lambda w: Setup(["train", "--config", _config(w, _run_cfg(
        w, w.store(), w.tmp / "out") + '[params]\nlr = "fast"\n'), "--quiet"],
        targets=[w.tmp / "out", w.tmp / "store.zarr"]), r"\blr\b", r"float"),
    C("config-dotdot-name", lambda w: Setup(["train", "--config", _config(w, _run_cfg(
        w, w.store(), w.tmp / "a" / "out", 'name = ".."\n')), "--quiet"],
        targets=[w.tmp / "a" / "out", w.tmp / "store.zarr"]), r"name", r"name"),
    C("out-is-a-file", lambda w: T(w, out=_config(w, "not a dir\n", "outfile")), r"--out",
      r"directory"),
    # ---- partition command
    C("partition-export-missing-dir", lambda w: Setup(["partition", w.store(), "--scheme", "iid",
      "--clients", "4", "--export", w.tmp / "nodir" / "p.json"], targets=[w.tmp / "store.zarr"]),
      r"nodir", r"creat|director"),
    C("partition-alpha-zero", lambda w: Setup(["partition", w.store(), "--alpha", "0", "--clients", "4"],
      targets=[w.tmp / "store.zarr"]), r"alpha", r"positive"),
    C("partition-unknown-scheme", lambda w: Setup(["partition", w.store(), "--scheme", "nope"],
      targets=[w.tmp / "store.zarr"]), r"nope", r"dirichlet"),
    C("partition-clients-zero", lambda w: Setup(["partition", w.store(), "--scheme", "iid", "--clients",
      "0"], targets=[w.tmp / "store.zarr"]), r"clients", r">= ?1|at least"),
    C("partition-shards-do-not-divide", lambda w: Setup(["partition", w.store(), "--scheme", "shard",
      "--shards", "3", "--clients", "7"], targets=[w.tmp / "store.zarr"]), r"shard", r"multiple"),
    C("partition-imbalance-zero", lambda w: Setup(["partition", w.store(), "--scheme", "iid", "--clients",
      "4", "--imbalance-factor", "0"], targets=[w.tmp / "store.zarr"]), r"imbalance", r">= ?1"),
    C("partition-unknown-split", lambda w: Setup(["partition", w.store(), "--scheme", "iid", "--clients",
      "4", "--split", "nope"], targets=[w.tmp / "store.zarr"]), r"nope", r"train"),
    # ---- info
    C("info-not-a-store", lambda w: Setup(["info", not_a_store(w)]), r"not a fedfeat store",
      r"fedfeat synth|fedfeat encode"),
    C("info-missing", lambda w: Setup(["info", w.tmp / "nope.zarr"]), r"no store", r"fedfeat synth"),
    # ---- synth
    C("synth-classes-zero", lambda w: Setup(["synth", "--out", w.tmp / "s.zarr", "--classes", "0",
      "--no-stats"], targets=[w.tmp / "s.zarr"], check=lambda w: _nothing_created(w.tmp / "s.zarr")),
      r"classes", r">= ?[12]|at least"),
    C("synth-dim-zero", lambda w: Setup(["synth", "--out", w.tmp / "s.zarr", "--dim", "0", "--no-stats"],
      targets=[w.tmp / "s.zarr"], check=lambda w: _nothing_created(w.tmp / "s.zarr")), r"dim",
      r">= ?1|at least|positive"),
    C("synth-onto-plain-dir", lambda w: Setup(["synth", "--out", w.keep(w.tmp / "mine"), "--classes", "2",
      "--dim", "8", "--no-stats"]), r"mine", r"--out|--force"),
    C("synth-force-onto-plain-dir", lambda w: Setup(["synth", "--out", w.keep(w.tmp / "mine"), "--force",
      "--classes", "2", "--dim", "8", "--no-stats"]), r"not a (fedfeat )?store", r"--out"),
    C("synth-onto-file", lambda w: Setup(["synth", "--out", _config(w, "x\n", "file.zarr"), "--classes",
      "2", "--dim", "8", "--no-stats"]), r"file\.zarr", r"--out|--force"),
    # ---- encode
    C("encode-root-missing", lambda w: w.encode(root=w.tmp / "no-such-root"), r"no-such-root",
      r"expected|cifar-10-batches-py"),
    C("encode-unknown-dataset", lambda w: w.encode(dataset="mnist"), r"mnist", r"cifar10"),
    C("encode-unknown-backbone", lambda w: w.encode(backbone="NopeNet-9"), r"NopeNet-9",
      r"ViT|RN50|open_clip"),
    C("encode-unknown-device", lambda w: w.encode_flag("--device", "tpu"), r"tpu", r"cpu"),
    C("encode-unknown-templates", lambda w: w.encode_flag("--templates", "no-such-set"), r"no-such-set",
      r"cifar|\{\}"),
    C("encode-empty-imagefolder", lambda w: w.encode(dataset="imagefolder", root=w.keep(w.tmp / "imgs")),
      r"imgs", r"expected"),
    C("encode-workers-negative", lambda w: w.encode_flag("--workers", "-1"), r"--workers", r">= ?0"),
    C("encode-batch-size-zero", lambda w: w.encode_flag("--batch-size", "0"), r"--batch-size", r">= ?1"),
    C("encode-chunk-rows-zero", lambda w: w.encode_flag("--chunk-rows", "0"), r"--chunk-rows", r">= ?1"),
    C("encode-unknown-precision", lambda w: w.encode_flag("--precision", "fp8"), r"fp8", r"fp32"),
    C("encode-corrupt-cifar-pickle", corrupt_cifar, r"data_batch_1", r"re-extract|re-download|archive"),
    C("encode-malicious-cifar-pickle", malicious_cifar, r"data_batch_1", r"re-extract|archive", sub=True),
    C("encode-pretrained-missing", lambda w: w.encode(pretrained=w.tmp / "nope.safetensors"),
      r"nope\.safetensors", r"not found|--pretrained"),
    # a checkpoint that would run code is refused as such; the fix is a trusted/safetensors file, and the line
    # never advises loading it with weights_only=False (torch's own message does)
    C("encode-malicious-checkpoint", malicious_checkpoint, (r"evil\.pt", r"refus|unsafe|run code|not allowed"),
      r"safetensors|trusted|--pretrained",
      forbid=UNSAFE_ADVICE),
    # random bytes are a damaged file, not an attack: the line says so (and does not call it code)
    C("encode-corrupt-checkpoint", corrupt_checkpoint, (r"random\.pt", CORRUPT),
      r"--pretrained|--backbone|re-?download", forbid=(UNSAFE_ADVICE, r"run code|malicious")),
    C("encode-truncated-safetensors", truncated_safetensors, (r"cut\.safetensors", CORRUPT),
      r"--pretrained|--backbone|re-?download", forbid=UNSAFE_ADVICE),
    # ---- report: no readable run
    C("report-only-truncated-summary", report_case(truncate_summary), r"summary\.json", r"no .*run",
      sub=True),
    C("report-only-empty-summary", report_case(empty_summary), r"summary\.json", r"no .*run"),
    C("report-only-no-metrics", report_case(drop_metrics), r"metrics\.jsonl", r"no .*run"),
    C("report-empty-dir", lambda w: Setup(["report", w.keep(w.tmp / "noruns")]), r"no (readable )?finished runs",
      r"fedfeat train|path"),
    C("report-missing-path", lambda w: Setup(["report", w.tmp / "nowhere"]), r"nowhere",
      r"no .*run|not found|exist"),
    C("report-unknown-format", lambda w: Setup(["report", w.run_copy(w.tmp / "runs" / "r"), "--format",
      "xml"]), r"xml", r"markdown|csv"),
]
# fmt: on


# ---------------------------------------------------------------------------------------- the harness
def snapshot(root: Path, skip: list[Path]) -> dict:
    """Every path under ``root`` outside ``skip``: files with (size, mtime_ns), directories as 'dir'."""
    skip = [Path(s).resolve() for s in skip]
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        d = Path(dirpath).resolve()
        dirnames[:] = [n for n in dirnames if (d / n) not in skip]
        for n in dirnames:
            out[str((d / n).relative_to(root.resolve()))] = "dir"
        for n in filenames:
            p = d / n
            if p in skip:
                continue
            st = p.lstat()
            out[str(p.relative_to(root.resolve()))] = (st.st_size, st.st_mtime_ns)
    return out


def complete_things(roots: list[Path]) -> dict:
    """What looks complete under ``roots``: summary.json files and stores whose complete flag is set
    (path -> bytes), and leftovers of half-written work (.tmp-*, .lock-*, .partial-*, .old-*)."""
    found = {}
    for r in roots:
        r = Path(r)
        if not r.exists():
            continue
        for p in [r, *r.rglob("*")]:
            if p.name == "summary.json" and p.is_file():
                found[str(p)] = p.read_bytes()
            elif p.name == "zarr.json" and p.is_file():
                try:
                    if json.loads(p.read_text()).get("attributes", {}).get("complete") is True:
                        found[str(p)] = "complete store"
                except ValueError:
                    pass
            elif p.name.startswith((".tmp-", ".lock-", ".partial-", ".old-")):
                found[str(p)] = "leftover"
    return found


def run_cli(argv: list, sub: bool, cwd: Path) -> tuple[int, str]:
    argv = [str(a) for a in argv]
    if sub:
        p = subprocess.run(
            [sys.executable, "-m", "fedfeat", *argv],
            cwd=cwd,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        return p.returncode, p.stdout + p.stderr
    r = runner.invoke(app, argv)
    out = r.output
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        import traceback

        out += "\nTraceback (from CliRunner):\n" + "".join(traceback.format_exception(r.exception))
    return r.exit_code, out


def assert_refused(case: Case, code: int, output: str) -> None:
    shown = f"[{case.id}] exit {code}, output:\n{output[-3000:]}"
    assert code != 0, shown
    assert "Traceback" not in output, shown
    lines = [ln for ln in output.splitlines() if ln.strip()]
    assert len(lines) == 1, "not one line: " + shown
    line = lines[0]
    assert line.startswith("error: "), shown
    for pat in case.problem:
        assert re.search(pat, line, re.IGNORECASE), f"the line does not name the problem ({pat!r}): {shown}"
    for pat in case.fix:
        assert re.search(pat, line, re.IGNORECASE), f"the line does not name the fix ({pat!r}): {shown}"
    for pat in case.forbid:
        assert not re.search(pat, line, re.IGNORECASE), f"the line gives harmful advice ({pat!r}): {shown}"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_refused(case: Case, base, tmp_path, request, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a default path (runs/, cache/) would land under tmp_path, and be seen
    w = Workspace(tmp_path, base, request)
    s = case.setup(w)
    targets = [Path(t) for t in s.targets]
    before = snapshot(tmp_path, targets)
    done_before = complete_things(targets)
    code, output = run_cli(s.argv, case.sub, cwd=tmp_path)
    print(f"[{case.id}] exit {code}:\n{output}")  # shown with -rP, and on failure
    for m in s.markers:
        assert not Path(m).exists(), f"[{case.id}] the malicious input ran code: {m} exists"
    assert_refused(case, code, output)
    after = snapshot(tmp_path, targets)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"[{case.id}] touched outside its targets: {changed[:20]}"
    done_after = complete_things(targets)
    new = sorted(k for k, v in done_after.items() if done_before.get(k) != v)
    assert not new, f"[{case.id}] left something looking complete (or half-written): {new}"
    if s.check is not None:
        s.check(w)


def test_the_table_is_big_enough():
    assert len(CASES) >= 45 and len({c.id for c in CASES}) == len(CASES)


# ---------------------------------------------------------------------------------------- report: skip, warn
@pytest.mark.parametrize(
    "damage, file",
    [(truncate_summary, "summary.json"), (empty_summary, "summary.json"), (drop_metrics, "metrics.jsonl")],
    ids=["truncated", "empty", "no-metrics"],
)
def test_report_skips_an_unreadable_run_with_one_warning(damage, file, base, tmp_path):
    """Beside a readable run, an unreadable one is skipped with one warning line naming it and its file; the
    table of the readable run follows, exit status 0."""
    runs = tmp_path / "runs"
    shutil.copytree(base["run"], runs / "good")
    shutil.copytree(base["run"], runs / "bad")
    damage(runs / "bad")
    r = runner.invoke(app, ["report", str(runs)])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    assert r.exit_code == 0, r.output
    assert "Traceback" not in r.output
    warnings = [ln for ln in r.output.splitlines() if ln.strip() and "|" not in ln]
    assert len(warnings) == 1, r.output
    assert re.search(r"warn|skip", warnings[0], re.IGNORECASE) and "bad" in warnings[0], r.output
    assert file in warnings[0], r.output
    assert "| zeroshot |" in r.output  # the readable run is reported


# ---------------------------------------------------------------------------------------- the payloads are live
def test_the_malicious_payloads_would_run(clip, tmp_path):
    """The malicious files of the table do run code when loaded naively: their refusal is what protects."""
    import torch

    m1, m2 = tmp_path / "m1", tmp_path / "m2"
    evil_pickle(tmp_path / "batch", m1)
    pickle.loads((tmp_path / "batch").read_bytes())
    assert m1.exists()
    evil_checkpoint(tmp_path / "evil.pt", clip["tc"].weights_pt, m2)
    torch.load(tmp_path / "evil.pt", weights_only=False)
    assert m2.exists()
