"""fedfeat's version (one place: the package, ``pyproject.toml`` and run provenance read it)."""

__version__ = "0.1.0"
