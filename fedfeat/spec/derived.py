"""Everything keyed by run settings, derived from the run specification's fields (``fedfeat.spec.FIELDS``): the
checks of a whole configuration, the partition's keywords, the session's cache keys, the stack key, the run
name's hashed settings, the checkpoint identity, the settings only a drawing run reads, and the seed-table
setting. No setting is named here: each function reads the fields' declarations."""

from __future__ import annotations

from fedfeat.errors import FedfeatError
from fedfeat.spec.fields import _PARTITION_COMMON, FIELDS, to_spec


def _canon(f, v):
    """What a setting's value stands for in names, hashes and keys (its field's ``canon``; a partition file: its
    content hash)."""
    return v if v is None or f.canon is None else f.canon(v)


def validate(cfg) -> None:
    """Every field's own check, then the scheme parameters against the scheme: one line naming the flag."""
    spec = to_spec(cfg)
    for k, f in FIELDS.items():
        v = getattr(cfg, k)
        if v is None or f.check is None:
            continue
        msg = f.check(v, spec)
        if msg:
            raise FedfeatError(f"{f.flag} {msg}")
    from fedfeat.partition.registry import schemes_using

    scheme = cfg.partition
    for name in scheme_params():
        if getattr(cfg, name) is not None and scheme not in schemes_using(name):
            users = schemes_using(name)
            which = f"--partition {users[0]} only" if len(users) == 1 else f"--partition {' / '.join(users)}"
            raise FedfeatError(
                f"{FIELDS[name].flag} applies to {which} (got {scheme}); drop {FIELDS[name].flag}"
            )


def scheme_params() -> tuple[str, ...]:
    """The flat keys of the scheme parameters (the registry's, in the partition part)."""
    common = {n for n, _, _ in _PARTITION_COMMON}
    return tuple(k for k, f in FIELDS.items() if f.part == "partition" and f.name not in common)


def partition_args(cfg) -> dict:
    """The partition part (of a ``RunConfig``, or a dict of flat keys) as ``store_partition`` keywords:
    ``scheme``, ``clients``, ``seed``, ``imbalance_factor`` and the scheme's own parameters that are set."""
    get = cfg.get if isinstance(cfg, dict) else (lambda k: getattr(cfg, k))
    own = set(scheme_params())
    return {
        f.name: get(k)
        for k, f in FIELDS.items()
        if f.part == "partition" and not (k in own and get(k) is None)
    }


def cache_key(cfg, kind: str, where: str) -> tuple:
    """The key of a session cache entry of ``kind`` (``CACHES``) for this run: the store's canonical location
    ``where`` and every setting declared to key that cache. Two runs share an entry exactly when these agree."""
    return (
        kind,
        where,
        *((k, _canon(f, getattr(cfg, k))) for k, f in FIELDS.items() if kind in f.caches and k != "store"),
    )


def stack_key(cfg) -> tuple:
    """Every setting that is not ``per_run``: runs may be stacked only when these agree (and their method allows
    it, ``fedfeat.runs.train.stack_group``)."""
    return tuple((k, str(_canon(f, getattr(cfg, k)))) for k, f in FIELDS.items() if not f.per_run)


def unstack_reason(cfg) -> str | None:
    """Why this run is made on its own whatever its method (a setting's ``unstack``), or None."""
    for k, f in FIELDS.items():
        if f.unstack is not None:
            why = f.unstack(getattr(cfg, k))
            if why:
                return why
    return None


def implied(cfg) -> dict:
    """The values the run's partition scheme takes when a setting is not given (``Scheme.implied``: its
    ``store_defaults``, its parameters' defaults, values its draw treats as "not given", and its seed), by flat key:
    a setting given at one of these is the same run as the setting left out (``--min-size 10``, ``--alpha 0.1`` and
    ``--partition-seed 19940817`` on ``dirichlet`` name the run the default does)."""
    from fedfeat.partition.registry import SCHEMES

    cls = SCHEMES.get(getattr(cfg, "partition", None))
    if cls is None:
        return {}
    by_name = {f.name: k for k, f in FIELDS.items() if f.part == "partition"}
    out = {by_name[n]: v for n, v in cls.implied().items() if n in by_name}
    seed = by_name.get("seed")
    if seed is not None:
        out[seed] = cls.default_seed(getattr(cfg, by_name.get("imbalance_factor", ""), None))
    return out


def hashed(cfg) -> dict:
    """The settings that enter the run name's hash: those ``in_hash``, set and not at their default (a scheme's
    implied value counts as its default: ``implied``)."""
    imp = implied(cfg)
    return {
        k: _canon(f, getattr(cfg, k))
        for k, f in FIELDS.items()
        if f.in_hash
        and getattr(cfg, k) is not None
        and getattr(cfg, k) != f.default
        and not (k in imp and getattr(cfg, k) == imp[k])
    }


def identity(cfg) -> dict:
    """What a checkpoint is checked against on resume: every setting but where the run is written or read."""
    return {k: _canon(f, getattr(cfg, k)) for k, f in FIELDS.items() if f.identity}


def drawn() -> tuple[str, ...]:
    """The settings only a run that draws clients reads (reset for a method that draws none)."""
    return tuple(k for k, f in FIELDS.items() if f.drawn)


def group_items(run: dict, params: dict) -> dict:
    """What makes a run's setting in a seed table (``report --seeds``, ``--best``, the seed figures): every
    setting declared ``groups`` (all that say what the run is, the store's fingerprint among them, but the seed), as
    a ``config.toml`` ``[run]`` table gives them (missing keys at their defaults), and the method's hyperparameters
    as ``params.<key>``. Runs with equal items differ only in their seed."""
    items = {k: _canon_or_as_is(f, run.get(k, f.default)) for k, f in FIELDS.items() if f.groups}
    items.update({f"params.{k}": v for k, v in sorted(params.items())})
    return items


def _canon_or_as_is(f, v):
    """``_canon`` for a finished run's recorded setting: a partition file since moved or deleted is grouped by its
    recorded path (a report never fails on a file the run no longer needs)."""
    try:
        return _canon(f, v)
    except FedfeatError:
        return v
