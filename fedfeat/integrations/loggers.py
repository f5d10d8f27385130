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
"""

from __future__ import annotations

import json
import math
import os
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


class TensorBoardLogger(Callback):
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

    def on_run_start(self, run: dict) -> None:
        self.dir = (self.log_dir / run["name"]) if self.log_dir else Path(run["dir"]) / "tb"
        resumed = run.get("resumed_after_round")
        # purge_step: TensorBoard drops the events an interrupted run wrote after its checkpoint
        self.writer = self._Writer(
            log_dir=str(self.dir), purge_step=run["first_round"] if resumed is not None else None
        )
        if resumed is None:
            self.writer.add_text("config", _code(run["config"]), 0)

    def on_round_end(self, row: dict) -> None:
        for k, v in scalars(row).items():
            self.writer.add_scalar(k, v, global_step=int(row["round"]))
        if self.flush_every_round:
            self.writer.flush()

    def on_run_end(self, summary: dict) -> None:
        keep = {k: v for k, v in summary.items() if k not in ("env", "provenance")}
        self.writer.add_text("summary", _code(keep), int(summary.get("rounds", 0)))
        self._close()

    def on_run_failed(self, error) -> None:
        self._close()

    def _close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class WandbLogger(Callback):
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

    def on_run_start(self, run: dict) -> None:
        d = self.log_dir if self.log_dir else Path(run["dir"])
        d.mkdir(parents=True, exist_ok=True)
        wandb = self._wandb
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
        self.run.log(scalars(row), step=int(row["round"]))

    def on_run_end(self, summary: dict) -> None:
        # under run/: the summary's totals (bytes_up, seconds) are not the last round's values of those metrics
        self.run.summary.update(
            {
                f"run/{k}": v
                for k, v in summary.items()
                if isinstance(v, (int, float, str)) and not isinstance(v, bool)
            }
        )
        self._finish(0)

    def on_run_failed(self, error) -> None:
        self._finish(1)

    def _finish(self, code: int) -> None:
        if self.run is not None:
            self.run.finish(exit_code=code)
            self.run = None


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
