"""Federated methods: one module per method family, registered by name with ``@register``.

A method is a params dataclass (every field commented with its source) plus a few hooks that the engine calls for
all sampled clients at once (``base.Method``; README, "Your own method"). ``fedfeat methods`` prints the registry;
other packages add methods through the ``fedfeat.methods`` entry point group (``load_plugins``).

Families (independent of each other: ``zeroshot``, ``linear``, ``fst_cbdg``, ``synthesis``, ``fedmp``, ``promptfl``,
``fedcopl``) share code only through the engine and the parts below them: the pseudo-labellers (``copl``, then
``pseudolabel``), the linear head (``head``) and the protocol and registry (``base``).

May import: ``fedfeat.engine`` and everything below it. Never ``fedfeat.runs``, ``fedfeat.report`` or the CLI.

Example::

    >>> from fedfeat.methods import get_method
    >>> m = get_method("fedprox", {"mu": 0.1})
    >>> m.p.mu, m.uses_labels
    (0.1, True)
"""

from __future__ import annotations

import types

# the modules below register their methods on import (import order = listing order)
# isort: off
from fedfeat.methods import zeroshot, linear, fst_cbdg, synthesis  # noqa: E402, F401
from fedfeat.methods import fedmp, promptfl, fedcopl  # noqa: E402, F401

# CLIP2FL Table 1's other baselines and FedCoPL's pFedPrompt / FedOPT
from fedfeat.methods import fednova, focal, ratio_loss, tau_norm, ccvr, feddf, fedbe  # noqa: E402, F401
from fedfeat.methods import pfedprompt, fedopt  # noqa: E402, F401
from fedfeat.methods import serveropt  # noqa: E402, F401  # FedAdagrad / FedAdam / FedYogi (Reddi et al. 2021)
from fedfeat.methods import scaffold, feddyn  # noqa: E402, F401  # SCAFFOLD, FedDyn (issue 35)

# the 2024-26 canon (issue 39): the training-free family, FedTPG's CoOp baselines, personalised text prompts
from fedfeat.methods import closedform, fedcof, fedpft  # noqa: E402, F401  # FedNCM, Fed3R; FedCOF; FedPFT
from fedfeat.methods import coop_variants, prompt_personal  # noqa: E402, F401  # FedKgCoOp, FedCoCoOp; FedPGP, PromptFolio
from fedfeat.methods import pfedmoap  # noqa: E402, F401  # pFedMoAP (ICLR 2025)

# isort: on
from fedfeat.methods.base import (  # noqa: E402
    CAPABILITIES,
    REGISTRY,
    Method,
    capabilities,
    get_method,
    method_table,
    register,
)
from fedfeat.methods.head import LinearHead, LinearHeadParams  # noqa: E402

ENTRY_POINT_GROUP = "fedfeat.methods"


def load_plugins() -> list[str]:
    """Import the methods other packages declare under the ``fedfeat.methods`` entry point group (pyproject:
    ``[project.entry-points."fedfeat.methods"] mymethod = "mypkg.mymethod"``); a module registers its classes with
    ``@register`` on import, and an entry point may also name a ``Method`` subclass, registered here. Returns the
    names loaded.

    Every failure is one ``FedfeatError`` line naming the entry point, what it points at and the package that
    declares it: a plugin that fails to import, an entry point that names neither a module nor a ``Method``
    subclass, and a plugin class that takes a built-in method's name (``register``: a plugin cannot replace
    ``fedavg``). A run of a plugin's method records the plugin (``base.plugin_info``)."""
    from importlib.metadata import entry_points

    from fedfeat.errors import FedfeatError
    from fedfeat.methods.base import PLUGIN_DISTRIBUTIONS

    loaded = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        dist_name = getattr(dist, "name", None) if dist is not None else None
        where = f"method plugin {ep.name} ({ep.value}" + (f", package {dist_name}" if dist_name else "") + ")"
        if dist_name:  # the package a run records for the plugin's classes (base.plugin_info)
            try:
                version = dist.version
            except Exception:  # metadata without a version
                version = None
            PLUGIN_DISTRIBUTIONS[ep.value.split(":")[0].split(".")[0].strip()] = (dist_name, version)
        try:
            obj = ep.load()
        except FedfeatError as e:  # the module's own @register refused (a built-in's name, a bad capability)
            raise FedfeatError(f"{where}: {e}") from None
        except Exception as e:  # a third-party import error of any kind
            raise FedfeatError(
                f"{where} failed to import: {type(e).__name__}: {' '.join(str(e).split())}; fix or uninstall the "
                "package that declares it"
            ) from None
        if isinstance(obj, type) and issubclass(obj, Method):
            if REGISTRY.get(obj.name) is not obj:  # not registered by its module already
                try:
                    register(obj)
                except FedfeatError as e:
                    raise FedfeatError(f"{where}: {e}") from None
        elif not isinstance(obj, types.ModuleType):
            raise FedfeatError(
                f"{where} names {type(obj).__name__} {str(obj)[:60]!r}, neither a module nor a Method subclass; point "
                "it at a module that registers its methods with @register, or at a Method subclass ('mypkg:MyMethod')"
            )
        loaded.append(ep.name)
    return loaded


load_plugins()

__all__ = [
    "CAPABILITIES",
    "REGISTRY",
    "LinearHead",
    "LinearHeadParams",
    "Method",
    "capabilities",
    "get_method",
    "method_table",
    "register",
]
