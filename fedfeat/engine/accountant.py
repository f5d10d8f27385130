"""Privacy accounting with Google's ``dp-accounting`` (the library pfl-research and TensorFlow Privacy use):
epsilon for the run's delta, and the noise multiplier for a target epsilon.

What is accounted (``fedfeat.engine.privacy`` says what is released):

* **client level**: each round is a Gaussian mechanism of multiplier ``z`` on a sample of ``m`` of the ``N`` clients;
  the rounds compose: ``SelfComposed(PoissonSampled(q = m / N, Gaussian(z)), rounds)``. fedfeat samples a fixed
  ``m`` without replacement and accounts it as Poisson sampling at ``q = m / N``, the approximation DP-FedAvg papers,
  Flower and pfl-research's simulations make.
* **sample level**: every local step of a client is a Gaussian mechanism on its batch of ``B`` of its ``n_c``
  samples: ``SelfComposed(PoissonSampled(B / n_c, Gaussian(z)), rounds * epochs * ceil(n_c / B))``. A sample
  belongs to one client, so the run's epsilon is the largest over the clients; it counts every round for every client
  (as if each trained in all of them: an upper bound, since client sampling only helps) and accounts the shuffled
  batches as Poisson sampling at ``B / n_c`` (what Opacus and most DP-SGD papers report).

``accountant="rdp"`` (Renyi DP, Mironov 2017: the default of TF Privacy and of DP-FedAvg papers) or ``"pld"``
(privacy loss distributions: tighter).
"""

from __future__ import annotations

import logging
import math

from fedfeat.errors import FedfeatError

ACCOUNTANTS = ("rdp", "pld")


def _lib():
    try:
        import dp_accounting
        from dp_accounting import pld, rdp
    except ImportError as e:  # pragma: no cover - a core dependency
        raise FedfeatError(
            f"differential privacy needs the dp-accounting package ({e}); pip install dp-accounting"
        ) from None
    # its RDP orders that do not converge are dropped, loudly
    logging.getLogger("absl").setLevel(logging.ERROR)
    _unhook_absl_stream()
    return dp_accounting, rdp, pld


def _unhook_absl_stream() -> None:
    """absl (imported by dp-accounting) makes a logging handler that keeps ``sys.stderr`` as it was at import time,
    and its ``close`` closes that stream unless it is the current ``sys.stderr``: a later ``logging.config.dictConfig``
    (submitit's, at import) shuts every handler down and so closed a stream that had since been swapped out (a
    test runner's capture, a ``CliRunner``'s). Pointing it at the process's own stderr, which it never closes, keeps
    every other stream safe; the handler is not attached to any logger fedfeat uses."""
    import sys

    try:
        from absl import logging as absl_logging

        absl_logging.get_absl_handler().python_handler.stream = sys.__stderr__
    except Exception:  # noqa: BLE001 -- another absl: nothing to protect
        pass


def _accountant(name: str):
    _, rdp, pld = _lib()
    if name == "rdp":
        return rdp.RdpAccountant()
    if name == "pld":
        return pld.PLDAccountant()
    raise FedfeatError(f"--dp-accountant must be one of {', '.join(ACCOUNTANTS)}, got {name!r}")


def event(q: float, z: float, steps: int):
    """``steps`` compositions of the Poisson-subsampled (rate ``q``) Gaussian mechanism of multiplier ``z``."""
    dpa, _, _ = _lib()
    inner = dpa.GaussianDpEvent(z)
    if q < 1:
        inner = dpa.PoissonSampledDpEvent(q, inner)
    return dpa.SelfComposedDpEvent(inner, int(steps))


_RDP_STEP: dict = {}  # (q, z) -> (orders, the RDP of one step): RDP adds up over steps


def _rdp_step(q: float, z: float):
    if (q, z) not in _RDP_STEP:
        acc = _accountant("rdp")
        acc.compose(event(q, z, 1))
        _RDP_STEP[(q, z)] = (acc._orders, acc._rdp)  # the accountant's own orders and curve
        if len(_RDP_STEP) > 4096:
            _RDP_STEP.pop(next(iter(_RDP_STEP)))
    return _RDP_STEP[(q, z)]


def epsilon(q: float, z: float, steps: int, delta: float, accountant: str = "rdp") -> float:
    """Epsilon of ``event(q, z, steps)`` at ``delta`` (inf for ``z = 0``, 0 for no step). RDP composes additively:
    one step's curve is computed once per ``(q, z)`` and scaled (``rdp.compute_epsilon``, what ``get_epsilon`` does
    with the composed curve), so the per-round epsilon of a run costs no new accounting."""
    if steps <= 0:
        return 0.0
    if z <= 0:
        return math.inf
    if accountant == "rdp":
        _, rdp, _ = _lib()
        orders, curve = _rdp_step(q, z)
        return float(rdp.rdp_privacy_accountant.compute_epsilon(orders, steps * curve, delta)[0])
    acc = _accountant(accountant)
    acc.compose(event(q, z, steps))
    return float(acc.get_epsilon(delta))


def pareto(tasks: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """The ``(q, steps)`` pairs no other pair dominates (a larger rate and at least as many steps): only they can
    give the largest epsilon."""
    out = []
    for q, s in sorted(set(tasks), key=lambda t: (-t[0], -t[1])):
        if not out or s > out[-1][1]:
            out.append((q, s))
    return out


def worst_epsilon(tasks: list[tuple[float, int]], z: float, delta: float, accountant: str = "rdp") -> float:
    """The largest epsilon over ``tasks  # [(q, steps)]`` (the sample level: one task per client)."""
    return max((epsilon(q, z, s, delta, accountant) for q, s in pareto(tasks)), default=0.0)


def calibrate(tasks: list[tuple[float, int]], target: float, delta: float, accountant: str = "rdp") -> float:
    """The smallest noise multiplier (to 0.1 %) whose ``worst_epsilon`` is at most ``target``: bisection on
    ``log z`` (epsilon falls as ``z`` grows)."""
    if not target > 0:
        raise FedfeatError(f"--epsilon must be > 0, got {target}")
    tasks = pareto(tasks)
    if not tasks:
        return 0.0
    order = list(tasks)

    def over(z: float) -> bool:
        """Whether some task spends more than ``target`` at ``z``; the task that did last time is tried first (the
        answer "yes" needs one task's accounting, not all of them)."""
        for i, (q, s) in enumerate(order):
            if epsilon(q, z, s, delta, accountant) > target:
                order.insert(0, order.pop(i))
                return True
        return False

    lo, hi = 1e-2, 1.0
    while over(hi):
        lo, hi = hi, hi * 2
        if hi > 1e5:
            raise FedfeatError(
                f"--epsilon {target:g} at delta {delta:g} needs a noise multiplier above 1e5; raise --epsilon, or "
                "train fewer rounds / sample fewer clients or samples per step"
            )
    while hi / lo > 1.001:
        mid = math.sqrt(lo * hi)
        if over(mid):
            lo = mid
        else:
            hi = mid
    return hi


def client_tasks(clients: int, per_round: int, rounds: int) -> list[tuple[float, int]]:
    return [(min(1.0, per_round / max(clients, 1)), rounds)]


def sample_tasks(sizes, batch_size: int, epochs: int, rounds: int) -> list[tuple[float, int]]:
    """One ``(B / n_c, rounds * epochs * ceil(n_c / B))`` per client with samples."""
    out = []
    for n in sizes:
        n = int(n)
        if n > 0:
            out.append((min(1.0, batch_size / n), rounds * epochs * math.ceil(n / batch_size)))
    return out


__all__ = [
    "ACCOUNTANTS",
    "calibrate",
    "client_tasks",
    "epsilon",
    "event",
    "pareto",
    "sample_tasks",
    "worst_epsilon",
]
