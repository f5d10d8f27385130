"""Runs: resolve a run's configuration, train, write the run directory, compare runs.

A run directory (``runs/<name>/``) holds:

* ``config.toml``   the resolved configuration; ``fedfeat train --config runs/<name>/config.toml`` replays it;
* ``metrics.jsonl`` one JSON object per round (round 0 = before training): test accuracy, per-class accuracy,
  many/medium/few-shot accuracy, pseudo-label accuracy (label-free methods), mean train loss, bytes up and
  down, seconds, the sampled clients;
* ``summary.json``  final and best accuracy, totals, the environment; written last;
* ``curve.png``     test accuracy vs round;
* ``weights.safetensors``  the final global parameters (safetensors: loading it cannot execute code);
* ``{dataset}_{pretrained}_{model}_en_zeroshot_classification.json``  (``zeroshot`` runs) the result in
  CLIP_benchmark's schema (``fedfeat.report.clipbench``), written by the method's ``run_files`` hook.

The directory is written under a temporary name and renamed when complete, so a crashed run never looks
finished.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tomllib
import torch

from fedfeat.runs import rundir
from fedfeat.engine.rounds import check_labels, resolve_device, resolve_kernel
from fedfeat.errors import FedfeatError

DEFAULTS = {
    "method": "fst-cbdg",
    "store": "cache/synth-cifar10.zarr",
    "partition": "dirichlet",
    "alpha": None,
    "shards": None,
    "imbalance_factor": None,
    "partition_seed": None,
    "clients": 100,
    "participation": 0.1,
    "rounds": 10,
    "seed": 0,
    "engine": "batched",
    "kernel": "auto",
    "device": "auto",
    "out": "runs",
    "name": None,
    "shot_thresholds": None,
    "shots": None,
    "local_val": None,
    "query_val": None,
    "store_fingerprint": None,
    "preset": None,
    "pretrained": None,
    "local_test": None,
    "eval_every": 1,
}
TYPES = {
    "alpha": float,
    "imbalance_factor": float,
    "participation": float,
    "shards": int,
    "partition_seed": int,
    "clients": int,
    "rounds": int,
    "seed": int,
    "shots": int,
    "eval_every": int,
}  # every other key is a string
# settings that do not enter a run's identity hash (the name shows them, or they say where, not what)
NOT_IN_HASH = ("method", "store", "out", "name", "seed", "store_fingerprint", "params", "pretrained")


@dataclass
class RunConfig:
    """A run's settings (``fedfeat train``'s flags); every field has the CLI's default."""

    method: str = DEFAULTS["method"]
    store: str = DEFAULTS["store"]
    partition: str = DEFAULTS["partition"]
    clients: int = DEFAULTS["clients"]
    participation: float = DEFAULTS["participation"]
    rounds: int = DEFAULTS["rounds"]
    seed: int = DEFAULTS["seed"]
    engine: str = DEFAULTS["engine"]
    kernel: str = DEFAULTS["kernel"]
    device: str = DEFAULTS["device"]
    out: str = DEFAULTS["out"]
    alpha: float | None = None
    shards: int | None = None
    imbalance_factor: float | None = None
    partition_seed: int | None = None
    name: str | None = None
    shot_thresholds: str | None = None  # "many,few" counts, e.g. "1500,200" (CIFAR-10-LT) or "100,20"
    shots: int | None = None  # disjoint-classes: samples per client class (default 10)
    local_val: str | None = None  # open vocabulary: clients' train/validation split, paper | code | none
    query_val: str | None = None  # open vocabulary: query set's validation part, paper | code
    store_fingerprint: str | None = None  # a replayed config's store must have this fingerprint hash
    preset: str | None = (
        None  # a dataset preset (fedfeat.partition.openvocab.PRESETS): its settings, its class count checked
    )
    eval_every: int = DEFAULTS["eval_every"]  # evaluate at round 0, every N-th round and the last
    local_test: str | None = None  # none | proportional | joint: per-client test splits (FedCoPL)
    pretrained: str | None = (
        None  # prompt methods: where the store's checkpoint is (default: where encode read it)
    )
    params: dict = field(default_factory=dict)  # method hyperparameters (--set key=value)


def parse_sets(sets: list[str] | None) -> dict:
    out = {}
    for s in sets or []:
        if "=" not in s:
            raise FedfeatError(f"--set expects key=value, got {s!r}; e.g. --set lr=0.01")
        k, v = s.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def _check_types(run: dict, where: str) -> None:
    for k, v in run.items():
        if v is None:
            continue
        want = TYPES.get(k, str)
        ok = isinstance(v, want) and not isinstance(v, bool)
        if want is float:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
        if not ok:
            example = {"float": "0.5", "int": "10"}.get(want.__name__, '"text"')
            raise FedfeatError(f"{where}: {k} = {v!r} must be a {want.__name__} (e.g. {k} = {example})")


def _read_config(config_file: Path) -> dict:
    path = Path(config_file)
    if path.is_dir():
        raise FedfeatError(
            f"--config {path} is a directory; pass a config.toml file (e.g. {path}/config.toml)"
        )
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise FedfeatError(f"config file {path} not found; pass the config.toml of a run") from None
    except (OSError, UnicodeDecodeError) as e:
        raise FedfeatError(f"cannot read config file {path}: {e}; pass a TOML text file") from None
    except tomllib.TOMLDecodeError as e:
        raise FedfeatError(f"config file {path} is not valid TOML: {e}; fix the line it names") from None


def resolve_config(cli: dict, config_file: Path | None, sets: list[str] | None) -> RunConfig:
    """Defaults <- config file <- explicit flags (``None`` in ``cli`` means "not given").

    A config file's ``store_fingerprint`` is kept only when ``--store`` is not given: replaying a run checks that
    its store is the same, while pointing the run at another store on purpose does not."""
    merged = dict(DEFAULTS)
    params: dict = {}
    if config_file is not None:
        data = _read_config(config_file)
        run = data.get("run", data)
        if not isinstance(run, dict):
            raise FedfeatError(f"config file {config_file}: [run] must be a table of settings")
        unknown = set(run) - set(DEFAULTS) - {"method_params", "params"}
        if unknown:
            raise FedfeatError(
                f"config file {config_file}: unknown keys {sorted(unknown)}; valid: {sorted(DEFAULTS)}"
            )
        run = {k: v for k, v in run.items() if k in DEFAULTS}
        _check_types(run, f"config file {config_file}")
        merged.update(run)
        if not isinstance(data.get("params", {}), dict):
            raise FedfeatError(f"config file {config_file}: [params] must be a table of key = value")
        params.update(data.get("params", {}))
    given = {k: v for k, v in cli.items() if v is not None}
    unknown = sorted(set(given) - set(DEFAULTS))
    if unknown:
        raise FedfeatError(
            f"unknown run settings {unknown}; valid: {sorted(k for k in DEFAULTS if k != 'store_fingerprint')}"
        )
    _check_types(given, "flags")
    preset = given.get("preset", merged.get("preset"))
    if preset is not None:  # the preset's settings, under anything the config file or the flags say
        from fedfeat.partition.openvocab import PRESET_RUN, PRESETS

        if preset not in PRESETS:
            raise FedfeatError(f"unknown preset '{preset}'; known presets: {', '.join(PRESETS)}")
        base = {**PRESET_RUN, "partition_seed": PRESETS[preset]["seed"]}
        file_keys = set(run) if config_file is not None else set()
        merged.update({k: v for k, v in base.items() if k not in file_keys})
    if "store" in given:
        merged["store_fingerprint"] = None
    merged.update(given)
    params.update(parse_sets(sets))
    cfg = RunConfig(**merged, params=params)
    validate_config(cfg)
    return cfg


def validate_config(cfg: RunConfig) -> None:
    """Range checks of the run's own settings (the method checks its hyperparameters, the partition its own)."""

    def bad(flag: str, what: str) -> None:
        raise FedfeatError(f"--{flag.replace('_', '-')} {what}")

    if cfg.clients < 1:
        bad("clients", f"must be >= 1, got {cfg.clients}")
    if not (math.isfinite(cfg.participation) and 0 < cfg.participation <= 1):
        bad("participation", f"must be in (0, 1], got {cfg.participation} (e.g. 0.1 for 10 % of the clients)")
    if cfg.rounds < 0:
        bad("rounds", f"must be >= 0, got {cfg.rounds}")
    if cfg.eval_every < 1:
        bad("eval_every", f"must be >= 1, got {cfg.eval_every} (1: evaluate every round)")
    if cfg.alpha is not None and not (math.isfinite(cfg.alpha) and cfg.alpha > 0):
        bad("alpha", f"must be a finite number > 0, got {cfg.alpha} (e.g. 0.1 or 0.5)")
    if cfg.imbalance_factor is not None and not (
        math.isfinite(cfg.imbalance_factor) and cfg.imbalance_factor >= 1
    ):
        bad("imbalance_factor", f"must be a finite number >= 1, got {cfg.imbalance_factor} (e.g. 100)")
    if cfg.shards is not None and cfg.shards < 1:
        bad("shards", f"must be >= 1, got {cfg.shards}")
    if cfg.shots is not None and cfg.shots < 1:
        bad("shots", f"must be >= 1, got {cfg.shots} (Fed-MP: 10)")
    from fedfeat.partition.openvocab import check_modes

    check_modes(cfg.local_val or "paper", cfg.query_val or "paper")
    from fedfeat.partition.schemes import LOCAL_TEST

    if (cfg.local_test or "none") not in LOCAL_TEST:
        bad("local_test", f"must be one of {', '.join(LOCAL_TEST)}, got {cfg.local_test!r}")
    if cfg.name is not None:
        rundir.check_name(cfg.name)


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and not math.isfinite(v):
        return {math.inf: "inf", -math.inf: "-inf"}.get(v, "nan")
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))


def config_toml(cfg: RunConfig, method_params: dict) -> str:
    """The resolved configuration as TOML (``None`` values are left out: TOML has no null)."""
    lines = ["# fedfeat run configuration; replay with: fedfeat train --config THIS_FILE", "[run]"]
    for k, v in dataclasses.asdict(cfg).items():
        if k == "params" or v is None:
            continue
        lines.append(f"{k} = {_toml_value(v)}")
    lines.append("")
    lines.append("[params]  # every hyperparameter of the method, resolved")
    for k, v in method_params.items():
        if v is not None:
            lines.append(f"{k} = {_toml_value(v)}")
    return "\n".join(lines) + "\n"


def shot_groups(train_counts: np.ndarray, thresholds: str | None) -> dict[str, np.ndarray] | None:
    """Many / medium / few class groups by training-sample count (CLIP2FL's CIFAR-10-LT thresholds:
    many > 1500, few < 200; ImageNet-LT's: "100,20"). ``None`` when no thresholds are set."""
    if not thresholds:
        return None
    try:
        hi, lo = (float(t) for t in thresholds.split(","))
    except ValueError:
        raise FedfeatError(
            f"shot_thresholds must be 'many,few' counts such as 1500,200; got {thresholds!r}"
        ) from None
    c = np.asarray(train_counts)
    return {
        "many": np.flatnonzero(c > hi),
        "medium": np.flatnonzero((c >= lo) & (c <= hi)),
        "few": np.flatnonzero(c < lo),
    }


def default_thresholds(cfg: RunConfig, data) -> str | None:
    """Long-tailed runs report many / medium / few without ``--shot-thresholds``: CLIP2FL's CIFAR-10-LT groups
    (> 1500, < 200) for 10 classes, the CIFAR-100-LT / ImageNet-LT ones (> 100, < 20) otherwise."""
    if cfg.imbalance_factor is None:
        return None
    return "1500,200" if len(data.class_names) <= 10 else "100,20"


def group_accuracy(per_class_acc: list[float], test_counts: np.ndarray, groups: dict) -> dict:
    """Accuracy over the test samples of each class group (sample-weighted)."""
    pc = np.asarray(per_class_acc)
    out = {}
    for g, idx in groups.items():
        n = test_counts[idx].sum()
        out[f"{g}_acc"] = float((pc[idx] * test_counts[idx]).sum() / n) if n else None
    return out


def settings_hash(cfg: RunConfig, method_params: dict, method_defaults: dict) -> str:
    """8 hex digits of a sha256 over the settings that differ from the defaults (run settings other than those
    the name shows, method hyperparameters) and the store's fingerprint: stable across replays."""
    run = {
        k: v
        for k, v in dataclasses.asdict(cfg).items()
        if k not in NOT_IN_HASH and v is not None and v != DEFAULTS.get(k)
    }
    params = {k: v for k, v in method_params.items() if method_defaults.get(k, v) != v}
    blob = json.dumps(
        {"run": run, "params": params, "store": cfg.store_fingerprint}, sort_keys=True, default=str
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:8]


def store_label(store_path: str | Path, attrs: dict) -> str:
    """A short readable name for a store: its directory name, prefixed by its dataset where that says more
    (``encode`` puts stores at ``cache/<dataset>/<backbone>-<weights>.zarr``)."""
    p = Path(store_path)
    stem = p.name[: -len(".zarr")] if p.name.endswith(".zarr") else p.name
    ds = attrs.get("dataset")
    if isinstance(ds, str) and ds not in ("synthetic", "") and ds not in stem:
        stem = f"{ds}-{stem}"
    return re.sub(r"[^A-Za-z0-9._+=-]+", "_", stem).strip("._")[:48] or "store"


def default_run_name(
    cfg: RunConfig, method_params: dict, method_defaults: dict, store_attrs: dict, part_key: str
) -> str:
    """``method__store__partition__seedS__hash``: what a run is, in a name that stays short (the hash stands for
    every other non-default setting; ``config.toml`` has them all)."""
    h = settings_hash(cfg, method_params, method_defaults)
    return f"{cfg.method}__{store_label(cfg.store, store_attrs)}__{part_key}__seed{cfg.seed}__{h}"


def _provenance() -> dict:
    """fedfeat's version, the git commit when run from a checkout (``+dirty`` with local changes), the command."""
    import fedfeat

    out = {"fedfeat": fedfeat.__version__, "command": shlex.join(sys.argv), "cwd": os.getcwd()}
    repo = Path(fedfeat.__file__).resolve().parent.parent
    if (repo / ".git").exists():
        try:
            head = subprocess.run(
                ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
            ).stdout.strip()
            dirty = subprocess.run(
                ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            if head:
                out["git_commit"] = head + ("+dirty" if dirty else "")
        except (OSError, subprocess.SubprocessError):
            pass
    return out


def open_store(cfg: RunConfig):
    """The run's store, read-only; a replayed config's store must have the recorded fingerprint."""
    from fedfeat.runs import sweep
    from fedfeat.store.featurestore import FeatureStore, canonical_store

    sess = sweep.active()
    where = canonical_store(cfg.store)  # an absolute local path, or the store's URL
    if sess is not None and where in sess.stores:  # a sweep: one open store (and its label check) per process
        store = sess.stores[where]
        sess.hits += 1
    else:
        store = FeatureStore.open(cfg.store, mode="r")
        check_labels(store)
        if sess is not None:
            store.memo = {}  # verified feature arrays kept for the session's other runs
            sess.stores[where] = store
    if cfg.preset is not None:
        from fedfeat.partition.openvocab import PRESETS

        want = PRESETS[cfg.preset]["classes"]
        if store.n_classes != want:
            raise FedfeatError(
                f"preset {cfg.preset} is for a store of {want} classes, {cfg.store} has {store.n_classes}; pass "
                "the store encoded from that dataset, or drop --preset"
            )
    have = store.attrs.get("fingerprint_hash")
    if cfg.store_fingerprint is not None and have != cfg.store_fingerprint:
        raise FedfeatError(
            f"store {cfg.store} has fingerprint {have}, but the config was run on a store with fingerprint "
            f"{cfg.store_fingerprint}; pass --store to run it on this store anyway, or point it at the original"
        )
    cfg.store = where  # config.toml works from any working directory
    cfg.store_fingerprint = have
    return store


def run_partition(store, cfg: RunConfig, save: bool):
    """``(key, Partition, stored)``: computed in memory (the store is opened read-only); saved into the store
    only when asked (``--save-partition``) and the store is writable."""
    from fedfeat.runs import sweep
    from fedfeat.report.stores import store_partition

    sess = sweep.active()
    ck = (str(store.path), cfg.partition, cfg.clients, cfg.alpha, cfg.shards, cfg.imbalance_factor, cfg.shots,
          cfg.partition_seed)  # fmt: skip
    if sess is not None and ck in sess.partitions:
        key, part = sess.partitions[ck]
    else:
        key, part = store_partition(
            store,
            scheme=cfg.partition,
            clients=cfg.clients,
            alpha=cfg.alpha,
            shards=cfg.shards,
            imbalance_factor=cfg.imbalance_factor,
            shots=cfg.shots,
            seed=cfg.partition_seed,
            save=False,
        )
        if sess is not None:
            sess.partitions[ck] = (key, part)
    stored = key in store.partition_keys()
    if save and not stored:
        from fedfeat.store.featurestore import FeatureStore

        try:
            FeatureStore.open(cfg.store, mode="r+").save_partition(part, key=key)
        except OSError as e:
            raise FedfeatError(
                f"cannot save partition {key} into store {cfg.store}: {e.strerror}; drop --save-partition "
                "(the run keeps its partition in its own directory)"
            ) from None
        stored = True
    return key, part, stored


CHECKPOINT = "checkpoint.safetensors"
# every 10 rounds: at the CIFAR-10 shape a checkpoint (safetensors + fsync + rename) costs 2-35 % of a round
# (fsync dominates a FedAvg head's 41 kB; FST-CBDG adds its [50000, 10] soft labels), so 10 rounds keep every
# method and participation measured at <= 3.5 % (`python bench/bench_checkpoint.py`, BENCHMARKS.md)
CHECKPOINT_EVERY = 10


def _resume_target(path: str | Path) -> tuple[Path, str]:
    p = Path(path)
    name = p.name[len(rundir.PARTIAL) :] if p.name.startswith(rundir.PARTIAL) else p.name
    return p.parent, name


def _read_metrics(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            break  # a row cut short by a kill: it and anything after it are redone
    return rows


def train(
    cfg: RunConfig | None,
    *,
    resume: str | Path | None = None,
    overwrite: bool = False,
    checkpoint_every: int | None = None,
    save_partition: bool = False,
    progress: bool = True,
    log=print,
    _device=None,
    _stacked: tuple | None = None,
) -> Path:
    """Run one configuration end to end and write its run directory (``fedfeat.runs.rundir``). Returns it.

    ``resume``: a run directory (``OUT/NAME``, or its ``OUT/.partial-NAME``) whose run was interrupted; it goes
    on from its last checkpoint with its own config.toml, and ends with the metrics and weights of an
    uninterrupted run."""
    from fedfeat.engine import checkpoint
    from fedfeat.methods import get_method

    if resume is not None:
        out, name = _resume_target(resume)
        rd = rundir.RunDir(out, name)
        if not (rd.partial / "config.toml").is_file():
            if (rd.final / "summary.json").is_file():
                raise FedfeatError(f"run {rd.final} is finished; there is nothing to resume")
            raise FedfeatError(
                f"no unfinished run at {resume} (looked for {rd.partial}); `fedfeat report {out} --all` lists them"
            )
        cfg = resolve_config({}, rd.partial / "config.toml", None)
        cfg.out, cfg.name = str(out), name
    if checkpoint_every is None:
        checkpoint_every = CHECKPOINT_EVERY
    if checkpoint_every < 0:
        raise FedfeatError(f"--checkpoint-every must be >= 0 (0: no checkpoints), got {checkpoint_every}")
    method = get_method(cfg.method, cfg.params)
    method_params = dataclasses.asdict(method.p)
    method_defaults = dataclasses.asdict(type(method).Params())
    if (
        _device is None and int(os.environ.get("WORLD_SIZE", "1")) > 1
    ):  # torchrun: clients sharded across ranks
        return _train_sharded(cfg, method, resume, overwrite, checkpoint_every, save_partition, progress, log)
    device = _device if _device is not None else resolve_device(cfg.device)
    kernel = resolve_kernel(cfg.kernel, method, cfg.engine, device)  # before anything is written
    store = open_store(cfg)
    key, part, stored = run_partition(store, cfg, save_partition)
    name = cfg.name or default_run_name(cfg, method_params, method_defaults, store.attrs, key)
    out = rundir.check_out(cfg.out)
    rd = rundir.RunDir(out, name)
    rd.lock.acquire()
    try:
        with rundir.sigterm_as_exception():
            return _train_locked(
                cfg, method, method_params, device, kernel, store, key, part, stored, rd,
                resume is not None, overwrite, checkpoint_every, progress, log, checkpoint, _stacked,
            )  # fmt: skip
    except (
        OSError
    ) as e:  # a full disk, a read-only or forbidden --out: the run's directory is already cleaned up
        where = f" ({e.filename})" if e.filename else ""
        raise FedfeatError(
            f"cannot write run {rd.final}: {e.strerror or e}{where}; free space or pass a writable --out, then run "
            "again"
            + (f" (or `fedfeat train --resume {rd.final}`)" if (rd.partial / CHECKPOINT).is_file() else "")
        ) from None
    finally:
        rd.lock.release()


_DIST: list = []  # this process's torchrun group (set up once, used by every run of the process)


def _train_sharded(cfg, method, resume, overwrite, checkpoint_every, save_partition, progress, log) -> Path:
    """``torchrun --nproc-per-node N -m fedfeat train ...``: every rank loads the data and trains its share of each
    round's clients (``engine.sharded_local``); rank 0 alone writes the run directory, exactly as one process
    would, and the other ranks write nothing. Results equal one process's (tested with gloo on CPU)."""
    from fedfeat.runs.encode import _init_dist
    from fedfeat.engine.rounds import run_federated

    if resume is not None:
        raise FedfeatError("--resume continues a run in one process; resume it without torchrun")
    if not type(method).__dict__.get("shardable", False):
        raise FedfeatError(
            f"method {method.name} cannot be sharded across processes (per-sample state updated in local "
            "training); run it in one process"
        )
    if not _DIST:
        _DIST.append(_init_dist(True, cfg.device))
    dist_ctx, device = _DIST[0]
    kernel = resolve_kernel(cfg.kernel, method, cfg.engine, device)
    if dist_ctx.rank == 0:
        try:
            return train(cfg, overwrite=overwrite, checkpoint_every=checkpoint_every,
                         save_partition=save_partition, progress=progress, log=log, _device=device)  # fmt: skip
        finally:
            dist_ctx.barrier()
    store = open_store(cfg)
    _, part, _ = run_partition(store, cfg, False)
    data = _run_data(store, part, "", cfg, device, getattr(method, "centralized", False))
    if getattr(method, "needs_live_text", False):
        data.live = _live_text(store, cfg, device)
    centralized = getattr(method, "centralized", False)
    run_federated(method, data, rounds=cfg.rounds, participation=1.0 if centralized else cfg.participation,
                  seed=cfg.seed,
                  engine=cfg.engine, kernel=kernel, device=device, eval_every=cfg.eval_every)  # fmt: skip
    dist_ctx.barrier()
    return run_name(cfg)


def _train_locked(
    cfg, method, method_params, device, kernel, store, key, part, stored, rd, resuming, overwrite,
    checkpoint_every, progress, log, checkpoint, stacked=None,
):  # fmt: skip
    from safetensors.torch import save_file

    from fedfeat.engine.rounds import run_federated
    from fedfeat.report.plots import plot_curves

    rd.recover()
    ckpt = rd.partial / CHECKPOINT
    start = None
    if not resuming:
        if rd.final.exists() and not overwrite:
            raise FedfeatError(
                f"run directory {rd.final} exists; pass --overwrite to replace it (atomically: the old run stays "
                "until the new one is complete) or --name for another name"
            )
        if rd.partial.exists():
            if not overwrite:
                at = checkpoint.read_meta(ckpt)["round"] if ckpt.is_file() else "none"
                raise FedfeatError(
                    f"an unfinished run {rd.name} exists in {rd.out} (checkpointed round: {at}); resume it with "
                    f"`fedfeat train --resume {rd.final}` or pass --overwrite to start it again"
                )
            shutil.rmtree(rd.partial)
    elif rd.final.exists() and not overwrite:
        raise FedfeatError(
            f"run directory {rd.final} exists (a finished run of that name); pass --overwrite to let the resumed "
            "run replace it"
        )
    if resuming and (rd.partial / "summary.json").is_file():  # killed between its last write and the rename
        log(f"run {rd.name} had finished before it was interrupted; publishing it")
        rd.publish(overwrite)
        return rd.final
    try:
        if resuming:
            if ckpt.is_file():
                start = checkpoint.load(ckpt, device)
        else:
            rd.partial.mkdir()
            (rd.partial / "config.toml").write_text(config_toml(cfg, method_params))
            if not stored:
                from fedfeat.partition.schemes import to_json

                to_json(part, rd.partial / "partition.json")  # computed here: kept with the run
        centralized = getattr(method, "centralized", False)
        data = _run_data(store, part, key, cfg, device, centralized)
        if getattr(method, "needs_live_text", False):  # prompt methods: the store's text encoder, checked
            data.live = _live_text(store, cfg, device)
            log(
                f"live text encoder: {data.live.backbone} ({data.live.weights}) reproduces the store's text "
                f"features (min cosine {data.live.min_cosine:.6f})"
            )
        groups = shot_groups(
            data.train_counts.cpu().numpy(), cfg.shot_thresholds or default_thresholds(cfg, data)
        )
        test_counts = np.bincount(data.test_y.cpu().numpy(), minlength=len(data.class_names))
        mpath = rd.partial / "metrics.jsonl"
        done = start[0] if start else 0
        if resuming:  # rows after the checkpoint are redone
            old = _read_metrics(mpath) if mpath.is_file() else []
            kept = [r for r in old if r["round"] <= done] if start else []
            tmp = mpath.with_name(".metrics.jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(tmp, mpath)
            log(f"resuming {rd.name} after round {done} of {cfg.rounds}")
        mfile = open(mpath, "a")  # noqa: SIM115 (closed below)
        bar = _progress_bar(cfg, method, key, done) if progress else None
        ck_seconds = [0.0]

        def on_round(row: dict) -> None:
            if groups is not None and "per_class_acc" in row:
                row.update(group_accuracy(row["per_class_acc"], test_counts, groups))
            mfile.write(json.dumps(row) + "\n")
            mfile.flush()
            if bar is not None:
                acc = "-" if row["test_acc"] is None else f"{row['test_acc']:.2f}%"
                bar[0].update(bar[1], completed=row["round"], acc=acc)
            rundir.fault_point(f"after-round-{row['round']}")

        def on_checkpoint(rnd: int, glob: dict, state: dict) -> None:
            t = time.perf_counter()
            os.fsync(mfile.fileno())  # the metrics rows the checkpoint stands on are on disk first
            checkpoint.save(ckpt, rnd, glob, state)
            ck_seconds[0] += time.perf_counter() - t

        t0 = time.perf_counter()
        try:
            if stacked is not None:  # (weights, rows, seconds, runs): this run's share of a stacked program
                glob = stacked[0]
                for row in stacked[1]:
                    on_round(dict(row))
            else:
                glob, _ = run_federated(
                    method,
                    data,
                    rounds=cfg.rounds,
                    participation=1.0 if centralized else cfg.participation,
                    seed=cfg.seed,
                    engine=cfg.engine,
                    kernel=cfg.kernel,
                    device=device,
                    on_round=on_round,
                    on_checkpoint=on_checkpoint,
                    checkpoint_every=checkpoint_every,
                    eval_every=cfg.eval_every,
                    resume=start,
                )
        finally:
            mfile.close()
            if bar is not None:
                bar[0].stop()
        wall = time.perf_counter() - t0 if stacked is None else stacked[2]
        metrics = _read_metrics(mpath)
        save_file(
            {k: v.detach().cpu().contiguous() for k, v in glob.items()}, rd.partial / "weights.safetensors"
        )
        ev_rows = [r for r in metrics if r["test_acc"] is not None]
        plot_curves(
            {cfg.method: ([r["round"] for r in ev_rows], [r["test_acc"] for r in ev_rows])},
            rd.partial / "curve.png",
            title=f"{cfg.method} on {Path(cfg.store).name}, {key}",
        )
        summary = _summary(cfg, method, method_params, kernel, device, key, rd.name, metrics, wall, store)
        summary["checkpoint_seconds"] = ck_seconds[0]
        run_files = getattr(
            method, "run_files", None
        )  # a method's own outputs (zeroshot: CLIP_benchmark's JSON)
        if run_files is not None:
            summary.update(run_files(rd.partial, data=data, glob=glob, store=store) or {})
        if stacked is not None:
            summary["stacked_runs"] = stacked[3]  # made in one program with this many runs (fedfeat.runs.stack)
        if start:
            summary["resumed_after_round"] = done
        ckpt.unlink(missing_ok=True)  # a finished run needs none
        _write_atomic(rd.partial / "summary.json", json.dumps(summary, indent=2))
        rundir.fault_point("before-publish")
        rd.publish(overwrite)
    except BaseException as e:
        if ckpt.is_file() and isinstance(e, (KeyboardInterrupt, rundir.Interrupted, OSError)):
            log(f"interrupted after a checkpoint; resume with: fedfeat train --resume {rd.final}")
        elif not resuming:  # nothing to resume: this process's partial directory goes
            shutil.rmtree(rd.partial, ignore_errors=True)
        raise
    accs = [r["test_acc"] for r in metrics if r["test_acc"] is not None]
    log(
        f"run: {rd.final}  (final acc {accs[-1]:.2f}%, best {max(accs):.2f}% at round {summary['best_round']}, "
        f"{wall:.1f} s)"
    )
    return rd.final


def stack_group(cfg: RunConfig) -> tuple | None:
    """Runs with equal groups can be made as one stacked program (``fedfeat.runs.stack``): one stackable method, the
    same store, partition, data geometry, kernel and output; seed, participation and hyperparameters may differ.
    None: this run is made on its own (another method, the loop engine, local test splits, torchrun)."""
    from fedfeat.methods import get_method
    from fedfeat.runs.stack import stack_key

    if cfg.engine != "batched" or cfg.local_test not in (None, "none"):
        return None
    method = get_method(cfg.method, cfg.params)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun shards one run's clients instead
        return None
    if cfg.preset is not None or cfg.partition == "disjoint-classes":  # open vocabulary: one by one
        return None
    extra = (str(cfg.store), cfg.partition, cfg.clients, cfg.alpha, cfg.shards, cfg.imbalance_factor, cfg.shots,
             cfg.partition_seed, cfg.rounds, cfg.device, cfg.kernel, cfg.eval_every, cfg.shot_thresholds,
             str(cfg.out))  # fmt: skip
    return stack_key(method, extra)


def train_stacked(cfgs: list[RunConfig], *, overwrite: bool = False, log=print) -> list:
    """Make runs of one ``stack_group`` as one program (``fedfeat.runs.stack.run_stacked``) and write each as an
    ordinary run directory. Returns per run its directory, or the ``FedfeatError`` that stopped it."""
    from fedfeat.methods import get_method
    from fedfeat.runs.stack import run_stacked

    groups = {stack_group(c) for c in cfgs}
    if None in groups or len(groups) != 1:
        raise FedfeatError("train_stacked: these runs cannot be stacked (see fedfeat.runs.train.stack_group)")
    cfg0 = cfgs[0]
    device = resolve_device(cfg0.device)
    store = open_store(cfg0)
    key, part, _ = run_partition(store, cfg0, False)
    data = _run_data(store, part, key, cfg0, device, False)
    methods = [get_method(c.method, c.params) for c in cfgs]
    t0 = time.perf_counter()
    res = run_stacked(methods, data, rounds=cfg0.rounds, participation=[c.participation for c in cfgs],
                      seeds=[c.seed for c in cfgs], device=device, eval_every=cfg0.eval_every,
                      kernel=cfg0.kernel)  # fmt: skip
    share = (time.perf_counter() - t0) / len(cfgs)
    out = []
    for c, r in zip(cfgs, res):
        if isinstance(r, FedfeatError):
            out.append(r)
            continue
        out.append(train(c, overwrite=overwrite, progress=False, log=log, _stacked=(*r, share, len(cfgs))))
    return out


def _run_data(store, part, key: str, cfg: RunConfig, device, centralized: bool):
    """``load_run_data`` for this run, shared with the other runs of a sweep that read the same data."""
    from fedfeat.runs import sweep
    from fedfeat.engine.rounds import load_run_data

    sess = sweep.active()
    lv, qv, lt = cfg.local_val or "paper", cfg.query_val or "paper", cfg.local_test or "none"
    ck = (str(store.path), key, str(device), centralized, lv, qv, lt)
    if sess is not None and ck in sess.data:
        return sess.data[ck]
    data = load_run_data(
        store, part, device=device, centralized=centralized, local_val=lv, query_val=qv, local_test=lt
    )
    if sess is not None:
        data.memo = {}
        sess.data[ck] = data
    return data


def _live_text(store, cfg: RunConfig, device):
    from fedfeat.runs import sweep
    from fedfeat.encoders.live import load_live_text

    sess = sweep.active()
    ck = (str(store.path), str(device), cfg.pretrained)
    if sess is not None and ck in sess.live:
        return sess.live[ck]
    live = load_live_text(store, device=device, pretrained=cfg.pretrained)
    if sess is not None:
        sess.live[ck] = live
    return live


def run_name(cfg: RunConfig) -> Path:
    """The directory ``train(cfg)`` would publish (``OUT/NAME``), computed without writing anything."""
    from fedfeat.methods import get_method

    method = get_method(cfg.method, cfg.params)
    store = open_store(cfg)
    key, _, _ = run_partition(store, cfg, False)
    name = cfg.name or default_run_name(
        cfg, dataclasses.asdict(method.p), dataclasses.asdict(type(method).Params()), store.attrs, key
    )
    return Path(cfg.out) / name


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _progress_bar(cfg: RunConfig, method, key: str, done: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn(f"[bold]{cfg.method}[/bold] {key}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("acc {task.fields[acc]}"),
        TimeElapsedColumn(),
        transient=False,
    )
    task = bar.add_task("rounds", total=cfg.rounds if method.federated else 0, completed=done, acc="-")
    bar.start()
    return bar, task


def _summary(cfg, method, method_params, kernel, device, key, name, metrics, wall, store) -> dict:
    ev = [r for r in metrics if r["test_acc"] is not None]  # --eval-every: the evaluated rounds
    accs = [r["test_acc"] for r in ev]
    last = metrics[-1]
    return {
        "name": name,
        "method": cfg.method,
        "uses_labels": method.uses_labels,
        "store": str(cfg.store),
        "store_fingerprint": store.attrs.get("fingerprint_hash"),
        "partition": key,
        "clients": cfg.clients,
        "participation": cfg.participation,
        "rounds": cfg.rounds,
        "seed": cfg.seed,
        "engine": cfg.engine,
        "kernel": kernel,
        "device": str(device),
        "initial_acc": accs[0],
        "final_acc": accs[-1],
        "best_acc": max(accs),
        "best_round": int(ev[int(np.argmax(accs))]["round"]),
        **{k: last[k] for k in SUMMARY_EXTRAS if k in last},
        "bytes_up": int(sum(r["bytes_up"] for r in metrics)),
        "bytes_down": int(sum(r["bytes_down"] for r in metrics)),
        "seconds": wall,  # this process: loading, set-up, kernel compilation on first use, its rounds
        # the median round (training + evaluation): one-time costs (a kernel compiled in round 1) left out
        "seconds_per_round": (
            float(np.median([r["seconds"] for r in metrics[1:]]))
            if len(metrics) > 1
            else wall / max(cfg.rounds, 1)
        ),
        "params": method_params,
        "env": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
        },
        "provenance": _provenance(),
    }


SUMMARY_EXTRAS = ("many_acc", "medium_acc", "few_acc", "pseudo_label_acc", "novel_precision", "novel_recall",
                  "novel_f1", "base_acc", "hm", "local_acc", "local_acc_std")  # fmt: skip
SUMMARY_KEYS = ("method", "partition", "rounds", "initial_acc", "final_acc", "best_acc", "seconds_per_round",
                "bytes_up", "params")  # fmt: skip


def load_run(path: Path) -> tuple[dict, list[dict]]:
    """``(summary, metrics)`` of a finished run; a ``FedfeatError`` names what is missing or damaged."""
    path = Path(path)
    s = path / "summary.json"
    if not s.is_file():
        raise FedfeatError(f"{path} is not a finished run directory (no summary.json)")
    try:
        summary = json.loads(s.read_text())
    except (OSError, ValueError) as e:
        raise FedfeatError(f"{s} is unreadable ({e}); re-run it, or delete the directory") from None
    if not isinstance(summary, dict) or any(k not in summary for k in SUMMARY_KEYS):
        raise FedfeatError(f"{s} lacks the keys of a fedfeat summary; re-run it, or delete the directory")
    m = path / "metrics.jsonl"
    try:
        metrics = [json.loads(line) for line in m.read_text().splitlines() if line]
    except (OSError, ValueError) as e:
        raise FedfeatError(
            f"{m} is missing or unreadable ({e}); re-run it, or delete the directory"
        ) from None
    if not metrics or not all(isinstance(r, dict) and "round" in r and "test_acc" in r for r in metrics):
        raise FedfeatError(f"{m} holds no per-round rows; re-run it, or delete the directory")
    return summary, metrics


def _looks_like_run(p: Path) -> bool:
    return (
        p.is_dir()
        and not p.name.startswith(".")
        and any((p / f).exists() for f in ("summary.json", "metrics.jsonl", "config.toml"))
    )


def load_runs(*paths, metrics: bool = False, as_frame: bool | None = None, warn=None):
    """Finished runs under ``paths`` (run directories or their parents) as records: each run's ``summary.json``
    flattened (``params`` as ``params.<key>``) plus ``path`` (and its per-round rows under ``metrics`` when asked).
    A pandas DataFrame when pandas is installed (``as_frame=None``) or asked for (``True``), else a list of dicts.

    >>> runs = load_runs("runs/demo")                              # doctest: +SKIP
    >>> runs.groupby(["method", "partition"])["final_acc"].agg(["mean", "std"])   # doctest: +SKIP
    """
    warn = warn or (lambda msg: print(f"warning: {msg}", file=sys.stderr))
    found, _ = _collect(paths or ("runs",), warn)
    records = []
    for (summary, rows), path in found:
        rec = {k: v for k, v in summary.items() if k not in ("params", "env", "provenance")}
        rec.update({f"params.{k}": v for k, v in summary.get("params", {}).items()})
        rec["path"] = str(path)
        if metrics:
            rec["metrics"] = rows
        records.append(rec)
    if as_frame is False:
        return records
    try:
        import pandas as pd
    except ImportError:
        if as_frame:
            raise FedfeatError("load_runs(as_frame=True) needs pandas; pip install pandas") from None
        return records
    return pd.DataFrame.from_records(records)


def _collect(paths, warn) -> tuple[list, list]:
    """``([((summary, metrics), path), ...], parents)``: readable finished runs; unreadable ones are warned about."""
    found, parents = [], []
    for p in map(Path, paths):
        if not p.exists():
            warn(f"{p} does not exist")
            continue
        if p.is_dir() and not _looks_like_run(p):
            parents.append(p)
            cands = [q for q in sorted(p.iterdir()) if _looks_like_run(q)]
        else:
            cands = [p]
        for q in cands:
            try:
                found.append((load_run(q), q))
            except FedfeatError as e:
                warn(f"skipped {q}: {e}")
    return found, parents


def unfinished_runs(parents: list[Path]) -> list[dict]:
    """Runs being written or interrupted (``OUT/.partial-NAME``): name, method, rounds recorded, checkpoint."""
    from fedfeat.engine import checkpoint

    out = []
    for parent in parents:
        parent = Path(parent)
        if not parent.is_dir():
            continue
        for q in sorted(parent.glob(f"{rundir.PARTIAL}*")):
            name = q.name[len(rundir.PARTIAL) :]
            row = {"name": name, "path": str(parent / name), "method": "?", "rounds": "?", "recorded": 0}
            try:
                run = tomllib.loads((q / "config.toml").read_text()).get("run", {})
                row.update(method=run.get("method", "?"), rounds=run.get("rounds", "?"))
            except (OSError, ValueError):
                pass
            if (q / "metrics.jsonl").is_file():
                row["recorded"] = max(0, len(_read_metrics(q / "metrics.jsonl")) - 1)
            ck = q / CHECKPOINT
            try:
                row["checkpoint"] = int(checkpoint.read_meta(ck)["round"]) if ck.is_file() else None
            except FedfeatError:
                row["checkpoint"] = None
            lock = parent / f"{rundir.LOCK}{name}"
            row["state"] = (
                "running"
                if lock.exists() and not rundir.Lock._stale(rundir.Lock(lock, "")._holder())
                else "interrupted"
            )
            out.append(row)
    return out


def report(
    paths: list[Path],
    *,
    fmt: str = "markdown",
    plot: Path | None = None,
    all_runs: bool = False,
    seeds: bool = False,
    best: bool = False,
    warn=None,
) -> str:
    """A comparison table of finished runs (markdown or CSV) and, optionally, all their curves in one PNG.

    ``seeds``: one row per group of runs that differ only in ``--seed``: mean ± sample std (n - 1) and n.
    ``best``: per method, partition and store, only the settings with the best mean selection metric -- the
    validation accuracy (``val_acc``) where the runs record one, else the final test accuracy, said loudly in the
    table's first line (selecting on the test split is optimistic).

    A path is a run directory or a parent of run directories; hidden entries (runs being written, temporary
    files) are never read as runs. A run that cannot be read is skipped with a one-line warning (``warn``); the
    report fails only when no run is readable. ``all_runs`` adds the unfinished runs (interrupted or running)."""
    from fedfeat.report.plots import plot_curves

    if fmt not in ("markdown", "csv", "json"):
        raise FedfeatError(f"unknown format '{fmt}'; choose markdown, csv or json")
    warn = warn or (lambda msg: print(msg, file=sys.stderr))
    problems: list[str] = []
    found, parents = _collect(paths, problems.append)
    runs = [(summary, rows, q) for (summary, rows), q in found]
    unfinished = unfinished_runs(parents) if all_runs else []
    if not runs and not unfinished:  # one line: the first reason stands for all
        why = ""
        if problems:
            why = f" ({problems[0]}" + (f"; and {len(problems) - 1} more" if len(problems) > 1 else "") + ")"
        raise FedfeatError(
            f"no readable finished runs in the given paths{why}; pass run directories or "
            "their parent (`--all` also lists unfinished runs)"
        )
    for msg in problems:
        warn(f"warning: {msg}")
    if not runs:
        return _unfinished_table(unfinished, fmt)
    if best:
        runs, note = _best_settings(runs)
        return note + "\n\n" + seed_table([s for s, _, _ in runs], fmt)
    if seeds:
        if plot is not None:
            seed_figure([(s, m) for s, m, _ in runs], plot)
        return seed_table([s for s, _, _ in runs], fmt)
    if fmt == "json":  # the runs' summaries, plain numbers
        return json.dumps([{**s, "path": str(q)} for s, _, q in runs], indent=1)
    has_lt = any("many_acc" in s for s, _, _ in runs)
    has_pl = any(s.get("pseudo_label_acc") is not None for s, _, _ in runs)
    cols = ["method", "settings", "partition", "labels", "rounds", "round-0 acc", "final acc", "best acc"]
    if has_lt:
        cols += ["many", "medium", "few"]
    if has_pl:
        cols += ["pseudo-label acc"]
    ov_keys = ("novel_precision", "novel_recall", "novel_f1", "base_acc", "hm")
    has_ov = any("novel_f1" in s for s, _, _ in runs)
    if has_ov:  # open vocabulary: final acc is the novel accuracy
        cols += ["novel P", "novel R", "novel F1", "base acc", "HM"]
    has_local = any(s.get("local_acc") is not None for s, _, _ in runs)
    if has_local:  # --local-test: the mean of per-client accuracies on local test splits (FedCoPL)
        cols += ["local acc"]
    cols += ["s/round", "MB up"]
    rows = []
    for s, _m, _ in runs:
        defaults = _method_defaults(s["method"])
        changed = {k: v for k, v in s["params"].items() if defaults.get(k, v) != v}
        row = [
            s["method"],
            " ".join(f"{k}={v}" for k, v in changed.items()) or "-",
            s["partition"],
            "yes" if s.get("uses_labels", True) else "no",
            str(s["rounds"]),
            f"{s['initial_acc']:.2f}",
            f"{s['final_acc']:.2f}",
            f"{s['best_acc']:.2f}",
        ]
        if has_lt:
            row += [_fmt(s.get(k)) for k in ("many_acc", "medium_acc", "few_acc")]
        if has_pl:
            row += [_fmt(s.get("pseudo_label_acc"))]
        if has_ov:
            row += [_fmt(s.get(k)) for k in ov_keys]
        if has_local:
            row += [_fmt(s.get("local_acc"))]
        row += [f"{s['seconds_per_round']:.3f}", f"{s['bytes_up'] / 1e6:.1f}"]
        rows.append(row)
    if plot is not None:
        curves = {}
        for (s, m, p), row in zip(runs, rows):
            label = f"{s['method']}" + (f" [{row[1]}]" if row[1] != "-" else "") + f" | {s['partition']}"
            if label in curves:
                label += f" ({Path(p).name[-24:]})"
            m = [r for r in m if r["test_acc"] is not None]
            curves[label] = ([r["round"] for r in m], [r["test_acc"] for r in m])
        plot_curves(curves, plot, title="test accuracy")
    text = _table(cols, rows, fmt)
    return text + ("\n\n" + _unfinished_table(unfinished, fmt) if unfinished else "")


def _table(cols: list[str], rows: list[list[str]], fmt: str) -> str:
    """Markdown or CSV."""
    if fmt == "csv":
        import csv
        import io

        buf = io.StringIO()
        csv.writer(buf).writerows([cols, *rows])
        return buf.getvalue()
    out = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    return "\n".join(out + ["| " + " | ".join(r) + " |" for r in rows])


def _unfinished_table(rows: list[dict], fmt: str) -> str:
    cols = ["unfinished run", "method", "state", "rounds recorded", "checkpoint", "resume with"]
    cells = [
        [r["name"], str(r["method"]), r["state"], f"{r['recorded']}/{r['rounds']}",
         "-" if r["checkpoint"] is None else f"round {r['checkpoint']}", f"fedfeat train --resume {r['path']}"]
        for r in rows
    ]  # fmt: skip
    return _table(cols, cells, fmt)


SEED_METRICS = {"final_acc": "final acc", "best_acc": "best acc", "novel_precision": "novel P",
                "novel_recall": "novel R", "novel_f1": "novel F1", "base_acc": "base acc", "hm": "HM",
                "many_acc": "many", "medium_acc": "medium", "few_acc": "few",
                "pseudo_label_acc": "pseudo-label acc", "local_acc": "local acc"}  # fmt: skip


def _best_settings(runs: list) -> tuple[list, str]:
    """Keep, per (method, partition, store, rounds, clients, participation), the runs of the settings group whose
    mean selection metric is highest."""
    metric = "val_acc" if runs and all(s.get("val_acc") is not None for s, _, _ in runs) else "final_acc"
    by_group: dict[tuple, dict[str, list]] = {}
    for r in runs:
        s = r[0]
        defaults = _method_defaults(s["method"])
        changed = " ".join(f"{k}={v}" for k, v in s["params"].items() if defaults.get(k, v) != v) or "-"
        outer = (s["method"], s["partition"], s.get("store_fingerprint"), s["rounds"], s.get("clients"),
                 s.get("participation"))  # fmt: skip
        by_group.setdefault(outer, {}).setdefault(changed, []).append(r)
    kept = []
    for settings in by_group.values():
        kept += max(settings.values(), key=lambda rs: float(np.mean([r[0][metric] for r in rs])))
    note = (
        "best settings selected on the validation accuracy (val_acc)"
        if metric == "val_acc"
        else "best settings selected on the TEST split's final accuracy (these runs record no validation "
        "accuracy): optimistic, do not report it as a held-out result"
    )
    return kept, note


def seed_figure(runs: list[tuple[dict, list[dict]]], path: Path) -> None:
    """A paper's figure of seed-grouped runs: one panel per partition, each setting's mean curve with a ± std band
    over its seeds (``fedfeat.report.plots.plot_seed_curves``), labelled like the seed table (the method and its settings
    that differ from the method's defaults), the zero-shot level as a dashed line (from the ``zeroshot`` runs, which
    are not drawn as curves); long-tailed runs add rows of panels for many / medium / few."""
    from fedfeat.report.plots import plot_seed_curves

    zs = [(s, m) for s, m in runs if s["method"] == "zeroshot"]
    others = [(s, m) for s, m in runs if s["method"] != "zeroshot"] or zs
    reference = {s["partition"]: s["final_acc"] for s, _ in zs} if zs and others is not zs else None
    metrics = ["test_acc"]
    if any("many_acc" in s for s, _ in others):
        metrics += ["many_acc", "medium_acc", "few_acc"]
    grouped: dict[tuple, list] = {}
    for s, m in others:
        defaults = _method_defaults(s["method"])
        changed = " ".join(f"{k}={v}" for k, v in s["params"].items() if defaults.get(k, v) != v)
        key = (s["method"] + (f" {changed}" if changed else ""), s["partition"], s.get("store_fingerprint"),
               s["rounds"])  # fmt: skip
        grouped.setdefault(key, []).append(m)
    groups = []
    for (label, panel, _, _), ms in grouped.items():
        rounds = sorted(
            set.intersection(*[{r["round"] for r in m if r.get("test_acc") is not None} for m in ms])
        )
        by_round = [{r["round"]: r for r in m} for m in ms]
        runs_of = {k: [[br[r].get(k) for r in rounds] for br in by_round] for k in metrics}
        groups.append({"label": label, "panel": panel, "rounds": rounds,
                       "runs": runs_of["test_acc"] if len(metrics) == 1 else runs_of})  # fmt: skip
    plot_seed_curves(groups, path, reference=reference, metric=metrics[0] if len(metrics) == 1 else metrics)


def seed_groups(summaries: list[dict]) -> list[dict]:
    """Runs grouped by everything but the seed (method, settings, store, partition, rounds, clients,
    participation), each with every metric's mean, sample standard deviation (n - 1; None for one run) and n."""
    groups: dict[tuple, list[dict]] = {}
    for s in summaries:
        defaults = _method_defaults(s["method"])
        changed = " ".join(f"{k}={v}" for k, v in s["params"].items() if defaults.get(k, v) != v) or "-"
        key = (s["method"], changed, s["partition"], s.get("store_fingerprint"), s["rounds"], s.get("clients"),
               s.get("participation"), Path(str(s.get("store", ""))).name)  # fmt: skip
        groups.setdefault(key, []).append(s)
    metrics = [k for k in SEED_METRICS if any(s.get(k) is not None for s in summaries)]
    out = []
    for key, ss in groups.items():
        g = {"method": key[0], "settings": key[1], "store": key[7], "store_fingerprint": key[3],
             "partition": key[2], "rounds": key[4], "clients": key[5], "participation": key[6],
             "n": len(ss), "seeds": [s["seed"] for s in ss], "metrics": {}}  # fmt: skip
        for k in metrics:
            v = np.array([s[k] for s in ss if s.get(k) is not None], dtype=np.float64)
            g["metrics"][k] = (
                {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if len(v) > 1 else None, "n": len(v)}
                if len(v)
                else None
            )
        out.append(g)
    return out


def seed_table(summaries: list[dict], fmt: str = "markdown") -> str:
    """``seed_groups`` as a table: each metric as mean ± sample standard deviation over the group's seeds, with n
    (markdown, CSV) or as JSON with plain numbers."""
    groups = seed_groups(summaries)
    if fmt == "json":
        return json.dumps(groups, indent=1)
    metrics = [k for k in SEED_METRICS if any(g["metrics"].get(k) for g in groups)]
    cols = ["method", "settings", "store", "partition", "rounds", "n", "seeds"] + [
        SEED_METRICS[k] for k in metrics
    ]
    rows = []
    for g in groups:
        row = [g["method"], g["settings"], g["store"], g["partition"], str(g["rounds"]), str(g["n"]),
               ",".join(map(str, g["seeds"]))]  # fmt: skip
        for k in metrics:
            m = g["metrics"].get(k)
            row.append(
                "-"
                if m is None
                else f"{m['mean']:.2f} ± {m['std']:.2f}"
                if m["n"] > 1
                else f"{m['mean']:.2f}"
            )
        rows.append(row)
    return _table(cols, rows, fmt)


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def _method_defaults(name: str) -> dict:
    from fedfeat.methods import REGISTRY

    cls = REGISTRY.get(name)
    return dataclasses.asdict(cls.Params()) if cls else {}
