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

# the modules below register their methods on import (import order = listing order)
# isort: off
from fedfeat.methods import zeroshot, linear, fst_cbdg, synthesis  # noqa: E402, F401
from fedfeat.methods import fedmp, promptfl, fedtpg  # noqa: E402, F401

# isort: on
from fedfeat.methods.base import REGISTRY, Method, get_method, method_table, register  # noqa: E402

__all__ = ["REGISTRY", "Method", "get_method", "method_table", "register"]
