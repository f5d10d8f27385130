"""The run specification: one typed, frozen tree of a run's settings, and everything derived from it.

A run is ``RunSpec(data, partition, engine, method, output)``; each part is a frozen dataclass whose fields are
declared once, here (the partition part's scheme parameters come from the partition registry,
``fedfeat.partition.registry.scheme_fields``: a new scheme's parameter is a new setting without an edit here).
Each field's metadata (``setting``) says what the field is, and every place that must agree with the settings is
derived from it, never written by hand:

* the flat keys of ``config.toml`` and of grid files, their types and defaults (``FIELDS``, ``DEFAULTS``,
  ``TYPES``), the flat ``RunConfig`` record the run layer reads (generated from the fields);
* the CLI options of ``fedfeat train`` and ``fedfeat sweep`` (``fedfeat.cli.options``), and ``fedfeat partition``'s
  scheme options;
* validation with one-line errors (``validate``): each field's own check, and a scheme parameter given with a
  scheme that does not take it;
* the run's name and settings hash (``in_hash``), the run identity written into checkpoints (``identity``);
* the session's cache keys (``cache_key``: which runs share a store, a partition, loaded features, a live encoder),
  and which runs may be stacked into one program (``stack_key``): runs stack only when they agree on every field
  that is not declared ``per_run``. A new field is therefore never silently shared: until it is declared
  ``per_run`` it keeps runs that differ in it apart.

``examples`` on a field are two values a sweep may vary it to; ``tests/test_spec_stacking.py`` varies every
sweepable field with them in one stacked grid and checks each run against the same run made alone.
"""

from fedfeat.spec.derived import (
    cache_key,
    drawn,
    group_items,
    hashed,
    identity,
    partition_args,
    scheme_params,
    stack_key,
    unstack_reason,
    validate,
)
from fedfeat.spec.fields import (
    CACHES,
    DEFAULTS,
    FIELDS,
    PARTS,
    SWEEP_FIXED,
    SWEEPABLE,
    TYPES,
    DataSpec,
    EngineSpec,
    Field,
    MethodSpec,
    OutputSpec,
    PartitionSpec,
    PrivacySpec,
    RunConfig,
    RunSpec,
    from_spec,
    setting,
    to_spec,
)

__all__ = [
    "CACHES", "DEFAULTS", "FIELDS", "PARTS", "SWEEPABLE", "SWEEP_FIXED", "TYPES", "DataSpec", "EngineSpec", "Field",
    "MethodSpec", "OutputSpec", "PartitionSpec", "PrivacySpec", "RunConfig", "RunSpec", "cache_key", "drawn", "from_spec",
    "group_items", "hashed", "identity", "partition_args", "scheme_params", "setting", "stack_key", "to_spec",
    "unstack_reason", "validate",
]  # fmt: skip
