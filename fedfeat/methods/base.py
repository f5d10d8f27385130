"""The method interface and the registry."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from fedfeat.engine.context import Context, RoundPlan, fedavg, param_bytes, sample_clients
from fedfeat.engine.optim import BatchedSGD
from fedfeat.errors import FedfeatError

REGISTRY: dict[str, type[Method]] = {}


def register(cls):
    """Class decorator: add a method to the registry under ``cls.name``.

    Registering a name again replaces the old class with a ``UserWarning`` naming both (a notebook cell that
    redefines a method is run again)."""
    if not cls.name:
        raise FedfeatError(f"{cls.__qualname__} has no name; set the class attribute name = 'my-method'")
    old = REGISTRY.get(cls.name)
    if old is not None and old is not cls:
        warnings.warn(
            f"method {cls.name}: {_where(old)} replaced by {_where(cls)}", UserWarning, stacklevel=2
        )
    REGISTRY[cls.name] = cls
    return cls


def _where(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


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
    if hasattr(p, "validate"):
        p.validate()
    return p


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
    """Name, description, label use, runs-on, kernels (``--kernel``) and defaults of every registered method."""
    rows = []
    for name, cls in REGISTRY.items():
        rows.append(
            {
                "name": name,
                "summary": (cls.__doc__ or "").strip().splitlines()[0],
                "labels": "yes" if cls.uses_labels else "no",
                "runs_on": cls.runs_on,
                "kernels": "fused (CPU), torch" if cls(cls.Params()).has_fused() else "torch",
                "defaults": dataclasses.asdict(cls.Params()),
            }
        )
    return rows


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
    """

    name = ""
    Params = NoParams
    uses_labels = True
    runs_on = "cache"
    federated = True  # False: evaluated once, no rounds (zero-shot)

    def __init__(self, params):
        self.p = params

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

    # ---- fused CPU kernel (optional; ``fedfeat.engine.kernels``)
    def fused_loss(self):
        """The loss of ``step_loss`` as a fused kernel's parameters, or None (no fused kernel)."""
        return None

    def has_fused(self) -> bool:
        """A fused kernel applies only if the class that defines ``step_loss`` also defines ``fused_loss``, no
        subclass of it redefines ``sample_loss`` (a subclass that changes the loss does not inherit its parent's
        kernel), and it returns one."""

        def owner(name: str) -> type:
            return next(c for c in type(self).__mro__ if name in c.__dict__)

        fused = owner("fused_loss")
        per_sample = owner("sample_loss") if hasattr(self, "sample_loss") else fused  # LinearHead's hook
        return fused is owner("step_loss") and issubclass(fused, per_sample) and self.fused_loss() is not None

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


__all__ = ["Method", "REGISTRY", "register", "get_method", "method_table", "param_bytes"]
