"""CLI options generated from the run specification (``fedfeat.spec``): ``train``, ``sweep`` and ``partition``
take every setting the specification declares, with its help, and nothing is listed by hand.

``settings_options(kind)`` decorates a typer command whose function takes ``settings: dict``; the decorated
command gets one ``--flag`` per setting (``kind="train"``: one typed value; ``kind="sweep"``: comma-separated
values, a grid axis) and receives the given ones (``None`` = not given) in ``settings``."""

from __future__ import annotations

import functools
import inspect
from typing import Optional

import typer


def _options(kind: str, keys, rename: dict) -> list[inspect.Parameter]:
    from fedfeat.spec import FIELDS

    out = []
    for k in keys:
        f = FIELDS[k]
        flag = "--" + rename.get(k, k).replace("_", "-")
        if kind == "sweep" and f.sweep == "fixed":
            help_, typ = f"{f.help} One value for every run of the sweep.", Optional[f.type]
        elif kind == "sweep":
            head = f.help.split(" Default")[0].rstrip(".")
            ints = " or a range (0-4)" if f.type is int else ""
            help_ = f"{head}. Comma-separated values{ints}: each is a grid axis."
            typ = Optional[str]
        else:
            help_, typ = f.help, Optional[f.type]
        opt = typer.Option(None, flag, help=help_, metavar=f.metavar)
        out.append(inspect.Parameter(k, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=opt, annotation=typ))
    return out


def settings_options(kind: str, *, keys=None, rename: dict | None = None):
    """Add the specification's settings as options to a command taking ``settings``: ``kind`` ``train`` (every
    setting), ``sweep`` (every sweepable one, as value lists; a ``"fixed"`` one as one value); ``keys`` picks some (in the specification's order),
    ``rename`` gives some another flag (``{"partition_seed": "seed"}``: ``--seed``)."""
    from fedfeat.spec import FIELDS, SWEEP_FIXED, SWEEPABLE

    every = [k for k in FIELDS if k in SWEEPABLE or k in SWEEP_FIXED] if kind == "sweep" else list(FIELDS)
    chosen = [k for k in every if keys is None or k in keys]

    def deco(fn):
        sig = inspect.signature(fn, eval_str=True)
        own = [p for p in sig.parameters.values() if p.name != "settings"]
        clash = {p.name for p in own} & set(chosen)
        if clash:
            raise RuntimeError(f"{fn.__name__}: options {sorted(clash)} are run settings already")

        @functools.wraps(fn)
        def command(**kw):
            settings = {k: kw.pop(k) for k in chosen}
            return fn(settings=settings, **kw)

        # arguments first, then the run settings, then the command's own options (the order --help lists them)
        args = [p for p in own if type(p.default).__name__ == "ArgumentInfo"]
        rest = [p for p in own if p not in args]
        params = args + _options(kind, chosen, rename or {}) + rest
        command.__signature__ = sig.replace(parameters=params)
        command.__annotations__ = {p.name: p.annotation for p in params}
        del command.__wrapped__  # typer reads the new signature, not fn's
        return command

    return deco


THREADS_HELP = (
    "CPU threads of torch and the fused kernels: a number, or auto / 0 (default) for fedfeat's policy: the usable "
    "cores (CPU affinity, cgroup quota) divided among the fedfeat jobs on the machine (a launcher's, and the "
    "commands running, which register themselves), fewer while other "
    "processes keep cores busy (their runnable threads when the command starts, and between a sweep's runs). "
    "FEDFEAT_THREADS or OMP_NUM_THREADS, if set, are used instead of the policy; this flag wins over both. "
    "summary.json's env.threads records the count and why."
)


def threads_option():
    """``--threads N`` of ``train``, ``sweep`` and ``reproduce`` (``fedfeat.runs.threads``)."""
    return typer.Option("auto", "--threads", help=THREADS_HELP, metavar="N")


def apply_threads(ctx: typer.Context, value) -> int | None:
    """Apply ``--threads`` (``fedfeat.runs.threads.use``) for the rest of the running command ``ctx`` (torch's count
    is restored when it ends); returns the requested count (None: the policy or the environment decides)."""
    from fedfeat.runs.threads import parse, use

    requested = parse(value)
    ctx.with_resource(use(requested))
    return requested
