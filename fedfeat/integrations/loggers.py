"""Live loggers for TensorBoard and Weights & Biases (optional extras), as ``fedfeat.runs.callbacks`` callbacks.

``fedfeat train --logger tensorboard`` (``pip install fedfeat[tensorboard]``) writes TensorBoard event files into
``RUN/tb/`` (or ``--log-dir DIR/NAME/``) through ``torch.utils.tensorboard.SummaryWriter``; ``--logger wandb``
(``pip install fedfeat[wandb]``) writes an offline W&B run (``wandb.init(mode="offline")``: no network, no
account; ``wandb sync`` uploads it later) into ``RUN/wandb/`` (or ``--log-dir DIR/``). Each logs every round's
scalar metrics at step = round (``test_acc``, ``train_loss``, ``val_acc``, ``local_acc``, ``many_acc``,
``bytes_up``, ``seconds``, ...; rounds that ``--eval-every`` skips carry no accuracy), the run's config, and at
the end its summary (TensorBoard: as text; W&B: as ``run/final_acc``, ``run/best_acc``, ...). Lists (``per_class_acc``, ``clients``) are
not logged (``metrics.jsonl`` and ``results.npz`` keep them).

A resumed run (``--resume``) logs only its new rounds: TensorBoard's ``purge_step`` drops the interrupted run's
events after the checkpoint, and W&B starts a new offline run (the same ``id`` resumes it when synced).

A write error (a full disk, a read-only or vanished folder: ``OSError``) switches the logger off for the rest of the
process with one warning line naming it, its folder and the error; the run goes on (``metrics.jsonl`` keeps every
round) or, when its own folder is on the same full disk, stops with the command's one-line error. Without this,
TensorBoard's writer thread printed its traceback (``threading.excepthook``; the writer raises the same error in the
run's thread at its next call, so the thread's copy is dropped, ``quiet_writer_threads``) and W&B's ``debug.log``
handlers one ``--- Logging error ---`` traceback per log record, over a thousand lines (``_handler_errors`` records
them instead, and a W&B call that met one counts as failed).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import threading
from pathlib import Path

from fedfeat.errors import FedfeatError
from fedfeat.runs.callbacks import Callback, callback_name, check_callback, load_plugin, load_plugins

BUILTIN = ("tensorboard", "wandb")


def scalars(row: dict) -> dict[str, float]:
    """The scalar metrics of a metrics row: numbers (not bools, not NaN), ``round`` left out (it is the step)."""
    out = {}
    for k, v in row.items():
        if k == "round" or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if isinstance(v, float) and math.isnan(v):
            continue
        out[k] = float(v)
    return out


def _why(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


class _WriteGuard:
    """A logger that a write error (``OSError``) switches off, with one warning line (module docstring)."""

    name = "logger"
    off = False

    def _failed(self, e: BaseException, where) -> None:
        if not self.off:
            self.off = True
            print(
                f"fedfeat: warning: logger {self.name} cannot write {where} ({_why(e)}); it is off from here on, "
                "the run goes on (metrics.jsonl has every round)",
                file=sys.stderr,
            )


def quiet_writer_threads() -> None:
    """Drop the traceback that TensorBoard's writer thread (``_AsyncWriterThread``) prints when its write fails with
    an ``OSError``: the writer raises the same error in the caller's thread at its next call. Other threads'
    exceptions go to the hook that was there. Installed once per process."""
    prev = threading.excepthook
    if getattr(prev, "_fedfeat_quiet", False):
        return

    def hook(args):
        t = type(args.thread)
        if (
            isinstance(args.exc_value, OSError)
            and t.__module__.startswith("tensorboard")
            and "Writer" in t.__name__
        ):
            return
        prev(args)

    hook._fedfeat_quiet = True
    threading.excepthook = hook


class TensorBoardLogger(_WriteGuard, Callback):
    """TensorBoard event files: ``RUN/tb/`` (written in the run's partial directory, published with it), or
    ``log_dir/NAME/``. One scalar per metric (tag = the metric's name) at step = round."""

    name = "tensorboard"

    def __init__(self, log_dir: str | os.PathLike | None = None, flush_every_round: bool = True):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise FedfeatError(
                "the tensorboard logger needs the tensorboard package: pip install fedfeat[tensorboard]"
            ) from None
        self._Writer = SummaryWriter
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.flush_every_round = flush_every_round  # live: each round is on disk when it ends
        self.writer = None
        self.dir: Path | None = None
        quiet_writer_threads()

    def on_run_start(self, run: dict) -> None:
        if self.off:
            return
        self.dir = (self.log_dir / run["name"]) if self.log_dir else Path(run["dir"]) / "tb"
        resumed = run.get("resumed_after_round")
        try:
            # purge_step: TensorBoard drops the events an interrupted run wrote after its checkpoint
            self.writer = self._Writer(
                log_dir=str(self.dir), purge_step=run["first_round"] if resumed is not None else None
            )
            if resumed is None:
                self.writer.add_text("config", _code(run["config"]), 0)
        except OSError as e:
            self._drop(e)

    def on_round_end(self, row: dict) -> None:
        if self.writer is None:
            return
        try:
            for k, v in scalars(row).items():
                self.writer.add_scalar(k, v, global_step=int(row["round"]))
            if self.flush_every_round:
                self.writer.flush()
        except OSError as e:
            self._drop(e)

    def on_run_end(self, summary: dict) -> None:
        if self.writer is None:
            return
        keep = {k: v for k, v in summary.items() if k not in ("env", "provenance")}
        try:
            self.writer.add_text("summary", _code(keep), int(summary.get("rounds", 0)))
            self._close()
        except OSError as e:
            self._drop(e)

    def on_run_failed(self, error) -> None:
        try:
            self._close()
        except OSError as e:
            self._drop(e)

    def _close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def _drop(self, e: OSError) -> None:
        """Off after a write error: the writer is let go unclosed (closing flushes again, and waits on a writer
        thread that may have died)."""
        self.writer = None
        self._failed(e, self.dir)


@contextlib.contextmanager
def _handler_errors(errors: list):
    """While W&B runs: a logging handler's ``OSError`` (its ``debug.log`` on a full disk) is appended to ``errors``
    instead of printed as a ``--- Logging error ---`` traceback; other handler errors as before."""
    orig = logging.Handler.handleError

    def handle_error(handler, record):
        e = sys.exc_info()[1]
        if isinstance(e, OSError):
            errors.append(e)
        else:
            orig(handler, record)

    logging.Handler.handleError = handle_error
    try:
        yield
    finally:
        logging.Handler.handleError = orig


def _quiet_handlers(folder: Path) -> None:
    """Every logging handler writing a file under ``folder`` (W&B's ``debug.log`` handlers stay attached to its
    loggers) drops its write errors from now on."""
    root = str(folder.absolute())
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for lg in loggers:
        for h in getattr(lg, "handlers", ()):
            if str(getattr(h, "baseFilename", "")).startswith(root):
                h.handleError = lambda record: None


class WandbLogger(_WriteGuard, Callback):
    """An offline Weights & Biases run (``mode="offline"``: nothing is sent; ``wandb sync DIR`` uploads it)
    in ``RUN/wandb/`` or ``log_dir/``: the config, every round's scalars at step = round, the run's summary (as ``run/KEY``)."""

    name = "wandb"

    def __init__(
        self, log_dir: str | os.PathLike | None = None, project: str = "fedfeat", mode: str = "offline"
    ):
        try:
            import wandb
        except ImportError:
            raise FedfeatError(
                "the wandb logger needs the wandb package: pip install fedfeat[wandb]"
            ) from None
        if mode not in ("offline", "online"):
            raise FedfeatError(f"wandb mode must be offline or online, got {mode!r}")
        self._wandb = wandb
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.project = project
        self.mode = mode
        self.run = None
        self.dir: Path | None = None

    @contextlib.contextmanager
    def _guarded(self):
        """A W&B call: a write error, raised or met by its log handlers, switches the logger off (one line)."""
        errors: list = []
        try:
            with _handler_errors(errors):
                yield
        except OSError as e:
            errors.append(e)
        if errors:
            self._drop(errors[0])

    def on_run_start(self, run: dict) -> None:
        if self.off:
            return
        self.dir = d = self.log_dir if self.log_dir else Path(run["dir"])
        wandb = self._wandb
        with self._guarded():
            d.mkdir(parents=True, exist_ok=True)
            self.run = wandb.init(
                project=self.project,
                name=run["name"],
                id=_wandb_id(str(run["path"])),
                dir=str(d),
                mode=self.mode,
                config={**run["config"], "resumed_after_round": run.get("resumed_after_round")},
                reinit="create_new" if _wandb_new_reinit(wandb) else True,
                settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
            )

    def on_round_end(self, row: dict) -> None:
        if self.run is None:
            return
        with self._guarded():
            self.run.log(scalars(row), step=int(row["round"]))

    def on_run_end(self, summary: dict) -> None:
        if self.run is None:
            return
        # under run/: the summary's totals (bytes_up, seconds) are not the last round's values of those metrics
        with self._guarded():
            self.run.summary.update(
                {
                    f"run/{k}": v
                    for k, v in summary.items()
                    if isinstance(v, (int, float, str)) and not isinstance(v, bool)
                }
            )
            self._finish(0)

    def on_run_failed(self, error) -> None:
        with self._guarded():
            self._finish(1)

    def _finish(self, code: int) -> None:
        if self.run is not None:
            run, self.run = self.run, None
            run.finish(exit_code=code)

    def _drop(self, e: OSError) -> None:
        """Off after a write error: the W&B run is finished quietly (its own errors dropped) and its log handlers
        under the folder keep quiet from now on."""
        run, self.run = self.run, None
        if run is not None:
            with contextlib.suppress(Exception), _handler_errors([]):
                run.finish(exit_code=1)
        if self.dir is not None:
            _quiet_handlers(self.dir)
        self._failed(e, self.dir)


def _wandb_new_reinit(wandb) -> bool:
    try:
        major, minor = (int(x) for x in wandb.__version__.split(".")[:2])
    except ValueError:
        return True
    return (major, minor) >= (0, 19)


def _wandb_id(path: str) -> str:
    """A W&B run id from the run directory (W&B ids: <= 64 characters, no / \\ # ? % :)."""
    import hashlib

    return hashlib.sha256(path.encode()).hexdigest()[:16]


def _code(obj) -> str:
    return "```\n" + json.dumps(obj, indent=2, default=str) + "\n```"


def make_logger(spec, log_dir: str | os.PathLike | None = None):
    """A logger from ``spec``: a callback object (returned as it is), ``"tensorboard"``, ``"wandb"``, or the
    name of a ``fedfeat.callbacks`` entry point (a class or factory, called with ``log_dir=`` when one is given).
    A missing extra or an unknown name is one ``FedfeatError`` line."""
    if not isinstance(spec, str):
        check_callback(spec)
        return spec
    kw = {"log_dir": log_dir} if log_dir is not None else {}
    if spec == "tensorboard":
        return TensorBoardLogger(**kw)
    if spec == "wandb":
        return WandbLogger(**kw)
    plugins = load_plugins()
    if spec not in plugins:
        known = ", ".join([*BUILTIN, *sorted(plugins)])
        raise FedfeatError(
            f"unknown logger {spec!r}; known: {known} (other packages add loggers under the fedfeat.callbacks "
            "entry point group)"
        )
    obj = load_plugin(plugins[spec])
    if callable(obj) and (isinstance(obj, type) or not any(hasattr(obj, h) for h in ("on_round_end",))):
        try:
            obj = obj(**kw)
        except FedfeatError:
            raise
        except Exception as e:
            raise FedfeatError(f"logger {spec}: could not be made: {type(e).__name__}: {e}") from None
    check_callback(obj, f"logger {spec}")
    return obj


def make_loggers(specs, log_dir: str | os.PathLike | None = None) -> list:
    """``make_logger`` for each of ``specs`` (``--logger`` repeated); the same name twice is refused."""
    out = [make_logger(s, log_dir) for s in specs or ()]
    names = [callback_name(c) for c in out if isinstance(c, (TensorBoardLogger, WandbLogger))]
    if len(names) != len(set(names)):
        raise FedfeatError(f"--logger names a logger twice ({', '.join(names)}); name each once")
    return out


__all__ = ["TensorBoardLogger", "WandbLogger", "make_logger", "make_loggers", "scalars"]
