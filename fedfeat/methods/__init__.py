"""Federated methods: one module each, registered by name with ``@register``.

A method is a params dataclass (every field commented with its source) plus a few hooks that the engine
calls (see ``base.Method``). ``fedfeat methods`` prints the registry.

Example::

    >>> from fedfeat.methods import get_method
    >>> m = get_method("fedprox", {"mu": 0.1})
    >>> m.p.mu, m.uses_labels
    (0.1, True)
"""

from __future__ import annotations

import importlib

from fedfeat.methods.base import REGISTRY, Method, get_method, method_table, register

# modules that register methods (import order = listing order)
_MODULES = ("zeroshot", "linear", "fst_cbdg", "synthesis")
for _m in _MODULES:
    try:
        importlib.import_module(f"fedfeat.methods.{_m}")
    except ModuleNotFoundError as e:  # a method module still being written elsewhere
        if e.name != f"fedfeat.methods.{_m}":
            raise

__all__ = ["REGISTRY", "Method", "get_method", "method_table", "register"]
