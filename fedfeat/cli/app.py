"""The ``fedfeat`` command line. It only parses flags and calls one library function per command.

Errors a user can cause (``FedfeatError``) print as one line, ``error: ...``, with exit status 2. Ctrl-C
(SIGINT) ends any command with one line and exit status 130, SIGTERM with 143 -- also when a library swallowed
the ``KeyboardInterrupt`` (numba's first compile of the fused kernels: ``fedfeat.report.rundir.interrupt_latch``);
what the command was writing is left unfinished (a hidden ``.partial-`` run, a store without its complete flag).
"""

from __future__ import annotations

import typer
from typer.core import TyperGroup

from fedfeat.cli import encode as cli_encode
from fedfeat.cli import eval as cli_eval
from fedfeat.cli import models as cli_models
from fedfeat.cli import partition as cli_partition
from fedfeat.cli import report as cli_report
from fedfeat.cli import reproduce as cli_reproduce
from fedfeat.cli import store as cli_store
from fedfeat.cli import sweep as cli_sweep
from fedfeat.cli import train as cli_train
from fedfeat.errors import FedfeatError


class _Group(TyperGroup):
    """Prints a ``FedfeatError`` from any subcommand as one line and exits with status 2."""

    def invoke(self, ctx):
        from fedfeat.report.rundir import Interrupted, interrupt_latch, interrupted

        try:
            with interrupt_latch():  # Ctrl-C ends every command with 130, even one a library swallowed
                rv = super().invoke(ctx)
                if isinstance(interrupted(), KeyboardInterrupt):
                    raise KeyboardInterrupt
                if isinstance(interrupted(), Interrupted):
                    raise Interrupted(15)
                return rv
        except FedfeatError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            typer.echo("error: interrupted (Ctrl-C)", err=True)
            raise typer.Exit(130) from None
        except Interrupted:
            typer.echo("error: terminated (SIGTERM)", err=True)
            raise typer.Exit(143) from None
        except OSError as e:  # the environment, not fedfeat: a full disk, a read-only filesystem, permissions
            where = f" ({e.filename})" if e.filename else ""
            typer.echo(
                f"error: {e.strerror or e}{where}; free space, or choose a writable location and run again",
                err=True,
            )
            raise typer.Exit(2) from None


app = typer.Typer(
    cls=_Group,
    name="fedfeat",
    help="Federated learning on cached frozen-CLIP features: encode once, train every method fast.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # help text is plain text: square brackets are literal (`pip install fedfeat[tensorboard]`, "value lists, []"),
    # not rich markup tags that would be swallowed
    rich_markup_mode=None,
)


for _cmd in (cli_store, cli_partition, cli_models, cli_train, cli_report, cli_sweep, cli_reproduce, cli_encode,
             cli_eval):  # fmt: skip
    _cmd.register(app)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``fedfeat`` console script."""
    app(args=argv, prog_name="fedfeat")


if __name__ == "__main__":
    main()
