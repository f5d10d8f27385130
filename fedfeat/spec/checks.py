"""Each run setting's own check (``fedfeat.spec.setting``'s ``check``): ``check(value, spec) -> complaint or
None``, the complaint one line after the setting's flag (``--alpha must be ...``)."""

from __future__ import annotations

import math

from fedfeat.errors import FedfeatError


def _positive(what: str, eg: str):
    return lambda v, s: None if v is None or v >= 1 else f"must be >= 1, got {v}{eg}"


def _fraction(v, s):
    if v is None or (math.isfinite(v) and 0 < v <= 1):
        return None
    return f"must be in (0, 1], got {v} (e.g. 0.1 for 10 % of the clients)"


def _choice(options, what: str = ""):
    def check(v, s):
        opts = options() if callable(options) else options
        if v is None or v in opts:
            return None
        one = " or ".join(map(str, opts)) if len(opts) == 2 else f"one of {', '.join(map(str, opts))}"
        return f"must be {one}, got {v!r}{what}"

    return check


def _kernels():
    from fedfeat.engine.rounds import KERNELS

    return KERNELS


def _device(v, s):
    d = str(v)
    if d in ("auto", "cpu", "cuda") or (d.startswith("cuda:") and d[5:].isdigit()):
        return None
    from fedfeat.encoders.openclip import devices_here

    return f"must be auto, cpu, cuda or cuda:N, got {v!r} (this machine has {devices_here()})"


def _schemes():
    from fedfeat.partition.registry import SCHEMES

    return tuple(SCHEMES)


def _scheme_unstack(v) -> str | None:
    """A scheme that declares it cannot be stacked (``Scheme.no_stack_reason``: open vocabulary)."""
    from fedfeat.partition.registry import SCHEMES

    cls = SCHEMES.get(v)
    return getattr(cls, "no_stack_reason", None) if cls is not None else None


def _imbalance(v, s):
    if v is None or (math.isfinite(v) and v >= 1):
        return None
    return f"must be a finite number >= 1, got {v} (e.g. 100)"


def _client_shots(v, s):
    if v is None or v >= 1:
        return None
    return f"must be >= 1, got {v} (e.g. 8: FedTPG's shots; 16: FedPGP's)"


def _val_split(v, s):
    if v is None or (math.isfinite(v) and 0 <= v < 1):
        return None
    return f"must be in [0, 1), got {v} (e.g. 0.2: 20 % of each test class validates)"


def _local_test_modes():
    from fedfeat.partition.make import LOCAL_TEST

    return LOCAL_TEST


def _preset(v, s):
    from fedfeat.partition.openvocab import PRESETS

    return None if v is None or v in PRESETS else f"must be one of {', '.join(PRESETS)}, got {v!r}"


def _local_val(v, s):
    from fedfeat.partition.openvocab import LOCAL_VAL

    return _choice(LOCAL_VAL)(v, s)


def _query_val(v, s):
    from fedfeat.partition.openvocab import QUERY_VAL

    return _choice(QUERY_VAL)(v, s)


def _class_order(v, s):
    from fedfeat.partition.openvocab import class_order_mode

    try:
        class_order_mode(v, s.data.preset)
    except FedfeatError as e:
        return str(e).split(" ", 1)[1] if str(e).startswith("--class-order ") else str(e)
    return None


def _shot_thresholds(v, s):
    if v is None:
        return None
    try:
        hi, lo = (float(t) for t in str(v).split(","))
    except ValueError:
        return f"must be 'many,few' counts such as 1500,200; got {v!r}"
    return None
