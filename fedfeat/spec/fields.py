"""The run specification's parts and fields (``fedfeat.spec``'s docstring says what is derived from them)."""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from dataclasses import dataclass, field

from fedfeat.spec.checks import (  # each setting's range check: value, spec -> complaint or None
    _choice,
    _class_order,
    _client_shots,
    _device,
    _fraction,
    _imbalance,
    _kernels,
    _local_test_modes,
    _local_val,
    _positive,
    _preset,
    _query_val,
    _scheme_unstack,
    _schemes,
    _shot_thresholds,
    _val_split,
)

# the caches a setting keys (``cache_key``); "store" < "partition" < "data"; "live" is the live text encoder
CACHES = ("store", "partition", "data", "live")


def setting(
    default,
    help: str,
    *,
    key: str | None = None,
    caches: tuple[str, ...] = (),
    per_run: bool = False,
    in_hash: bool = True,
    identity: bool = True,
    sweep: bool = True,
    drawn: bool = False,
    check=None,
    unstack=None,
    examples: tuple = (),
    context: dict | None = None,
    metavar: str | None = None,
    groups: bool | None = None,
    canon=None,
):
    """A run setting. ``key``: its flat name in config.toml, grid files and ``--flags`` (default: the field
    name). ``caches``: the session caches whose entries it keys. ``per_run``: runs that differ in it may still be
    made as one stacked program (seed, participation, the run's name). ``in_hash``: it enters the run name's
    settings hash (off for what the name shows or what says where, not what). ``identity``: it is part of what a
    checkpoint is checked against on resume (off for where the run is written or read from). ``drawn``: a setting
    only a run that draws clients reads (reset for a method that draws none). ``check(value, spec) -> str | None``:
    the one-line complaint about a bad value. ``sweep``: True (a grid axis), ``"fixed"`` (one value for a whole
    sweep) or False (not a sweep's: the run name, the replayed store's fingerprint). ``unstack(value) -> str | None``: why a run with this value is made
    on its own (e.g. the loop engine). ``examples``: values a sweep may vary it to, with the settings ``context``
    in which it means something (tests: ``tests/test_spec_stacking.py``). ``groups``: runs that differ in it are
    different settings in a seed table (``report --seeds``; default: ``identity``; the seed is what a seed table pools).
    ``canon(value) -> what the value stands for`` in the run name's hash, cache keys, stack groups, the checkpoint
    identity and seed-table groups (default: the value itself; a partition file: its content hash)."""
    return field(
        default=default,
        metadata={
            "help": help,
            "key": key,
            "caches": tuple(caches),
            "per_run": per_run,
            "in_hash": in_hash,
            "identity": identity,
            "sweep": sweep,
            "drawn": drawn,
            "check": check,
            "unstack": unstack,
            "examples": tuple(examples),
            "context": dict(context or {}),
            "groups": identity if groups is None else groups,
            "metavar": metavar,
            "canon": canon,
        },
    )


# ------------------------------------------------------------------------------------------------ the parts

ALL = CACHES


@dataclass(frozen=True)
class DataSpec:
    """What the run reads: the store and how its splits are loaded."""

    store: str = setting(
        "cache/synth-cifar10.zarr",
        "Feature store: a path or an fsspec URL (file://, memory://, s3:// with s3fs, gs:// with gcsfs). "
        "Default cache/synth-cifar10.zarr.",
        caches=ALL,
        in_hash=False,
        identity=False,
    )
    store_fingerprint: str | None = setting(
        None,
        "A replayed config's store must have this fingerprint hash (config.toml writes it).",
        in_hash=False,
        identity=False,
        groups=True,  # the store's content: runs on two copies of one store are one setting
        sweep=False,
    )
    preset: str | None = setting(
        None,
        "A Fed-MP dataset preset (caltech101, food101, flowers102, ucf101, fgvc-aircraft, stanford-cars): "
        "disjoint-classes, 10 shots, 10 clients, all clients, 2 rounds and the reference code's partition seed "
        "for that dataset; flags override it (README, open vocabulary).",
        caches=("partition", "data"),
        check=_preset,
        unstack=lambda v: None if v is None else "a preset's open-vocabulary runs are made one by one",
        examples=("fgvc-aircraft",),
    )
    local_val: str | None = setting(
        None,
        "Open vocabulary: each client's train/validation split: paper (2 of 10 shots per class, default), "
        "code (Fed-MP's 80/20 permutation) or none.",
        caches=("data",),
        check=_local_val,
        context={"partition": "disjoint-classes"},
        examples=("code", "none"),
    )
    query_val: str | None = setting(
        None,
        "Open vocabulary: the novel-class query set: paper (20 % validation / 80 % test, default) or code "
        "(all test).",
        caches=("data",),
        check=_query_val,
        context={"partition": "disjoint-classes"},
        examples=("code",),
    )
    class_order: str | None = setting(
        None,
        "disjoint-classes' class order: preset (default with --preset: the store's classes matched by name "
        "to the preset's list and drawn in the reference code's order) or store (the store's class ids).",
        caches=("partition", "data"),
        check=_class_order,
        context={"partition": "disjoint-classes"},
        examples=("store",),
    )
    local_test: str | None = setting(
        None,
        "none (default); proportional: split the test set among the clients in proportion to their "
        "training class counts; joint: the test split drawn with --partition dirichlet-joint (FedCoPL). Reports "
        "local_acc, the mean of per-client accuracies (FedCoPL's metric).",
        caches=("data",),
        check=_choice(_local_test_modes),
        unstack=lambda v: (
            None
            if v in (None, "none")
            else "local test splits: per-client accuracies are measured run by run"
        ),
        examples=("proportional",),
    )
    val_split: float | None = setting(
        None,
        "Hold out this fraction of each test class as a validation set (a fixed seed: the same split "
        "for every --seed): val_acc is measured on it, test metrics leave it out, and `report --best` selects on "
        "it. Open-vocabulary runs validate on the query set's 20 % (--query-val paper) instead. Default: none.",
        caches=("data",),
        check=_val_split,
        examples=(0.2, 0.5),
    )
    pretrained: str | None = setting(
        None,
        "Prompt-learning methods: the checkpoint the store was encoded with (checked by sha256), when it "
        "is no longer where `fedfeat encode` read it; or the open_clip tag's file.",
        caches=("live",),
        in_hash=False,
        identity=False,
        sweep="fixed",  # where a file is, not what the run is: one value for a whole sweep (runs differing in it
        # would have one name)
    )


# the partition part's common settings; the scheme parameters are added from the registry (``_partition_part``)
_PARTITION_COMMON = [
    (
        "scheme",
        str,
        setting(
            "dirichlet",
            "Partition scheme (fedfeat partition --help lists each one's parameters), or a partition made "
            'elsewhere: a FILE.json in the format `fedfeat partition --export` writes ({"clients": [[row, ...], '
            "...]}, checked against the store; fedfeat/partition/external.py), whose content names the run. "
            "Default dirichlet.",
            key="partition",
            caches=("partition", "data"),
            drawn=True,
            check=lambda v, s: _scheme_or_file(v, s),
            canon=lambda v: _partition_identity(v),
            unstack=lambda v: _scheme_unstack(v),
            examples=("shard", "iid"),
        ),
    ),
    (
        "clients",
        int,
        setting(
            100,
            "Number of clients. Default 100 (with a partition file: the file's count).",
            caches=("partition", "data"),
            drawn=True,
            check=_positive("clients", ""),
            examples=(5, 20),
        ),
    ),
    (
        "seed",
        typing.Optional[int],
        setting(
            None,
            "Partition seed (default: the scheme's reference code's: FedNTD's 19940817; CLIP2FL's 7 for "
            "dirichlet-equal and any long tail; FedCoPL's 2 for dirichlet-joint).",
            key="partition_seed",
            caches=("partition", "data"),
            drawn=True,
            examples=(3,),
        ),
    ),
    (
        "imbalance_factor",
        typing.Optional[float],
        setting(
            None,
            "Long-tail the training split first (e.g. 100), as in CLIP2FL (any scheme).",
            caches=("partition", "data"),
            check=_imbalance,
            examples=(2.0,),
        ),
    ),
    (
        "base_novel",
        bool,
        setting(
            False,
            "Base-to-novel protocol (CoOp's subsample_classes, FedTPG): the clients draw from the first "
            "ceil(K/2) classes (label order) only; the other classes are novel, tested over the novel classes "
            "(test_acc), the base ones over the base classes (base_acc), and their harmonic mean (hm). Any scheme "
            "that does not draw the test split.",
            caches=("partition", "data"),
            examples=(True,),
        ),
    ),
    (
        "client_shots",
        typing.Optional[int],
        setting(
            None,
            "Few-shot: each client keeps at most k samples of each of its classes, the first k it drew (FedOTP / "
            "FedPGP's k shots per class and client). Any scheme.",
            caches=("partition", "data"),
            check=_client_shots,
            examples=(2,),
        ),
    ),
]


def _scheme_or_file(v, s):
    """``--partition``: a scheme name, or a partition file (``fedfeat.partition.external``)."""
    from fedfeat.partition.external import check_setting, is_partition_file

    if is_partition_file(v):
        return check_setting(v, s)
    bad = _choice(_schemes)(v, s)
    return (
        None
        if bad is None
        else f"{bad} (or a partition file FILE.json, as `fedfeat partition --export` writes)"
    )


def _partition_identity(v):
    from fedfeat.partition.external import identity

    return identity(v)


def _scheme_setting(name: str, f: dataclasses.Field):
    from fedfeat.partition.registry import schemes_using

    users = schemes_using(name)
    help_ = f.metadata.get("help", name)
    typ = _scalar(f.type)
    ex = f.metadata.get("examples") or tuple(
        typ(x) for x in str(f.metadata.get("example", "")).split(",") if x.strip()
    )
    own = f.metadata.get("check")  # the scheme's own range check: value -> complaint or None
    from fedfeat.partition.registry import SCHEMES

    dflt = [f"{SCHEMES[u].store_defaults[name]} ({u})" for u in users if name in SCHEMES[u].store_defaults]
    help_ = help_.rstrip(".") + (f". Default {', '.join(dflt)}." if dflt else ".")
    return setting(
        None,
        f"--partition {' / '.join(users)}: {help_}",
        caches=("partition", "data"),
        drawn=True,
        check=None if own is None else (lambda v, s: own(v)),
        context={"partition": users[0]},
        examples=tuple(ex),
    )


def _base(t):
    args = [a for a in typing.get_args(t) if a is not type(None)]
    return args[0] if args else t


def _scalar(t) -> type:
    """int, float or str from a field's annotation (a string under ``from __future__ import annotations``)."""
    if isinstance(t, str):
        words = set(re.findall(r"[A-Za-z_]+", t))
        return next((c for c in (bool, int, float) if c.__name__ in words), str)
    return _base(t)


def _partition_part():
    from fedfeat.partition.registry import scheme_fields

    rows = [(n, t, f) for n, t, f in _PARTITION_COMMON]
    for name, f in scheme_fields().items():
        t = typing.Optional[_scalar(f.type)]
        rows.append((name, t, _scheme_setting(name, f)))
    cls = dataclasses.make_dataclass(
        "PartitionSpec", rows, frozen=True, namespace={"__doc__": "Who holds which sample (the partition)."}
    )
    cls.__module__ = __name__
    return cls


PartitionSpec = _partition_part()


@dataclass(frozen=True)
class EngineSpec:
    """How the rounds run."""

    rounds: int = setting(
        10, "Communication rounds. Default 10.", check=lambda v, s: None if v >= 0 else f"must be >= 0, got {v}",
        examples=(1, 3),
    )  # fmt: skip
    participation: float = setting(
        0.1,
        "Fraction of clients per round; max(1, int(p * clients)) are sampled. Default 0.1.",
        per_run=True,
        drawn=True,
        check=_fraction,
        examples=(0.5, 1.0),
    )
    seed: int = setting(
        0,
        "Run seed (client sampling, shuffles, synthetic draws).",
        per_run=True,
        in_hash=False,
        groups=False,  # the replicate: report --seeds pools the runs that differ only in it
        examples=(5, 7),
    )
    eval_every: int = setting(
        1,
        "Evaluate on the test split at round 0, every N-th round and the last (best acc is over those rounds). "
        "Default 1.",
        check=lambda v, s: None if v >= 1 else f"must be >= 1, got {v} (1: evaluate every round)",
        examples=(2,),
    )
    engine: str = setting(
        "batched",
        "batched (all sampled clients at once) or loop (one client after another). Default batched.",
        check=_choice(("batched", "loop")),
        unstack=lambda v: None if v == "batched" else "the loop engine makes one client after another",
        examples=("loop",),
    )
    kernel: str = setting(
        "auto",
        "auto (fused CPU kernel where a method has one, on CPU with the batched engine; else torch), "
        "fused or torch (the batched tensor program). Default auto.",
        check=_choice(_kernels),
        examples=("torch",),
    )
    device: str = setting(
        "auto",
        "auto, cpu or cuda. Default auto.",
        caches=("data", "live"),
        identity=False,
        check=_device,
        examples=("cpu",),
    )


def _dp_only(mode: str | None = None):
    """A DP setting's check: it means something only with ``--dp`` (``mode``: that level)."""

    def check(v, s):
        dp = getattr(getattr(s, "privacy", None), "dp", None)
        if v is None or (dp is not None and mode in (None, dp)):
            return None
        return f"applies to --dp {mode or 'client|sample'} runs only; add --dp {mode or 'client'} or drop it"

    return check


def _above0(v, s):
    return None if v is None or (math.isfinite(v) and v > 0) else f"must be > 0, got {v}"


def _delta(v, s):
    return (
        None if v is None or (math.isfinite(v) and 0 < v < 1) else f"must be in (0, 1), got {v} (e.g. 1e-5)"
    )


def _dp_checks(*checks):
    def check(v, s):
        return next((c for c in (f(v, s) for f in checks) if c), None)

    return check


_DP = {"dp": "client", "noise_multiplier": 1.0}  # the stacking test's context: a DP run needs its noise


@dataclass(frozen=True)
class PrivacySpec:
    """Differential privacy (``fedfeat.engine.privacy``, ``fedfeat.engine.accountant``): off unless ``dp`` is set."""

    dp: str | None = setting(
        None,
        "Differential privacy: client (DP-FedAvg: each client's update clipped, the uniform mean noised at the "
        "server) or sample (DP-SGD: each sample's gradient clipped, each step noised). Needs --epsilon or "
        "--noise-multiplier; `fedfeat methods` says which methods have which level. Default: none.",
        check=_choice(("client", "sample")),
        unstack=lambda v: "sample-level DP runs are made one by one" if v == "sample" else None,
        per_run=True,
        examples=("client", "sample"),
        context={"noise_multiplier": 1.0},
    )
    epsilon: float | None = setting(
        None,
        "DP: the target epsilon of the whole run at --delta; the noise multiplier is calibrated to it by the "
        "accountant (instead of --noise-multiplier).",
        per_run=True,
        check=_dp_checks(_dp_only(), _above0),
        examples=(8.0,),
        context={"dp": "client"},
    )
    delta: float | None = setting(
        None,
        "DP: delta, below 1/N (N: clients at client level, training samples at sample level). Default 1e-5.",
        per_run=True,
        check=_dp_checks(_dp_only(), _delta),
        examples=(1e-6,),
        context=_DP,
    )
    noise_multiplier: float | None = setting(
        None,
        "DP: the Gaussian noise's std over the clipping norm (instead of --epsilon).",
        per_run=True,
        check=_dp_checks(_dp_only(), lambda v, s: None if v is None or v >= 0 else f"must be >= 0, got {v}"),
        examples=(0.5,),
        context={"dp": "client"},
    )
    clip_norm: float | None = setting(
        None,
        "DP: the clipping norm C (adaptive clipping: its start). Default 0.1 at client level (Flower's), 1.0 at "
        "sample level (Opacus' examples).",
        per_run=True,
        check=_dp_checks(_dp_only(), _above0),
        examples=(0.5,),
        context=_DP,
    )
    dp_clip: str | None = setting(
        None,
        "DP, client level: fixed (default) or adaptive clipping (Andrew et al. 2021: C follows the --dp-quantile "
        "of the update norms, privately).",
        per_run=True,
        check=_dp_checks(_dp_only("client"), _choice(("fixed", "adaptive"))),
        examples=("adaptive",),
        context={"dp": "client", "noise_multiplier": 0.1},
    )
    dp_quantile: float | None = setting(
        None,
        "DP, adaptive clipping: the quantile of the update norms C tracks. Default 0.5.",
        per_run=True,
        check=_dp_checks(_dp_only("client"), _fraction),
        examples=(0.8,),
        context={"dp": "client", "noise_multiplier": 0.1, "dp_clip": "adaptive"},
    )
    dp_clip_lr: float | None = setting(
        None,
        "DP, adaptive clipping: the geometric step of C per round. Default 0.2.",
        per_run=True,
        check=_dp_checks(_dp_only("client"), _above0),
        examples=(0.5,),
        context={"dp": "client", "noise_multiplier": 0.1, "dp_clip": "adaptive"},
    )
    dp_count_std: float | None = setting(
        None,
        "DP, adaptive clipping: the std of the noise on the unclipped count. Default: clients per round / 20.",
        per_run=True,
        check=_dp_checks(_dp_only("client"), _above0),
        examples=(1.0,),
        context={"dp": "client", "noise_multiplier": 0.1, "dp_clip": "adaptive"},
    )
    dp_accountant: str | None = setting(
        None,
        "DP: the accountant (dp-accounting): rdp (Renyi DP, default) or pld (privacy loss distributions, tighter).",
        per_run=True,
        check=_dp_checks(_dp_only(), _choice(("rdp", "pld"))),
        examples=("pld",),
        context=_DP,
    )


@dataclass(frozen=True)
class MethodSpec:
    """The method and its hyperparameters (the method's own ``Params`` dataclass types them:
    ``fedfeat.runs.config.check_method_params``)."""

    name: str = setting(
        "fst-cbdg", "Method name (see `fedfeat methods`). Default fst-cbdg.", key="method", in_hash=False,
        examples=("fedavg", "fedprox"),
    )  # fmt: skip


@dataclass(frozen=True)
class OutputSpec:
    """Where and how the run is written."""

    out: str = setting(
        "runs",
        "Parent directory of run directories, local (a URL is refused). Default runs/.",
        in_hash=False,
        identity=False,
        per_run=True,
        examples=("runs-b",),
    )
    name: str | None = setting(
        None,
        "Run directory name, one path component (default: method__store__partition__seedS__hash, the hash "
        "standing for every other non-default setting).",
        in_hash=False,
        identity=False,
        per_run=True,
        sweep=False,
    )
    shot_thresholds: str | None = setting(
        None,
        "'many,few' training counts for many/medium/few accuracy, e.g. 1500,200 (CIFAR-10-LT).",
        check=_shot_thresholds,
        examples=("100,20",),
    )


PARTS = {"data": DataSpec, "partition": PartitionSpec, "engine": EngineSpec, "method": MethodSpec,
         "output": OutputSpec, "privacy": PrivacySpec}  # fmt: skip


# ------------------------------------------------------------------------------------------------ flat view


@dataclass(frozen=True)
class Field:
    """One setting as the flat record, config.toml, grid files and flags name it."""

    key: str  # flat name: config.toml, grid files, --flag
    part: str  # RunSpec part
    name: str  # field name within the part
    type: type  # int, float or str (the TOML type)
    optional: bool
    default: typing.Any
    meta: dict

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    def __getattr__(self, item):  # the metadata as attributes: field.help, field.caches, ...
        try:
            return self.__dict__["meta"][item]
        except KeyError:
            raise AttributeError(item) from None


def _fields() -> dict[str, Field]:
    out: dict[str, Field] = {}
    for part, cls in PARTS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            t = hints[f.name]
            base = _base(t)
            key = f.metadata.get("key") or f.name
            if key in out:
                raise RuntimeError(f"run setting {key} declared twice ({out[key].part}, {part})")
            out[key] = Field(key, part, f.name, base, base is not t, f.default, dict(f.metadata))
    return out


# config.toml's key order: the order runs were written in before the specification (their files stay byte for
# byte what they were); settings declared later follow in declaration order
_TOML_ORDER = ("method", "store", "partition", "clients", "participation", "rounds", "seed", "engine", "kernel",
               "device", "out", "alpha", "shards", "imbalance_factor", "partition_seed", "min_size", "name",
               "shot_thresholds", "shots", "local_val", "query_val", "store_fingerprint", "preset", "eval_every",
               "local_test", "val_split", "class_order", "pretrained")  # fmt: skip


def _ordered(fields: dict[str, Field]) -> dict[str, Field]:
    first = [k for k in _TOML_ORDER if k in fields]
    return {k: fields[k] for k in [*first, *(k for k in fields if k not in first)]}


FIELDS: dict[str, Field] = _ordered(_fields())
DEFAULTS: dict = {k: f.default for k, f in FIELDS.items()}
TYPES: dict = {k: f.type for k, f in FIELDS.items() if f.type is not str}  # every other key is a string
SWEEPABLE: tuple[str, ...] = tuple(k for k, f in FIELDS.items() if f.sweep is True)  # a grid axis
SWEEP_FIXED: tuple[str, ...] = tuple(k for k, f in FIELDS.items() if f.sweep == "fixed")  # one value a sweep


def _record():
    rows = [(k, f.type if not f.optional else typing.Optional[f.type], field(default=f.default))
            for k, f in FIELDS.items()]  # fmt: skip
    rows.append(("params", dict, field(default_factory=dict)))
    cls = dataclasses.make_dataclass(
        "RunConfig",
        rows,
        namespace={
            "__doc__": "A run's settings as one flat record (the keys of config.toml), generated from the run "
            "specification (``fedfeat.spec``); ``spec`` gives the typed tree.",
            "spec": property(lambda self: to_spec(self)),
        },
    )
    cls.__module__ = "fedfeat.runs.config"
    return cls


RunConfig = _record()


@dataclass(frozen=True)
class RunSpec:
    """A run's settings as a typed, frozen tree (``RunConfig.spec``); ``params`` are the method's
    hyperparameters as given (``--set``), typed by the method's ``Params``."""

    data: DataSpec
    partition: PartitionSpec  # type: ignore[valid-type]
    engine: EngineSpec
    method: MethodSpec
    output: OutputSpec
    privacy: PrivacySpec
    params: tuple = ()  # sorted (key, value) pairs: hashable, frozen


def to_spec(cfg) -> RunSpec:
    parts = {}
    for part, cls in PARTS.items():
        parts[part] = cls(**{f.name: getattr(cfg, k) for k, f in FIELDS.items() if f.part == part})
    return RunSpec(**parts, params=tuple(sorted((str(k), v) for k, v in (cfg.params or {}).items())))


def from_spec(spec: RunSpec):
    flat = {k: getattr(getattr(spec, f.part), f.name) for k, f in FIELDS.items()}
    return RunConfig(**flat, params=dict(spec.params))
