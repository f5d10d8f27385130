"""A run's configuration: defaults, resolution (flags over a replayed ``config.toml`` over defaults), validation,
the resolved ``config.toml``, names and provenance.

``resolve_config`` is what ``fedfeat train``, ``fedfeat.train`` and sweeps call; ``run_name`` the directory name
a configuration gets (``method__store__partition__seedS__hash8``, the hash over non-default settings and the
store's fingerprint).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

from fedfeat.errors import FedfeatError
from fedfeat.report import rundir

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
    "val_split": None,
    "eval_every": 1,
    "class_order": None,
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
    "val_split": float,
    "class_order": str,
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
    val_split: float | None = None  # fraction of each test class held out for validation (val_acc; report --best)
    class_order: str | None = None  # disjoint-classes' class list: preset (default with --preset) | store
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
    if merged.get("preset") is not None and merged.get("method") == "fed-mp" and "uncertainty" not in params:
        from fedfeat.partition.openvocab import fedmp_preset_params

        params.update(fedmp_preset_params(merged["preset"]))  # Fed-MP App. A's ε; --set uncertainty=... wins
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
    if cfg.val_split is not None and not (math.isfinite(cfg.val_split) and 0 <= cfg.val_split < 1):
        bad("val_split", f"must be in [0, 1), got {cfg.val_split} (e.g. 0.2: 20 % of each test class validates)")
    if cfg.shards is not None and cfg.shards < 1:
        bad("shards", f"must be >= 1, got {cfg.shards}")
    if cfg.shots is not None and cfg.shots < 1:
        bad("shots", f"must be >= 1, got {cfg.shots} (Fed-MP: 10)")
    from fedfeat.partition.openvocab import check_modes

    check_modes(cfg.local_val or "paper", cfg.query_val or "paper")
    from fedfeat.partition.openvocab import class_order_mode

    class_order_mode(cfg.class_order, cfg.preset)
    from fedfeat.partition.make import LOCAL_TEST

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


def provenance() -> dict:
    """fedfeat's version, the git commit when run from a checkout (``+dirty`` with local changes), the command."""
    from fedfeat._version import __version__

    out = {"fedfeat": __version__, "command": shlex.join(sys.argv), "cwd": os.getcwd()}
    repo = Path(__file__).resolve().parents[2]  # the checkout holding fedfeat/
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
