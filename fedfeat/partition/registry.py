"""Partition schemes as classes (Flower Datasets' one class per partitioner): each scheme is one module in
``fedfeat.partition.kinds``, found there by name, and owns its parameters (a frozen ``Params`` dataclass), their
defaults and checks, its default seed, its draw, its piece of the partition key and its words in figure titles.
Adding a scheme is one file plus its test; everything else here is derived from the classes:

- ``SCHEMES`` (name -> class, in each class's ``order``) and ``get_scheme(name)``;
- ``scheme_fields()`` (every scheme parameter: the CLI options and the run specification's partition part),
  ``schemes_using(name)`` and ``fill_defaults(scheme, params)`` (the store's and CLI's defaults);
- partition keys (``fedfeat.partition.core.partition_key``) and their parsing (``parse_key``, for
  ``fedfeat.report.plots.readable_partition``).

>>> get_scheme("dirichlet").Params(alpha=0.5)
Dirichlet.Params(alpha=0.5, min_size=None)
>>> list(scheme_fields())[:3], schemes_using("alpha")
(['shards', 'alpha', 'min_size'], ['dirichlet', 'dirichlet-equal', 'dirichlet-joint'])
>>> fill_defaults("dirichlet-equal", {})
{'alpha': 0.5}

May import ``fedfeat.errors`` only: the scheme modules import this one (and ``fedfeat.partition.schemes``).
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import re
import types
import typing
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from fedfeat.errors import FedfeatError

__all__ = [
    "LONGTAIL_SEED",
    "SCHEMES",
    "Draw",
    "KeyPart",
    "NoParams",
    "Scheme",
    "describe_generic",
    "discover",
    "field_kind",
    "fill_defaults",
    "get_scheme",
    "key_parts",
    "parse_key",
    "plain_number",
    "register_scheme",
    "scheme_fields",
    "schemes_using",
]

# CLIP2FL main.py: np.random.seed(7) before train_long_tail: the seed whenever a long tail is cut
LONGTAIL_SEED = 7

# name -> class in (order, name) order; an OrderedDict so that hypothesis' sampled_from takes it as it is
SCHEMES: OrderedDict[str, type[Scheme]] = OrderedDict()


def plain_number(x) -> int | float:
    """A number as the int it is, or a float (JSON-safe, and '100' not '100.0' in keys)."""
    x = float(x)
    return int(x) if x.is_integer() else x


# ----------------------------------------------------------------------------------------- the base class


@dataclass(frozen=True)
class NoParams:
    """The parameters of a scheme that has none besides clients, seed and imbalance factor."""


@dataclass(frozen=True)
class Draw:
    """What every scheme's draw gets besides its own parameters."""

    labels: np.ndarray  # [N] int64 class ids to partition (the long-tailed subset when one is cut)
    clients: int
    seed: int
    n_classes: int  # the split's (labels < n_classes)
    test_labels: np.ndarray | None = None  # [M] int64, the test split (schemes that draw its clients too)
    class_order: np.ndarray | None = None  # [n_classes] a permutation of the class ids (takes_class_order)
    class_order_name: str | None = None
    # [N] / [M] int64 domain ids of the rows (schemes with needs_domains: the store's <split>/domains)
    domains: np.ndarray | None = None
    test_domains: np.ndarray | None = None
    domain_names: tuple[str, ...] = ()
    # each domain's class ids (a combined store's domain_classes; the base half of each under base_novel), or None
    class_groups: tuple | None = None


_PATTERNS = {
    "int": r"\d+",
    "real": r"[0-9.]+(?:e[+-]?\d+)?",
    "text": r".+?",
}  # text: the shortest, so a later part still reads


@dataclass(frozen=True)
class KeyPart:
    """One recorded parameter's piece of a partition key, ``-<tag><value>``: before ``-c<clients>-s<seed>``, or
    after it (``after``: the pieces the key format gained later, so that older keys stay as they were)."""

    name: str  # the entry of Partition.params
    tag: str  # "a" writes alpha 0.1 as "-a0.1"
    words: str  # readable_partition's words for it, e.g. "α = {}"
    kind: str = "int"  # int | real | text: how the value is written and read back
    after: bool = False

    def text(self, value) -> str:
        if self.kind == "int":
            return str(int(value))
        return str(plain_number(value)) if self.kind == "real" else str(value)

    def pattern(self) -> str:
        return rf"(?:-{re.escape(self.tag)}(?P<{self.name}>{_PATTERNS[self.kind]}))?"


class Scheme:
    """One partition scheme. Subclasses set the class attributes, override ``draw`` (and ``check`` / ``record`` /
    ``describe`` where they need more than the default) and are registered with ``@register_scheme``.

    Every parameter a scheme takes besides ``clients``, ``seed`` and ``imbalance_factor`` is a field of its frozen
    ``Params`` dataclass, with ``metadata={"help": ..., "example": ...}`` (and optionally ``"check"``: value ->
    complaint or None, the range check of the run specification and the CLI, e.g. "must be >= 1, got 0") and its
    default (no default: the scheme needs it); ``store_defaults`` are the values ``fedfeat partition`` and
    ``fedfeat train`` use when none is given.
    """

    name: ClassVar[str]
    summary: ClassVar[str]  # one line for help texts
    source: ClassVar[str]  # the reference code it reproduces
    # place in SCHEMES (the first six are 10..60, in the order they came; a new scheme goes after them)
    order: ClassVar[int] = 1000
    seed: ClassVar[int]  # the reference code's seed
    Params: ClassVar[type] = NoParams
    store_defaults: ClassVar[dict[str, Any]] = {}
    key_parts: ClassVar[tuple[KeyPart, ...]] = ()
    words: ClassVar[str] = ""  # readable_partition's words, a format over the key's values ("" = the name)
    takes_imbalance: ClassVar[bool] = True  # may run on CLIP2FL's long tail (imbalance_factor)
    needs_test_labels: ClassVar[bool] = False  # partitions the test split with the same draws, and must
    uses_test_labels: ClassVar[bool] = False  # ... may (its test clients when given the test labels)
    takes_class_order: ClassVar[bool] = False  # make_partition's class_order / class_order_name
    needs_domains: ClassVar[bool] = False  # draws by each row's domain (a store that records domains)
    uses_domains: ClassVar[bool] = (
        False  # ... may (each dataset of a combined store apart; one domain without)
    )
    # the error when the test labels are missing or an imbalance factor is given that the scheme cannot take
    inputs_message: ClassVar[str] = ""

    @classmethod
    def default_seed(cls, imbalance_factor: float | None = None) -> int:
        """The seed of the reference code: CLIP2FL's 7 whenever the long tail is cut, the scheme's otherwise."""
        return LONGTAIL_SEED if imbalance_factor is not None else cls.seed

    @classmethod
    def fields(cls) -> tuple[dataclasses.Field, ...]:
        return dataclasses.fields(cls.Params)

    # values the draw treats as "not given" beyond the Params defaults (dirichlet: min_size 10 is FedNTD's rule)
    implied_values: ClassVar[dict[str, Any]] = {}

    @classmethod
    def implied(cls) -> dict[str, Any]:
        """What each parameter is when not given: ``store_defaults``, else the Params default (if not None), and
        ``implied_values``; a run given these values is the same run as one given none (its name's hash)."""
        out = {f.name: f.default for f in cls.fields() if f.default not in (dataclasses.MISSING, None)}
        out.update(cls.store_defaults)
        out.update(cls.implied_values)
        return out

    @classmethod
    def params(cls, given: dict[str, Any]) -> Any:
        """``Params`` from the scheme's parameters as passed (None = not passed): one line naming a missing one."""
        for f in cls.fields():
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if required and given.get(f.name) is None:
                m = f.metadata
                raise FedfeatError(
                    f"scheme {cls.name!r} needs {f.name} ({m['help']}); pass e.g. {f.name}={m['example']}"
                )
        return cls.check(cls.Params(**{k: v for k, v in given.items() if v is not None}))

    @classmethod
    def check(cls, params):
        """Range checks beyond the types (``make_partition`` checks those); returns the params to draw with."""
        return params

    @classmethod
    def check_inputs(cls, *, imbalance_factor, test_labels) -> None:
        """Refuse test labels or an imbalance factor the scheme cannot use, in one line."""
        if cls.needs_test_labels and test_labels is None:
            generic = (
                f"scheme {cls.name!r} needs the test labels (a store with a test split); pass test_labels"
            )
        elif not cls.takes_imbalance and imbalance_factor is not None:
            generic = f"scheme {cls.name!r} takes no imbalance factor; drop imbalance_factor"
        else:
            return
        raise FedfeatError(cls.inputs_message or generic)

    @classmethod
    def draw(cls, d: Draw, params) -> tuple[list[np.ndarray], dict]:
        """``(clients, extra)``: each client's int64 positions into ``d.labels``, and entries added to the
        partition's params (JSON-safe; e.g. ``test_clients``)."""
        raise NotImplementedError

    @classmethod
    def record(cls, params) -> dict:
        """The parameters as Partition.params records them (JSON-safe): every field that is set."""
        out = {}
        for f in cls.fields():
            v = getattr(params, f.name)
            if v is not None:
                out[f.name] = _converter(f)(v)
        return out

    @classmethod
    def describe(cls, values: dict[str, str]) -> str:
        """The scheme in words from the key's values (``parse_key``), e.g. ``Dir(α = 0.1)``."""
        try:
            return cls.words.format(**values) if cls.words else cls.name
        except (KeyError, IndexError):  # a key without a parameter the words need: the name and what it has
            return describe_generic(cls.name, [p for p in cls.key_parts if not p.after], values)


def describe_generic(name: str, parts, values: dict[str, str]) -> str:
    """A scheme in words from its name and its key parts' words (``KeyPart.words``), e.g. ``newscheme, α = 2``."""
    return ", ".join(
        [name] + [p.words.format(values[p.name]) for p in parts if values.get(p.name) is not None]
    )


# ----------------------------------------------------------------------------------------- the registry


def _base_type(tp) -> type:
    """``int`` for ``int`` and ``int | None`` (the field types that the scheme parameters have)."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


def _converter(f: dataclasses.Field):
    return {int: int, float: float}.get(_base_type(f.type), str)


def field_kind(f: dataclasses.Field) -> type:
    """The type a scheme parameter's values have: ``int``, ``float`` or ``str`` (``None`` aside)."""
    return _base_type(f.type)


def register_scheme(cls: type[Scheme]) -> type[Scheme]:
    """Class decorator: add a scheme to ``SCHEMES``. A programming error (a name taken twice, a parameter without
    help, two schemes giving one parameter name different types or helps) is an exception at import."""
    for attr in ("name", "summary", "source", "seed"):
        if getattr(cls, attr, None) in (None, ""):
            raise TypeError(f"scheme class {cls.__name__} must set {attr}")
    if cls.name in SCHEMES and SCHEMES[cls.name] is not cls:
        raise TypeError(f"partition scheme {cls.name!r} is registered twice ({cls.__name__})")
    if not (dataclasses.is_dataclass(cls.Params) and cls.Params.__dataclass_params__.frozen):
        raise TypeError(f"{cls.__name__}.Params must be a frozen dataclass")
    known = scheme_fields()
    # the annotations as types (strings under `from __future__ import annotations`): scheme_fields() gives types
    hints = typing.get_type_hints(cls.Params)
    for f in cls.fields():
        f.type = hints[f.name]
        if not f.metadata.get("help") or not f.metadata.get("example"):
            raise TypeError(f"{cls.__name__}.Params.{f.name} needs metadata help and example")
        if not callable(f.metadata.get("check", callable)):
            raise TypeError(
                f"{cls.__name__}.Params.{f.name}: metadata check must be value -> complaint or None"
            )
        if field_kind(f) not in (int, float, str):
            raise TypeError(
                f"{cls.__name__}.Params.{f.name}: type {f.type!r} is not int, float or str (or | None)"
            )
        other = known.get(f.name)
        if other is not None and (
            field_kind(other) is not field_kind(f) or other.metadata["help"] != f.metadata["help"]
        ):
            raise TypeError(
                f"{cls.__name__}.Params.{f.name} disagrees with another scheme's {f.name} on its type or help"
            )
    if cls.needs_test_labels:
        cls.uses_test_labels = True
    if cls.needs_domains:
        cls.uses_domains = True
    SCHEMES[cls.name] = cls
    for name in sorted(SCHEMES, key=lambda n: (SCHEMES[n].order, n)):
        SCHEMES.move_to_end(name)
    return cls


def discover() -> None:
    """Import every module of ``fedfeat.partition.kinds``, in module-name order (each registers its scheme).
    ``fedfeat.partition`` calls it once, at the end of its import."""
    pkg = importlib.import_module("fedfeat.partition.kinds")
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{pkg.__name__}.{info.name}")


def get_scheme(name) -> type[Scheme]:
    """The scheme class called ``name`` (one line listing the known schemes otherwise)."""
    if not isinstance(name, str):
        raise FedfeatError(
            f"scheme must be a string, got {type(name).__name__} {name!r:.60}; choose one of: {', '.join(SCHEMES)}"
        )
    if name not in SCHEMES:
        hint = (
            " (the long tail is not a scheme: pass imbalance_factor with any scheme)"
            if name == "longtail"
            else ""
        )
        raise FedfeatError(f"unknown partition scheme {name!r}{hint}; choose one of: {', '.join(SCHEMES)}")
    return SCHEMES[name]


def scheme_fields() -> dict[str, dataclasses.Field]:
    """Every scheme parameter by name (the union of the schemes' ``Params`` fields, in first-seen order)."""
    out: dict[str, dataclasses.Field] = {}
    for cls in SCHEMES.values():
        for f in cls.fields():
            out.setdefault(f.name, f)
    return out


def schemes_using(param: str) -> list[str]:
    """The schemes that take the parameter ``param``."""
    return [n for n, cls in SCHEMES.items() if any(f.name == param for f in cls.fields())]


def fill_defaults(scheme: str, params: dict) -> dict:
    """``params`` with the scheme's ``store_defaults`` for those not given (None); the others as they are."""
    out = dict(params)
    for k, v in get_scheme(scheme).store_defaults.items():
        if out.get(k) is None:
            out[k] = v
    return out


# ----------------------------------------------------------------------------------------- keys


def key_parts(scheme: str) -> tuple[KeyPart, ...]:
    """The scheme's key parts; for a name no scheme has, every scheme's (in SCHEMES order, each name once)."""
    if scheme in SCHEMES:
        return SCHEMES[scheme].key_parts
    seen: dict[str, KeyPart] = {}
    for cls in SCHEMES.values():
        for p in cls.key_parts:
            seen.setdefault(p.name, p)
    return tuple(seen.values())


def _key_regex(name_pattern: str, parts) -> re.Pattern:
    before = "".join(p.pattern() for p in parts if not p.after)
    after = "".join(p.pattern() for p in parts if p.after)
    return re.compile(rf"^(?P<scheme>{name_pattern}){before}-c(?P<clients>\d+)(?:-s(?P<seed>\d+))?{after}$")


def parse_key(key: str) -> dict | None:
    """A partition key read back: ``{"scheme", "cls" (None for a name no scheme has), "imbalance_factor",
    "clients", "seed" (None when absent), "values" (key part name -> text), "parts"}``; None for another format.

    >>> r = parse_key("lt100+dirichlet-a0.1-c10-s7")
    >>> r["scheme"], r["imbalance_factor"], r["values"], r["seed"]
    ('dirichlet', '100', {'alpha': '0.1'}, '7')
    """
    rest, imb, b2n, shots = str(key), None, False, None
    m = re.match(rf"^lt({_PATTERNS['real']})\+(.+)$", rest)
    if m:
        imb, rest = m.group(1), m.group(2)
    if rest.startswith("b2n+"):  # the base-to-novel protocol
        b2n, rest = True, rest[4:]
    m = re.match(r"^shots(\d+)\+(.+)$", rest)  # k shots per client class
    if m:
        shots, rest = m.group(1), m.group(2)
    # a known name (longest first: "dirichlet-equal-..." is not "dirichlet" with "-equal..."), then any name
    names = sorted((n for n in SCHEMES if rest.startswith(n + "-")), key=len, reverse=True)
    for cls, rx in [(SCHEMES[n], _key_regex(re.escape(n), SCHEMES[n].key_parts)) for n in names] + [
        (None, _key_regex(r"[a-z][a-z-]*?", key_parts("")))
    ]:
        k = rx.match(rest)
        if k and (cls is not None or k.group("scheme") not in SCHEMES):
            g = k.groupdict()
            parts = cls.key_parts if cls is not None else key_parts("")
            values = {p.name: g[p.name] for p in parts if g.get(p.name) is not None}
            return {"scheme": g["scheme"], "cls": cls, "imbalance_factor": imb, "clients": g["clients"],
                    "seed": g["seed"], "values": values, "parts": parts, "base_novel": b2n,
                    "client_shots": shots}  # fmt: skip
    return None
