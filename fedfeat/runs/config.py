"""A run's configuration: defaults, resolution (flags over a replayed ``config.toml`` over defaults), validation,
the resolved ``config.toml``, names and provenance.

``resolve_config`` is what ``fedfeat train``, ``fedfeat.train`` and sweeps call; ``run_name`` the directory name
a configuration gets (``method__store__partition__seedS__hash8``, the hash over non-default settings and the
store's fingerprint).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import re
import shlex
import stat
import subprocess
import sys
import typing
from pathlib import Path

import tomllib

from fedfeat.errors import FedfeatError
from fedfeat.report import rundir

# the settings, their defaults, types and the flat record are the run specification's (``fedfeat.spec``)
from fedfeat.spec import DEFAULTS, FIELDS, TYPES, RunConfig  # noqa: E402


def parse_sets(sets: list[str] | None) -> dict:
    out = {}
    for s in sets or []:
        if "=" not in s:
            raise FedfeatError(f"--set expects key=value, got {s!r}; e.g. --set lr=0.01")
        k, v = s.split("=", 1)
        out[k.strip()] = v.strip()
    return out


# ------------------------------------------------------------------ types of TOML values (config and grid files)
INT64 = (-(2**63), 2**63 - 1)  # TOML's integers are 64-bit (tomllib reads any size)
MAX_TOML_BYTES = 1 << 20  # a config or grid file is a few KB of TOML; a bigger one is not one
_TYPE_WORDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
_EXAMPLES = {int: "10", float: "0.5", str: '"text"', bool: "true"}
_SCALAR_EXAMPLE = "a number, a string or true/false"


def toml_kind(v) -> str:
    """What a TOML value is, in words: ``a table``, ``an array``, ``a boolean``, ..."""
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, dict):
        return "a table"
    if isinstance(v, list):
        return "an array of tables" if v and all(isinstance(x, dict) for x in v) else "an array"
    return "a date/time" if type(v).__module__ == "datetime" else type(v).__name__


def short(v, n: int = 40) -> str:
    """A value as TOML spells it (``true``, ``"text"``, ``3``; tables and arrays as Python shows them), cut to
    ``n`` characters: a value in an error line."""
    if isinstance(v, bool):
        r = "true" if v else "false"
    elif isinstance(v, str):
        r = json.dumps(v)
    else:
        r = repr(v)
    return r if len(r) <= n else r[: n - 3] + "..."


def key_text(k) -> str:
    """A TOML key as TOML writes it: bare when it can be, else quoted (a key with a newline stays one line)."""
    k = str(k)
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k)


def check_setting(key: str, v, where: str, shown: str | None = None) -> None:
    """A run setting's TOML value has the setting's type (``TYPES``; a string otherwise): one line naming
    ``where`` (the file and table), the key and the type it takes."""
    want = TYPES.get(key, str)
    if want is float:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    elif want is bool:
        ok = isinstance(v, bool)
    else:
        ok = isinstance(v, want) and not isinstance(v, bool)
    if ok and isinstance(v, int) and not INT64[0] <= v <= INT64[1]:
        raise FedfeatError(
            f"{where}: {shown or key} = {short(v)} does not fit in 64 bits; give a smaller integer"
        )
    if not ok:
        raise FedfeatError(
            f"{where}: {shown or key} = {short(v)} is {toml_kind(v)}, but {key} takes {_TYPE_WORDS[want]} "
            f"(e.g. {key} = {_EXAMPLES[want]})"
        )


def _check_types(run: dict, where: str) -> None:
    for k, v in run.items():
        if v is not None:
            check_setting(k, v, where)


def check_param_value(key: str, v, where: str) -> None:
    """A hyperparameter's TOML value is a scalar (every method's params are numbers, strings or booleans)."""
    key = key_text(key)
    if isinstance(v, dict | list) or not isinstance(v, (bool, int, float, str)):
        raise FedfeatError(
            f"{where}: {key} = {short(v)} is {toml_kind(v)}, but a hyperparameter takes {_SCALAR_EXAMPLE} "
            f"(e.g. {key} = 0.01)"
        )
    if isinstance(v, int) and not isinstance(v, bool) and not INT64[0] <= v <= INT64[1]:
        raise FedfeatError(f"{where}: {key} = {short(v)} does not fit in 64 bits; give a smaller integer")


def check_method_params(methods, params: dict, where: str, strict: bool = False) -> None:
    """Each hyperparameter in ``params`` (TOML-typed) has the type its field has in every method of ``methods``
    that has such a field (unknown method names are left to ``get_method``). With ``strict`` (one method: a
    config file), a key the method lacks is refused too; a sweep skips such keys for that method."""
    from fedfeat.methods import REGISTRY
    from fedfeat.methods.base import _coerce, _type_name

    for name in methods:
        cls = REGISTRY.get(name) if isinstance(name, str) else None
        if cls is None:
            continue
        fields = {f.name: f for f in dataclasses.fields(cls.Params)}
        hints = typing.get_type_hints(cls.Params)
        for k, v in params.items():
            f = fields.get(str(k).replace("-", "_"))
            if f is None:
                if strict:
                    raise FedfeatError(
                        f"{where}: method {name} has no hyperparameter {key_text(k)}; valid keys: {', '.join(sorted(fields))}"
                    )
                continue
            try:
                _coerce(f, v, hints)
            except (TypeError, ValueError):
                eg = f" (e.g. {f.name} = {_toml_value(f.default)})" if f.default is not None else ""
                raise FedfeatError(
                    f"{where}: {key_text(k)} = {short(v)} is {toml_kind(v)}, but {name}'s {f.name} takes "
                    f"{_type_name(hints.get(f.name, f.type))}{eg}"
                ) from None


def read_toml(path: str | os.PathLike, what: str, example: str) -> dict:
    """A TOML file as a dict, or one line: missing, a directory or other non-regular file, too big, not UTF-8,
    not TOML, or empty. ``what`` names the file's role (``config file``, ``grid file``)."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise FedfeatError(f"{what} {p} not found; {example}") from None
    except OSError as e:
        raise FedfeatError(f"cannot read {what} {p}: {e.strerror or e}; {example}") from None
    if stat.S_ISDIR(st.st_mode):
        raise FedfeatError(f"{what} {p} is a directory; {example}")
    if not stat.S_ISREG(st.st_mode):
        raise FedfeatError(f"{what} {p} is not a regular file (a FIFO, socket or device); {example}")
    if st.st_size > MAX_TOML_BYTES:
        raise FedfeatError(
            f"{what} {p} is {st.st_size} bytes, more than a TOML settings file holds "
            f"({MAX_TOML_BYTES} at most); {example}"
        )
    try:
        text = p.read_bytes().decode("utf-8")
    except OSError as e:
        raise FedfeatError(f"cannot read {what} {p}: {e.strerror or e}; {example}") from None
    except UnicodeDecodeError as e:
        raise FedfeatError(
            f"{what} {p} is not UTF-8 text (byte {e.start}: {e.reason}); pass a TOML text file"
        ) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise FedfeatError(f"{what} {p} is not valid TOML: {e}; fix the line it names") from None
    except RecursionError:  # tomllib reads nested arrays and inline tables recursively
        raise FedfeatError(
            f"{what} {p} has arrays or tables nested too deep to read (a settings file has a few levels); {example}"
        ) from None
    if not data:
        raise FedfeatError(f"{what} {p} is empty (no settings); {example}")
    return data


_CONFIG_EXAMPLE = "pass a config.toml: [run] settings (rounds = 10) and [params] hyperparameters (lr = 0.01)"


def _read_config(config_file: str | os.PathLike) -> dict:
    """A ``--config`` file -> ``{"run": settings, "params": hyperparameters}``, every key's type checked: a run's
    ``config.toml`` (``[run]`` + ``[params]``) or the same settings at the top level (+ ``[params]``)."""
    path = Path(config_file)
    where = f"config file {path}"
    data = read_toml(path, "config file", _CONFIG_EXAMPLE)
    if "run" in data:
        run = data["run"]
        if not isinstance(run, dict):
            raise FedfeatError(
                f"{where}: run = {short(run)} is {toml_kind(run)}, but [run] is a table of settings "
                "(e.g. [run] then rounds = 10)"
            )
        extra = sorted(set(data) - {"run", "params"})
        if extra:
            raise FedfeatError(
                f"{where}: unknown top-level keys {extra} beside [run]; put settings under [run] and "
                "hyperparameters under [params]"
            )
        table = "[run]"
    else:
        run = {k: v for k, v in data.items() if k != "params"}
        table = "top level"
    unknown = sorted(set(run) - set(DEFAULTS))
    if unknown:
        raise FedfeatError(f"{where}: unknown keys {unknown} ({table}); valid: {sorted(DEFAULTS)}")
    _check_types(run, f"{where} {table}")
    params = data.get("params", {})
    if not isinstance(params, dict):
        raise FedfeatError(
            f"{where}: params = {short(params)} is {toml_kind(params)}, but [params] is a table of "
            "hyperparameters (e.g. [params] then lr = 0.01)"
        )
    for k, v in params.items():
        check_param_value(k, v, f"{where} [params]")
    return {"run": run, "params": params}


def resolve_config(cli: dict, config_file: str | os.PathLike | None, sets: list[str] | None) -> RunConfig:
    """Defaults <- config file <- explicit flags (``None`` in ``cli`` means "not given").

    A config file's ``store_fingerprint`` is kept only when ``--store`` is not given: replaying a run checks that
    its store is the same, while pointing the run at another store on purpose does not. Every key of the file is
    type-checked (``_read_config``); its hyperparameters against the method's fields."""
    merged = dict(DEFAULTS)
    params: dict = {}
    run: dict = {}
    if config_file is not None:
        data = _read_config(config_file)
        run = data["run"]
        merged.update(run)
        params.update(data["params"])
    given = {k: v for k, v in cli.items() if v is not None}
    unknown = sorted(set(given) - set(DEFAULTS))
    if unknown:
        raise FedfeatError(
            f"unknown run settings {unknown}; valid: {sorted(k for k in DEFAULTS if k != 'store_fingerprint')}"
        )
    _check_types(given, "flags")
    if params:
        where = f"config file {config_file} [params]"
        check_method_params([given.get("method", merged["method"])], params, where, strict=True)
    preset = given.get("preset", merged.get("preset"))
    if preset is not None:  # the preset's settings, under anything the config file or the flags say
        from fedfeat.partition.openvocab import PRESET_RUN, PRESETS

        if preset not in PRESETS:
            raise FedfeatError(f"unknown preset '{preset}'; known presets: {', '.join(PRESETS)}")
        base = {**PRESET_RUN, "partition_seed": PRESETS[preset]["seed"]}
        file_keys = set(run)
        merged.update({k: v for k, v in base.items() if k not in file_keys})
    if "store" in given:
        merged["store_fingerprint"] = None
    merged.update(given)
    if preset is not None:  # a preset's scheme parameters go with its scheme: another --partition drops them
        from fedfeat.partition.registry import schemes_using
        from fedfeat.spec import scheme_params

        for k in scheme_params():
            if k in base and k not in given and k not in run and merged["partition"] not in schemes_using(k):
                merged[k] = None
    params.update(parse_sets(sets))
    if merged.get("preset") is not None and merged.get("method") == "fed-mp" and "uncertainty" not in params:
        from fedfeat.partition.openvocab import fedmp_preset_params

        params.update(fedmp_preset_params(merged["preset"]))  # Fed-MP App. A's ε; --set uncertainty=... wins
    cfg = RunConfig(**merged, params=params)
    validate_config(cfg)
    return cfg


def validate_config(cfg: RunConfig) -> None:
    """Range checks of the run's own settings (``fedfeat.spec.validate``: each setting's declared check; a
    scheme parameter with a scheme that does not take it), and the run's name. The settings a run only reads once
    training starts are checked here too, so that a sweep or grid file with a bad value fails before its first run
    (one line, exit 2), not as a failed run. The method checks its hyperparameters, the partition its own."""
    from fedfeat import spec

    spec.validate(cfg)
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
    for k in FIELDS:
        v = getattr(cfg, k)
        if v is None:
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
    from fedfeat.spec import hashed

    run = hashed(cfg)
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


def provenance(method=None) -> dict:
    """fedfeat's version, the git commit when run from a checkout (``+dirty`` with local changes), the command; and
    for a ``method`` that is not fedfeat's own (a plugin), ``plugin``: its class, module, source file and sha256,
    distribution and version (``fedfeat.methods.base.plugin_info``) -- fedfeat's commit says nothing of its code."""
    from fedfeat._version import __version__

    out = {"fedfeat": __version__, "command": shlex.join(sys.argv), "cwd": os.getcwd()}
    commit = _git_commit()
    if commit:
        out["git_commit"] = commit
    if method is not None:
        from fedfeat.methods.base import plugin_info

        plugin = plugin_info(method)
        if plugin is not None:  # a built-in's provenance is unchanged
            out["plugin"] = plugin
    return out


@functools.lru_cache(maxsize=1)
def _git_commit() -> str | None:
    """The checkout's commit (``+dirty`` with local changes), asked of git once per process: the code a process runs
    is the code it imported at its start (two git calls a run were ~40 ms of every tiny run of a sweep)."""
    repo = Path(__file__).resolve().parents[2]  # the checkout holding fedfeat/
    if not (repo / ".git").exists():
        return None
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
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "") if head else None
