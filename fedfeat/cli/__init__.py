"""The ``fedfeat`` command line: typer commands only. Each parses its flags, calls one library function and
prints; user errors (``FedfeatError``) become one line and exit status 2.

May import: everything. Nothing imports it but ``fedfeat.__main__``.
"""

from fedfeat.cli.app import app, main

__all__ = ["app", "main"]
