"""Live logging: callbacks a run calls as it goes (``fedfeat.train(..., callbacks=[...])``, ``--logger NAME``).

A callback is any object with some of these methods (``Callback`` is a base class with no-op ones, to override
only what you need; a method an object lacks is not called):

* ``on_run_start(run)``: ``run`` is a dict: ``name``, ``path`` (the run directory it is published as), ``dir``
  (the directory its files are written into now: ``OUT/.partial-NAME``, renamed to ``path`` at the end),
  ``method``, ``rounds``, ``config`` (the resolved settings, ``params`` the method's hyperparameters),
  ``resumed_after_round`` (``None``, or the checkpointed round a ``--resume`` goes on from; only the rounds after
  it follow) and ``first_round`` (0, or that round + 1).
* ``on_round_end(row)``: each round's metrics row, as written to ``metrics.jsonl`` (``round``, ``test_acc``
  (``None`` on rounds ``--eval-every`` skips), ``train_loss``, ``val_acc``, ``local_acc``, ...), right after it is
  written; round 0 is the model before training.
* ``on_run_end(summary)``: the run's ``summary.json`` (and ``path``), once it is written, just before the run
  directory is published (renamed to ``path``): a logger writing into ``dir`` (TensorBoard's ``RUN/tb``) closes
  its files there and they are published with the run.
* ``on_run_failed(error)``: the run stopped with ``error`` (an exception, a Ctrl-C); its partial directory is
  removed after this unless the run can be resumed.

Errors (one policy, for every callback): a callback that raises in ``on_run_start`` stops the run before its
first round, with one line naming it (nothing is trained yet: fix the logger and run again). A callback that
raises later is switched off for the rest of the run, with one warning line on stderr naming it and the error;
the run goes on and ``metrics.jsonl`` stays its record. A Ctrl-C (``KeyboardInterrupt``) is never swallowed.

Where callbacks come from: explicit objects (``train(callbacks=...)``), the ones active around a call
(``use(...)``: ``fedfeat sweep --logger`` wraps a whole sweep), and other packages through the
``fedfeat.callbacks`` entry point group (``load_plugins``; ``--logger NAME`` names one, as it names the built-in
``tensorboard`` and ``wandb`` loggers of ``fedfeat.integrations.loggers``).
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Iterable

from fedfeat.errors import FedfeatError

ENTRY_POINT_GROUP = "fedfeat.callbacks"
HOOKS = ("on_run_start", "on_round_end", "on_run_end", "on_run_failed")


class Callback:
    """Base class of a callback: every hook does nothing; override the ones you need (module docstring)."""

    def on_run_start(self, run: dict) -> None:
        pass

    def on_round_end(self, row: dict) -> None:
        pass

    def on_run_end(self, summary: dict) -> None:
        pass

    def on_run_failed(self, error: BaseException) -> None:
        pass


def callback_name(cb) -> str:
    return getattr(cb, "name", None) or type(cb).__name__


def check_callback(cb, where: str = "callbacks") -> None:
    """One line when ``cb`` is not a callback (no hook method at all, or a class where an instance is meant)."""
    if isinstance(cb, type) or not any(callable(getattr(cb, h, None)) for h in HOOKS):
        what = f"the class {cb.__name__}" if isinstance(cb, type) else repr(cb)[:60]
        raise FedfeatError(
            f"{where}: {what} is not a callback; pass an object with on_run_start / on_round_end / on_run_end / "
            "on_run_failed methods (e.g. an instance of fedfeat.runs.callbacks.Callback's subclass)"
        )


_ACTIVE: contextvars.ContextVar[tuple] = contextvars.ContextVar("fedfeat_callbacks", default=())


@contextlib.contextmanager
def use(callbacks: Iterable | None):
    """Every run trained inside the ``with`` calls ``callbacks`` too (after the ones already active)."""
    cbs = tuple(callbacks or ())
    for cb in cbs:
        check_callback(cb)
    token = _ACTIVE.set(_ACTIVE.get() + tuple(c for c in cbs if c not in _ACTIVE.get()))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active() -> tuple:
    return _ACTIVE.get()


class Callbacks:
    """Dispatches each hook to a list of callbacks under the error policy of the module docstring."""

    def __init__(self, callbacks: Iterable = ()):
        self.callbacks = list(callbacks)
        for cb in self.callbacks:
            check_callback(cb)
        self.started = False

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    def _call(self, hook: str, arg) -> None:
        for cb in list(self.callbacks):
            fn = getattr(cb, hook, None)
            if fn is None:
                continue
            try:
                fn(arg)
            except Exception as e:
                msg = f"{type(e).__name__}: {e}".splitlines()[0] if str(e) else type(e).__name__
                if hook == "on_run_start":
                    raise FedfeatError(
                        f"logger {callback_name(cb)} failed to start: {msg}; fix it or drop it (--logger)"
                    ) from None
                self.callbacks.remove(cb)
                print(
                    f"fedfeat: warning: logger {callback_name(cb)} failed in {hook} ({msg}); it is off for the "
                    "rest of this run, the run goes on (metrics.jsonl has every round)",
                    file=sys.stderr,
                )

    def run_start(self, run: dict) -> None:
        self.started = True
        try:
            self._call("on_run_start", run)
        except FedfeatError:
            self._call("on_run_failed", None)  # the others started: let them close
            self.started = False
            raise

    def round_end(self, row: dict) -> None:
        if self.started:
            self._call("on_round_end", row)

    def run_end(self, summary: dict) -> None:
        if self.started:
            self.started = False
            self._call("on_run_end", summary)

    def run_failed(self, error: BaseException) -> None:
        if self.started:
            self.started = False
            self._call("on_run_failed", error)


def for_run(callbacks: Iterable | None) -> Callbacks:
    """The callbacks of one run: the active ones (``use``), then ``callbacks`` (duplicates once)."""
    cbs = list(active())
    for cb in callbacks or ():
        if not any(cb is c for c in cbs):
            cbs.append(cb)
    return Callbacks(cbs)


def load_plugins() -> dict:
    """The callbacks other packages declare under the ``fedfeat.callbacks`` entry point group (pyproject:
    ``[project.entry-points."fedfeat.callbacks"] mylogger = "mypkg.logging:MyLogger"``): name -> the object named,
    a callback class or factory called with keyword options (``log_dir``) to make one. Loaded lazily, when
    ``--logger NAME`` asks for one; a plugin that fails to import is a one-line error naming it."""
    from importlib.metadata import entry_points

    out = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        out[ep.name] = ep
    return out


def load_plugin(ep):
    try:
        return ep.load()
    except Exception as e:
        raise FedfeatError(
            f"logger plugin {ep.name} ({ep.value}) failed to import: {type(e).__name__}: {e}; fix or uninstall it"
        ) from None


__all__ = ["Callback", "Callbacks", "ENTRY_POINT_GROUP", "active", "for_run", "load_plugins", "use"]
