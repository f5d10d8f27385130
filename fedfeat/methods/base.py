"""The method interface and the registry."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from fedfeat.engine.context import ENGINE_STATE_KEYS, Context, RoundPlan, fedavg, param_bytes, sample_clients
from fedfeat.engine.optim import BatchedSGD
from fedfeat.errors import FedfeatError

REGISTRY: dict[str, type[Method]] = {}


def register(cls):
    """Class decorator: add a method to the registry under ``cls.name``.

    The class's capabilities (``CAPABILITIES``) are checked first: each must have its declared type, and a class
    attribute one or two edits away from a capability's name (``needs_live_txt``) is a misspelling, refused (a
    one-line ``FedfeatError`` naming the capability meant) rather than silently ignored.

    Registering a plugin's name again replaces the old class with a ``UserWarning`` naming both (a notebook cell
    that redefines a method is run again). A built-in's name (a class from a ``fedfeat.`` module: ``is_builtin``)
    cannot be taken by a plugin: that is a one-line ``FedfeatError`` naming the plugin's module and a free name, so
    that a run recorded as ``fedavg`` is always fedfeat's FedAvg."""
    if not isinstance(cls, type) or not issubclass(cls, Method):
        raise FedfeatError(
            f"register takes a Method subclass, got {type(cls).__name__} {_show(cls)}; decorate the method's class "
            "(@register above class MyMethod(Method))"
        )
    if not isinstance(cls.name, str) or not cls.name:
        raise FedfeatError(f"{cls.__qualname__} has no name; set the class attribute name = 'my-method'")
    check_capabilities(cls)
    for key, text in declared_ranges(cls.Params).items():  # hyperparameter ranges: declared in a form we read
        check_range_declaration(key, text, cls.name)
    old = REGISTRY.get(cls.name)
    if old is not None and old is not cls:
        if is_builtin(old) and not is_builtin(cls):
            raise FedfeatError(
                f"method plugin {_where(cls)} registers the name {cls.name!r}, which is fedfeat's built-in "
                f"{_where(old)}; a plugin cannot replace a built-in method: give it a name of its own, e.g. "
                f"name = {_free_name(cls)!r}"
            )
        warnings.warn(
            f"method {cls.name}: {_where(old)} replaced by {_where(cls)}", UserWarning, stacklevel=2
        )
    REGISTRY[cls.name] = cls
    return cls


def _where(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def is_builtin(cls) -> bool:
    """Whether a method class (or instance) is fedfeat's own: defined in a ``fedfeat.`` module. Every other class is
    a plugin, which a run records by module, distribution and version (``plugin_info``)."""
    cls = cls if isinstance(cls, type) else type(cls)
    module = getattr(cls, "__module__", "") or ""
    return module == "fedfeat" or module.startswith("fedfeat.")


def _free_name(cls) -> str:
    """A registry name for a plugin class that takes a built-in's: the name with the plugin's package appended."""
    pkg = (cls.__module__ or "plugin").split(".")[0].strip("_").replace("_", "-") or "plugin"
    name = f"{cls.name}-{pkg}"
    i = 2
    while name in REGISTRY:
        name, i = f"{cls.name}-{pkg}{i}", i + 1
    return name


# distribution of a plugin module's top-level package, as its entry point named it (``load_plugins``): found even
# where the distribution lists no files (an editable install, a bare .dist-info)
PLUGIN_DISTRIBUTIONS: dict[str, tuple[str, str | None]] = {}


def plugin_info(cls) -> dict | None:
    """What a run records about a method that is not fedfeat's own (``is_builtin``): ``{"class", "module", "file",
    "source_sha256", "distribution", "version"}`` -- the class and its module, the module's source file and its
    sha256 (the exact code that ran), and the installed distribution that provides it with its version
    (``importlib.metadata``; None for a class defined in a notebook or a script). None for a built-in."""
    import hashlib
    import inspect
    import sys

    cls = cls if isinstance(cls, type) else type(cls)
    if is_builtin(cls):
        return None
    module = cls.__module__ or ""
    out: dict = {"class": cls.__qualname__, "module": module, "file": None, "source_sha256": None}
    try:
        src = inspect.getsourcefile(sys.modules[module]) if module in sys.modules else None
    except (TypeError, OSError):  # a built-in or a class made in a notebook cell
        src = None
    if src:
        out["file"] = str(src)
        try:
            with open(src, "rb") as f:
                out["source_sha256"] = hashlib.sha256(f.read()).hexdigest()
        except OSError:
            pass
    out["distribution"], out["version"] = _distribution(module.split(".")[0])
    return out


def _distribution(top: str) -> tuple[str | None, str | None]:
    """``(distribution name, version)`` that installs the top-level package ``top``, or ``(None, None)``."""
    from importlib import metadata

    if top in PLUGIN_DISTRIBUTIONS:
        return PLUGIN_DISTRIBUTIONS[top]
    try:
        names = metadata.packages_distributions().get(top) or []
    except Exception:  # a damaged installation's metadata: the run is recorded without it
        names = []
    for name in names:
        try:
            return name, metadata.version(name)
        except Exception:
            continue
    return None, None


def _coerce(field: dataclasses.Field, value, hints: dict):
    """Parse a ``--set key=value`` string (or a TOML value) into the field's type."""
    typ = hints.get(field.name, field.type)
    if not isinstance(value, str):
        return _check_type(typ, value)
    origin = typing.get_origin(typ)
    args = [a for a in typing.get_args(typ) if a is not type(None)]
    if origin is typing.Union or origin is types.UnionType:
        typ = args[0] if args else str
        if value.lower() in ("none", "null"):
            return None
    if typ is bool:
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(value)
    if typ in (int, float, str):
        return typ(value)
    if typing.get_origin(typ) is typing.Literal:
        if value not in typing.get_args(typ):
            raise ValueError(value)
        return value
    return value


def _check_type(typ, value):
    """A TOML value (already typed) must have the field's type: no ``lr = true``, no ``batch_size = 1.5``."""
    origin = typing.get_origin(typ)
    if origin is typing.Union or origin is types.UnionType:
        if value is None:
            return None
        typ = next(a for a in typing.get_args(typ) if a is not type(None))
        origin = typing.get_origin(typ)
    if origin is typing.Literal:
        if value not in typing.get_args(typ):
            raise ValueError(value)
        return value
    if typ is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if typ is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if typ in (bool, str) and isinstance(value, typ):
        return value
    if typ in (bool, int, float, str):
        raise TypeError(value)
    return value


def _type_name(typ) -> str:
    if typing.get_origin(typ) in (
        typing.Union,
        types.UnionType,
    ):  # Optional[float] / float | None: "float or none"
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " or none"
    if typing.get_origin(typ) is typing.Literal:
        return "one of " + ", ".join(map(str, typing.get_args(typ)))
    return getattr(typ, "__name__", str(typ))


def _show(v, n: int = 60) -> str:
    r = repr(v)
    return r if len(r) <= n else r[: n - 3] + "..."


def check_overrides(cls: type[Method], overrides) -> dict:
    """Hyperparameter overrides for ``cls``, each parsed (a ``--set`` string) or checked (a typed value: a
    number, a string or a bool, of the field's type; numpy numbers are taken as Python numbers) into its field's
    type: ``{field name: value}``. ``overrides`` must be a dict with string keys; anything else, an unknown key
    or a value of the wrong type is one ``FedfeatError`` line naming the key, the type and an example."""
    if not isinstance(overrides, Mapping):
        raise FedfeatError(
            f"hyperparameters of {cls.name} must be a dict, got {type(overrides).__name__} {_show(overrides)}; "
            f"e.g. get_method({cls.name!r}, {{'lr': 0.01}}) (the CLI's --set lr=0.01)"
        )
    P = cls.Params
    fields = {f.name: f for f in dataclasses.fields(P)}
    hints = typing.get_type_hints(P)
    kw = {}
    for k, v in overrides.items():
        if not isinstance(k, str):
            raise FedfeatError(
                f"hyperparameter name {_show(k)} of {cls.name} is not a string; valid keys: "
                f"{', '.join(sorted(fields))}"
            )
        if isinstance(v, np.generic):  # numpy numbers and bools: as Python's
            v = v.item()
        key = k.replace("-", "_")
        if key not in fields:
            raise FedfeatError(
                f"method {cls.name} has no hyperparameter '{k}'; valid keys: {', '.join(sorted(fields))}"
            )
        try:
            kw[key] = _coerce(fields[key], v, hints)
        except (TypeError, ValueError):
            raise FedfeatError(
                f"bad value {_show(v)} for {cls.name}.{key}: expected {_type_name(hints.get(key, fields[key].type))}, "
                f"e.g. --set {key}={fields[key].default}"
            ) from None
    return kw


def make_params(cls: type[Method], overrides: dict) -> object:
    """``cls``'s params dataclass with ``overrides`` (``check_overrides``), finite and validated."""
    kw = check_overrides(cls, overrides)
    p = cls.Params(**kw)
    for k, v in dataclasses.asdict(p).items():
        if isinstance(v, float) and not math.isfinite(v):
            raise FedfeatError(f"{cls.name}.{k} = {v} is not finite; hyperparameters must be finite numbers")
    check_ranges(p, cls.name)
    if hasattr(p, "validate"):
        p.validate()
    return p


# ---------------------------------------------------------------------------------------------- hyperparameter ranges
# the hyperparameters the engine itself reads from every method's params, with their valid ranges: the local plan
# (``make_plan``: batch_size, local_epochs) and ``Method.make_optimizer`` (lr, lr_decay, momentum, weight_decay)
ENGINE_RANGES = {
    "batch_size": ">= 1",
    "local_epochs": ">= 1",
    "lr": "> 0",
    "lr_decay": "(0, 1]",  # the per-round learning-rate factor: 1 = no decay
    "momentum": "[0, 1)",
    "weight_decay": ">= 0",
}

_RANGE = re.compile(
    r"^\s*(?:(?P<op>>=|>|<=|<)\s*(?P<x>\S+)|(?P<lb>[\[(])\s*(?P<lo>[^,\s]+)\s*,\s*(?P<hi>[^\])\s]+)\s*(?P<rb>[\])]))\s*$"
)


def parse_range(text: str) -> tuple[float, bool, float, bool]:
    """``">= 1"``, ``"> 0"``, ``"<= 5"``, ``"[0, 1)"``, ``"(0, 1]"`` -> ``(low, low included, high, high
    included)``, unbounded ends as -inf / inf. A declaration that is none of these is a one-line error."""
    if not isinstance(text, str):
        raise FedfeatError(f"range {_show(text)} is not a string such as '>= 0' or '[0, 1)'")
    return _parse_range(text)


@functools.cache
def _parse_range(text: str) -> tuple[float, bool, float, bool]:
    m = _RANGE.match(text)
    try:
        if m and m["op"]:
            x = float(m["x"])
            return {
                ">=": (x, True, math.inf, False),
                ">": (x, False, math.inf, False),
                "<=": (-math.inf, False, x, True),
                "<": (-math.inf, False, x, False),
            }[m["op"]]
        if m:
            return float(m["lo"]), m["lb"] == "[", float(m["hi"]), m["rb"] == "]"
    except ValueError:
        pass
    raise FedfeatError(
        f"range {text!r} is not one of '>= a', '> a', '<= a', '< a', '[a, b]', '(a, b)', '[a, b)', '(a, b]'"
    )


def check_range_declaration(key: str, text, method: str | None = None) -> tuple[float, bool, float, bool]:
    """``parse_range`` of a declared range, its error naming the method and the field (``register`` checks every
    declaration of a class so, before any run)."""
    try:
        return parse_range(text)
    except FedfeatError as e:
        raise FedfeatError(
            f"{method or 'method'}: RANGES[{key!r}]: {e}; fix the params class's RANGES"
        ) from None


def in_range(value, text: str) -> bool:
    lo, lo_in, hi, hi_in = parse_range(text)
    return (value > lo or (lo_in and value == lo)) and (value < hi or (hi_in and value == hi))


def declared_ranges(params) -> dict[str, str]:
    """``{field: range}`` that a params dataclass (or instance) declares for its numeric fields: ``ENGINE_RANGES``
    for the fields it has, then the ``RANGES`` class attribute of its classes (``RANGES = {"mu": ">= 0"}``), bases
    first, a subclass's range replacing its base's for the same field. ``make_params`` refuses a value outside."""
    P = params if isinstance(params, type) else type(params)
    names = {f.name for f in dataclasses.fields(P)} if dataclasses.is_dataclass(P) else set()
    out = {k: v for k, v in ENGINE_RANGES.items() if k in names}
    for c in reversed(P.__mro__):
        declared = vars(c).get("RANGES")
        if isinstance(declared, Mapping):
            out.update({k: v for k, v in declared.items() if k in names})
    return out


def check_ranges(params, method: str | None = None) -> None:
    """Refuse a numeric hyperparameter outside its declared range (``declared_ranges``) in one ``FedfeatError`` line
    naming the key, the value, the valid range and the default (None values -- an unset optional -- are skipped)."""
    where = f"{method}: " if method else ""
    for key, text in declared_ranges(params).items():
        v = getattr(params, key, None)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        lo, _, hi, _ = check_range_declaration(key, text, method)
        if not in_range(v, text):
            words = text if not (math.isfinite(lo) and math.isfinite(hi)) else f"in {text}"
            default = next((f.default for f in dataclasses.fields(params) if f.name == key), None)
            raise FedfeatError(
                f"{where}{key} = {v} is out of range: {key} must be {words}; e.g. --set {key}={default}"
            )


def get_method(name: str, overrides: dict | None = None) -> Method:
    """Instantiate a registered method with hyperparameter overrides (a dict; strings are parsed as ``--set``
    parses them, other values must have the field's type)."""
    if not isinstance(name, str):
        raise FedfeatError(
            f"method name must be a string, got {type(name).__name__} {_show(name)}; e.g. get_method('fedavg')"
        )
    if name not in REGISTRY:
        raise FedfeatError(f"unknown method '{name}'; known methods: {', '.join(REGISTRY)}")
    cls = REGISTRY[name]
    return cls(make_params(cls, overrides or {}))


def method_table() -> list[dict]:
    """Name, description, label use, runs-on, kernels (``--kernel``), stacking, defaults and every capability
    (``capabilities``) of every registered method."""
    rows = []
    for name, cls in REGISTRY.items():
        caps = capabilities(cls)
        rows.append(
            {
                "name": name,
                "summary": (cls.__doc__ or "").strip().splitlines()[0],
                "labels": "yes" if caps["uses_labels"] else "no",
                "runs_on": caps["runs_on"],
                "kernels": "fused (CPU), torch" if cls(cls.Params()).has_fused() else "torch",
                "stacks": "yes" if caps["stacks"] else "no",
                "dp": ", ".join(["client"] * caps["dp_client"] + ["sample"] * bool(caps["dp_sample"])) or "-",
                "defaults": dataclasses.asdict(cls.Params()),
                "capabilities": caps,
            }
        )
    return rows


# ---------------------------------------------------------------------------------------------------- capabilities
class Capability:
    """One declared capability of a method: a class attribute of ``Method`` with a type, a default and one line of
    doc. A method sets it as a plain class attribute (``needs_live_text = True``); ``register`` checks its type.

    ``inherited=False``: a promise about a class's own code (its local training), which a subclass that may change
    that code does not inherit: every subclass of ``Method`` starts from the default unless it sets the attribute
    itself (``Method.__init_subclass__``)."""

    def __init__(self, typ, default, doc: str, *, inherited: bool = True):
        self.type, self.default, self.doc, self.inherited = typ, default, doc, inherited
        self.name = ""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        return self.default  # Method's own value: the default

    def accepts(self, value) -> bool:
        return _cap_ok(self.type, value)

    def type_name(self) -> str:
        return _cap_type_name(self.type)

    def __repr__(self) -> str:
        return f"Capability({self.name}: {self.type_name()} = {self.default!r})"


def _cap_ok(typ, v) -> bool:
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if typ is type(None) or typ is None:
        return v is None
    if origin is typing.Union or origin is types.UnionType:
        return any(_cap_ok(a, v) for a in args)
    if origin is typing.Literal:
        return isinstance(v, str) and v in args
    if origin is tuple:  # tuple[str, ...]
        return isinstance(v, tuple) and all(_cap_ok(args[0], x) for x in v)
    if typ is Callable or origin is Callable:
        return callable(v)
    if typ is bool:
        return isinstance(v, bool)
    return isinstance(v, typ)


def _cap_type_name(typ) -> str:
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if typ is type(None) or typ is None:
        return "None"
    if origin is typing.Union or origin is types.UnionType:
        return " or ".join(_cap_type_name(a) for a in args)
    if origin is typing.Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin is tuple:
        return f"a tuple of {_cap_type_name(args[0])}"
    if typ is Callable or origin is Callable:
        return "a method (callable)"
    return getattr(typ, "__name__", str(typ))


def _edits(a: str, b: str) -> int:
    """Levenshtein distance of two names (insertions, deletions, substitutions)."""
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def capabilities(cls) -> dict:
    """``{capability: value}`` of a method class (or instance), every name of ``CAPABILITIES`` in its order.

    Example::

        >>> from fedfeat.methods import REGISTRY
        >>> c = capabilities(REGISTRY["zeroshot"])
        >>> c["federated"], c["needs_partition"], c["stacks"]
        (False, False, False)
    """
    cls = cls if isinstance(cls, type) else type(cls)
    return {name: getattr(cls, name) for name in CAPABILITIES}


def stackable() -> list[str]:
    """The registered methods whose runs stack (``stacks = True``; ``fedfeat.engine.stacked``)."""
    return [name for name, cls in REGISTRY.items() if cls.stacks]


def check_capabilities(cls) -> None:
    """``register``'s check: every capability of ``cls`` has its declared type, and no class attribute of ``cls`` or
    of its bases below ``Method`` is a misspelled capability (one or two edits away from one's name). A violation is
    one ``FedfeatError`` line."""
    known = set(vars(Method))  # Method's own names (hooks, name, Params, the capabilities)
    for base in cls.__mro__:
        if base is Method or not (isinstance(base, type) and issubclass(base, Method)):
            continue
        for attr in vars(base):
            if attr.startswith("_") or attr in known:
                continue
            d, near = min((_edits(attr, c), c) for c in CAPABILITIES)
            if d <= 2:
                raise FedfeatError(
                    f"method {cls.name}: class attribute {attr!r} of {_where(base)} is not a capability; did you "
                    f"mean {near!r}? (capabilities: {', '.join(CAPABILITIES)})"
                )
    for name, value in capabilities(cls).items():
        cap = CAPABILITIES[name]
        if not cap.accepts(value):
            raise FedfeatError(
                f"method {cls.name}: capability {name} = {_show(value)} must be {cap.type_name()} ({cap.doc})"
            )
    check_state_keys(cls)
    if "\n" in cls.no_stack_reason:
        raise FedfeatError(
            f"method {cls.name}: no_stack_reason must be one line, got {_show(cls.no_stack_reason)}"
        )


def check_state_keys(cls) -> None:
    """``register``'s check of the declared state: each class's ``state_keys`` is a dict of a name (a string) to
    one non-empty line of doc, and no name is one of the engine's keys (``ENGINE_STATE_KEYS``). A violation is one
    ``FedfeatError`` line."""
    for base in cls.__mro__:
        keys = vars(base).get("state_keys")
        if keys is None:
            continue
        if not isinstance(keys, Mapping):
            raise FedfeatError(
                f"method {cls.name}: state_keys of {_where(base)} must be a dict {{name: one line of doc}}, got "
                f"{type(keys).__name__}"
            )
        for k, doc in keys.items():
            if not isinstance(k, str) or not k:
                raise FedfeatError(f"method {cls.name}: state key {_show(k)} of {_where(base)} is not a name")
            if not isinstance(doc, str) or not doc.strip() or "\n" in doc:
                raise FedfeatError(
                    f"method {cls.name}: state key {k!r} of {_where(base)} needs one line of doc (what it holds, "
                    f"its shape, per-client / per-sample / server), got {_show(doc)}"
                )
            if k in ENGINE_STATE_KEYS:
                raise FedfeatError(
                    f"method {cls.name}: state key {k!r} of {_where(base)} is the engine's ({ENGINE_STATE_KEYS[k]}); "
                    "choose another name"
                )


@dataclass(frozen=True)
class NoParams:
    batch_size: int = 1
    local_epochs: int = 1


class Method:
    """Base class. A method's hooks, in the order the engine calls them:

    ``setup(ctx)`` once; ``init_global(ctx) -> {name: tensor}`` the server's initial parameters; per round
    ``sample`` the clients, ``local_params`` (client-only parameters), ``local_begin(ctx, plan, glob) -> local`` (per-round client context), per local
    epoch ``epoch_begin``, per step ``step_loss(ctx, params, batch, local) -> [n]`` (per-client loss; the
    engine differentiates it and steps the batched optimizer), ``local_end``; then ``aggregate``,
    ``server_update``, and ``predict`` for evaluation.

    What the engine used, for the hooks of a round: ``ctx.lr_round``, the learning rate of the round's optimiser
    (``make_optimizer(plan.rnd).lr``: a decay schedule applied; set before ``local_begin``, read it from there to
    ``server_update``), and ``plan.local_steps  # [m]``, each client's local steps in the round (``plan.steps``
    per epoch times ``plan.epochs``).

    Capabilities (``CAPABILITIES``; ``capabilities(cls)`` lists a class's): class attributes the engine and the run
    layer read besides the hooks, each declared below with its type, default and one line of doc. Set them as plain
    class attributes (``needs_live_text = True``); ``register`` refuses a value of the wrong type and a misspelled
    name. ``shardable`` and ``stacks`` are not inherited: a subclass declares them itself.

    Persistent state (``state_keys``): what a method keeps across rounds and checkpoints lives in ``ctx.state``, and
    every key it writes there is declared in the class attribute ``state_keys = {name: one line of doc}`` (what it
    holds, its shape, per-client / per-sample / server). Declarations are inherited and merged: a subclass adds its
    own (``declared_state()`` is the effective one, over the MRO). Writing an undeclared key raises a ``KeyError``
    naming the method, the key and ``state_keys``; reading is free. A method that keeps no state declares nothing.
    The engine's own keys (``round_buffers``, ``carried_optimizer``) are ``engine.context.ENGINE_STATE_KEYS``.

    Shapes the engine checks where a hook's output enters it (``fedfeat.engine.rounds``: metadata only, no sync):
    ``init_global`` a dict of named tensors, ``server_update`` the same names and shapes as the global parameters it
    was given (every round), ``step_loss`` ``[n]`` (the first step of each local update), ``predict`` ``[N, K]``
    (every evaluation). A violation stops the run with one ``FedfeatError`` line naming the method, the hook, what was
    expected and what came back.

    Hyperparameters: ``Params`` is a frozen dataclass; ``make_params`` refuses a value outside its declared range
    (``declared_ranges``: the engine's keys ``ENGINE_RANGES`` and each params class's ``RANGES = {field: "> 0"}``)
    before the class's own ``validate()`` runs.
    """

    name = ""
    Params = NoParams
    # ---- persistent state: {ctx.state key: one line of doc}, merged over the MRO (``declared_state``)
    state_keys: dict[str, str] = {}

    # ---- capabilities (the docstring's last paragraph): Capability(type, default, one line of doc)
    uses_labels = Capability(bool, True, "reads training labels; False: Batch.y raises, ctx.labels is None")
    runs_on = Capability(
        str, "cache", "what it trains on, for `fedfeat methods` (e.g. 'cache + live text encoder')"
    )
    federated = Capability(
        bool, True, "False: no rounds, evaluated once at round 0 and no weights saved (zero-shot)"
    )
    centralized = Capability(
        bool, False, "the run loads the split as one client holding every sample, participation 1"
    )
    needs_partition = Capability(
        bool, True, "False: reads no training data; the partition settings are ignored (zero-shot)"
    )
    needs_live_text = Capability(
        bool, False, "trains through the store's frozen text encoder (ctx.live), which the run loads"
    )
    needs_pixels = Capability(bool, False, "reads the store's pixels through a live image encoder")
    shardable = Capability(
        bool, False, "torchrun may shard its clients across processes (engine.sharded_local)", inherited=False
    )
    benchmark_logits = Capability(
        Callable | None, None, "(data=, glob=, store=) -> (logits, labels, dataset): its CLIP_benchmark JSON"
    )
    local_accuracies = Capability(
        Callable | None,
        None,
        "(ctx, glob, test_y) -> per-client accuracies: per-client models score themselves",
    )
    stacks = Capability(
        bool, False, "a sweep may make its runs as one program (fedfeat.engine.stacked: its own step_loss / fused "
        "kernel on every run's clients)", inherited=False,
    )  # fmt: skip
    no_stack_reason = Capability(str, "", "why its runs are not stacked (one line; stacks False)")
    divergence_hint = Capability(
        str, "", "what a diverged run should try (one line; '': the generic advice, runs.divergence.hint)"
    )
    trains_clients = Capability(
        bool,
        True,
        "clients train parameters (False: the training-free family -- clients upload statistics, "
        "summary.json trainable_params is 0)",
    )
    dp_client = Capability(
        bool,
        False,
        "client-level DP-FedAvg applies (--dp client): its server step runs on an average of its clients' updates "
        "and they upload nothing else (fedfeat.engine.privacy)",
        inherited=False,
    )
    dp_sample = Capability(
        typing.Literal["", "head", "text"],
        "",
        "sample-level DP-SGD in local training (--dp sample): 'head' (a linear head's per-sample gradients as "
        "outer products), 'text' (text prompts, batched vector-Jacobian products) or '' (none)",
        inherited=False,
    )
    stack_shape = Capability(
        tuple[str, ...],
        ("batch_size", "local_epochs", "normalize", "templates", "renormalize_synthetic"),
        "hyperparameters that shape the stacked data: runs stack only where these agree",
    )

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        for name, cap in CAPABILITIES.items():  # a capability that is not inherited starts from its default
            if not cap.inherited and name not in cls.__dict__:
                setattr(cls, name, cap.default)

    def __init__(self, params):
        self.p = params

    @classmethod
    def declared_state(cls) -> dict[str, str]:
        """``{key: doc}`` of every ``ctx.state`` key the class may write: the ``state_keys`` of its classes (and
        mixins), bases first, a subclass's doc replacing its base's for the same key.

        Example::

            >>> from fedfeat.methods import REGISTRY
            >>> sorted(REGISTRY["fedavgm"].declared_state())
            ['v']
        """
        out: dict[str, str] = {}
        for c in reversed(cls.__mro__):
            out.update(vars(c).get("state_keys") or {})
        return out

    # ---- server side
    def setup(self, ctx: Context) -> None:
        pass

    def init_global(self, ctx: Context) -> dict[str, torch.Tensor]:
        return {}

    def round_begin(self, ctx: Context, rnd: int, glob: dict) -> None:
        """Before a round's sampling: a method may refresh its training sets here (FedCoPL's pseudo-labels)."""

    def sample(self, ctx: Context, rnd: int, participation: float) -> np.ndarray:
        return sample_clients(ctx.seed, rnd, ctx.n_clients, participation)

    def carries_optimizer(self) -> bool:
        """True: one optimiser serves every client of every round, its state (momentum) carried from client to
        client, as PromptFL's and FedCoPL's reference codes do (``fedfeat.engine.rounds.run_carried``: the clients
        then run one after another). Default: a method's ``optimizer_state`` param, ``"carried"``; else fresh state
        for every client in every round (each FedAvg client makes its own optimiser)."""
        return getattr(self.p, "optimizer_state", "fresh") == "carried"

    def make_optimizer(self, rnd: int):
        p = self.p
        lr = p.lr * (getattr(p, "lr_decay", 1.0) ** (rnd - 1))
        return BatchedSGD(
            lr=lr, momentum=getattr(p, "momentum", 0.0), weight_decay=getattr(p, "weight_decay", 0.0)
        )

    def aggregate(self, ctx: Context, plan: RoundPlan, glob: dict, cparams: dict) -> dict:
        """FedAvg weighted by client sample counts."""
        return fedavg(cparams, plan.sizes.to(ctx.device))

    def server_update(self, ctx: Context, plan: RoundPlan, old: dict, new: dict) -> dict:
        return new

    def broadcast(self, ctx: Context, glob: dict) -> dict:
        """What the server sends each client (for the bytes-down count)."""
        return glob

    def upload_bytes(self, ctx: Context, plan: RoundPlan, cparams: dict) -> int:
        return int(sum(v.numel() * v.element_size() for v in cparams.values()))

    # ---- client side
    def local_params(self, ctx: Context, plan: RoundPlan) -> dict[str, torch.Tensor]:
        """Per-client parameters ``{name: [m, ...]}`` that are trained with the global ones but start anew each
        round and are never broadcast (Fed-MP's client residuals); ``aggregate`` sees them in ``cparams``."""
        return {}

    def local_begin(self, ctx: Context, plan: RoundPlan, glob: dict) -> dict:
        return {}

    def epoch_begin(self, ctx: Context, plan: RoundPlan, local: dict, epoch: int) -> None:
        pass

    def step_loss(self, ctx: Context, params: dict, batch, local: dict) -> torch.Tensor:
        raise NotImplementedError

    def local_end(self, ctx: Context, plan: RoundPlan, local: dict, params: dict) -> None:
        pass

    # ---- differential privacy (``fedfeat.engine.privacy``; the capabilities dp_client / dp_sample)
    def dp_clipped_sums(
        self, ctx: Context, params: dict, batch, local: dict, clip: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Sample-level DP: ``(the per-client mean loss [n] of the batch, {name: [n, ...]} the sums over each
        client's real samples of their gradients clipped to L2 norm ``clip``)`` for the parameters ``params`` (not
        leaves). A method with ``dp_sample`` implements it; the engine adds the noise and ``dp_regularizer``."""
        raise NotImplementedError(f"method {self.name} has no per-sample gradients")

    def trainable_count(self, ctx: Context, plan: RoundPlan, cparams: dict) -> int:
        """summary.json's ``trainable_params``: the parameters one client trains (its slice of the round's client
        parameters ``{name: [m, ...]}``: the global ones it starts from and its own); a method whose client tensors
        are padded to the round's largest client says how many of them a client really trains."""
        from fedfeat.engine.context import trainable_params

        return trainable_params(cparams, plan.m)

    def keep_local(self, ctx: Context, plan: RoundPlan, cparams: dict) -> None:
        """What a method keeps of its clients' round that never leaves them (personalised parts: FedPGP's low-rank
        factors, FedOTP's local prompts), before the server aggregates. Its ``aggregate`` calls it; under client-level
        DP, where the engine aggregates, the engine does. Default: nothing."""

    def dp_parts(self) -> int:
        """Client-level DP: how many separately clipped parts a client uploads (its update, and e.g. CReFF's class
        gradients); the noise on each is ``sqrt(parts)`` times one part's, so the round stays one Gaussian mechanism
        of the run's noise multiplier."""
        return 1

    def dp_regularizer(self, ctx: Context, params: dict, local: dict) -> torch.Tensor | None:
        """Sample-level DP: the data-independent part of the local loss ``[n]`` (FedProx's proximal term),
        differentiated exactly (not clipped, not noised); None: there is none."""
        return None

    # ---- fused CPU kernel (optional; ``fedfeat.engine.kernels``)
    def fused_loss(self):
        """The loss of ``step_loss`` as a fused kernel's parameters, or None (no fused kernel)."""
        return None

    def has_fused(self) -> bool:
        """A fused kernel applies only if the class that defines ``step_loss`` also defines ``fused_loss``, no
        subclass of it redefines ``sample_loss`` (a subclass that changes the loss does not inherit its parent's
        kernel), and it returns one (``no_fused_reason`` says which does not hold)."""
        return self.no_fused_reason() is None

    def no_fused_reason(self) -> str | None:
        """Why this method runs no fused kernel (None: it has one); ``--kernel fused`` prints it."""

        def owner(name: str) -> type:
            return next(c for c in type(self).__mro__ if name in c.__dict__)

        fused = owner("fused_loss")
        per_sample = owner("sample_loss") if hasattr(self, "sample_loss") else fused  # LinearHead's hook
        if fused is Method:
            return (
                "no compiled kernel is declared for its loss (fused_loss; the kernels in fedfeat/engine/kernels.py "
                "cover the linear heads' cross-entropy family)"
            )
        if owner("step_loss") is not fused:
            return (
                f"its step_loss ({owner('step_loss').__name__}) is not the loss of the fused kernel declared by "
                f"{fused.__name__}.fused_loss, and a kernel is only trusted on the class that declares it"
            )
        if not issubclass(fused, per_sample):
            return (
                f"{per_sample.__name__} redefines sample_loss, so {fused.__name__}'s fused kernel (compiled for "
                f"{fused.__name__}'s loss) would train another loss; a subclass that changes the loss does not "
                "inherit its parent's kernel"
            )
        if self.fused_loss() is None:
            return f"{fused.__name__}.fused_loss has no compiled kernel for these settings"
        return None

    def fused_epoch(self, ctx, plan, glob, local, params, opt, epoch):
        """Local epoch ``epoch`` of all the plan's clients in a fused kernel (which shuffles and batches as
        ``engine.epoch_tables``: ``engine.fused_batches``); replaces ``epoch_begin`` and the epoch's steps (the
        kernel makes ``epoch_begin``'s draws itself); SGD momentum buffers are ``opt.state["fused"]``. ``params`` and
        the buffers arrive uninitialised: the first epoch (``epoch == 0``) starts each client from ``glob`` with zero
        momentum, in the kernel. Returns the ``[S, m]`` step losses."""
        raise NotImplementedError

    # ---- evaluation
    def predict(self, ctx: Context, glob: dict, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def predict_classes(
        self, ctx: Context, glob: dict, x: torch.Tensor, classes: torch.Tensor
    ) -> torch.Tensor:
        """Predicted class ids of ``x`` among ``classes  # [Kv]`` only (the open-vocabulary evaluation): the argmax
        of ``predict``'s logits over those columns. A method with a test-time procedure (Fed-MP's prototypes)
        overrides it."""
        return classes[self.predict(ctx, glob, x)[:, classes].argmax(1)]

    def round_metrics(self, ctx: Context, data, glob: dict, ev: dict) -> dict:
        """Extra per-round metrics (e.g. pseudo-label accuracy); ``data`` holds the engine's labels."""
        return {}

    def final_weights(self, ctx: Context, glob: dict) -> dict[str, torch.Tensor]:
        """What a run saves as its final weights (default: the global parameters)."""
        return glob


# every capability a method may declare: Method's ``Capability`` attributes, in their order
CAPABILITIES: dict[str, Capability] = {k: v for k, v in vars(Method).items() if isinstance(v, Capability)}


__all__ = [
    "CAPABILITIES",
    "Capability",
    "Method",
    "REGISTRY",
    "capabilities",
    "check_ranges",
    "check_state_keys",
    "declared_ranges",
    "get_method",
    "is_builtin",
    "method_table",
    "param_bytes",
    "plugin_info",
    "register",
    "stackable",
]
