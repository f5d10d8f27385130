"""The run specification (``fedfeat.spec``): the CLI options, keys and checks derived from it cover every setting,
so that a new setting is everywhere or nowhere."""

from __future__ import annotations

import dataclasses

import pytest
import typer

from fedfeat import spec
from fedfeat.cli.app import app
from fedfeat.errors import FedfeatError
from fedfeat.runs.config import RunConfig, config_toml, resolve_config


def _flags(command: str) -> set[str]:
    cmd = typer.main.get_command(app).commands[command]
    return {o for p in cmd.params for o in p.opts if o.startswith("--")}


def test_train_sweep_and_partition_offer_the_specified_settings():
    train, sweep, part = _flags("train"), _flags("sweep"), _flags("partition")
    assert {f.flag for f in spec.FIELDS.values()} <= train
    assert {spec.FIELDS[k].flag for k in (*spec.SWEEPABLE, *spec.SWEEP_FIXED)} <= sweep
    # every scheme option train offers, fedfeat partition offers too (under its own names for two of them)
    renamed = {"--partition": "--scheme", "--partition-seed": "--seed"}
    want = {renamed.get(f.flag, f.flag) for f in spec.FIELDS.values() if f.part == "partition"}
    assert want <= part
    assert {"--alpha", "--shards", "--shots", "--min-size", "--classes-per-client"} <= part


def test_every_setting_has_help_and_a_toml_type():
    for k, f in spec.FIELDS.items():
        assert f.help and f.type in (int, float, str, bool), k  # bool: true / false in TOML, a --flag
        assert spec.DEFAULTS[k] == f.default


def test_config_toml_keeps_the_order_of_older_runs_and_lists_every_setting():
    cfg = RunConfig(**{k: v for k, v in spec.DEFAULTS.items()})
    cfg.alpha, cfg.min_size, cfg.classes_per_client = 0.5, 3, None
    keys = [
        ln.split(" = ")[0] for ln in config_toml(cfg, {}).split("[params]")[0].splitlines() if " = " in ln
    ]
    assert keys[:4] == ["method", "store", "partition", "clients"]  # the order config.toml always had
    assert keys == [k for k in spec.FIELDS if getattr(cfg, k) is not None]


@pytest.mark.parametrize("key", list(spec.FIELDS))
def test_a_setting_keys_exactly_its_declared_caches_and_stacks_unless_per_run(key):
    f = spec.FIELDS[key]
    if not f.examples:
        pytest.skip(f"{key}: no example value to vary it to")
    a = RunConfig(**spec.DEFAULTS)
    b = dataclasses.replace(a, **{key: f.examples[-1]})
    if getattr(a, key) == getattr(b, key):
        b = dataclasses.replace(a, **{key: f.examples[0]})
    for kind in spec.CACHES:
        differs = spec.cache_key(a, kind, "S") != spec.cache_key(b, kind, "S")
        assert differs == (kind in f.caches and key != "store"), (key, kind)
    assert (spec.stack_key(a) != spec.stack_key(b)) == (not f.per_run), key


def test_a_scheme_parameter_with_another_scheme_is_one_line_naming_the_flags():
    with pytest.raises(
        FedfeatError, match=r"--classes-per-client applies to --partition pathological only \(got iid\)"
    ):
        resolve_config({"partition": "iid", "classes_per_client": 3}, None, None)
    with pytest.raises(
        FedfeatError, match="--alpha applies to --partition dirichlet / dirichlet-equal / dirichlet-joint"
    ):
        resolve_config({"partition": "shard", "alpha": 0.5}, None, None)


def test_a_preset_s_scheme_parameters_leave_with_its_scheme():
    cfg = resolve_config({"preset": "caltech101", "partition": "dirichlet", "alpha": 0.3}, None, None)
    assert (
        cfg.shots is None and cfg.clients == 10
    )  # the preset's shots go with disjoint-classes; its clients stay


def test_the_typed_tree_round_trips():
    cfg = resolve_config(
        {"method": "fedavg", "partition": "shard", "shards": 3, "val_split": 0.2}, None, ["lr=0.1"]
    )
    tree = cfg.spec
    assert tree.partition.scheme == "shard" and tree.partition.shards == 3 and tree.data.val_split == 0.2
    assert tree.method.name == "fedavg" and dict(tree.params) == {"lr": "0.1"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        tree.partition.shards = 4
    assert spec.from_spec(tree) == cfg


def _implied_cases():
    from fedfeat.partition.registry import SCHEMES

    for name, cls in SCHEMES.items():
        for param, value in cls.implied().items():
            yield pytest.param(name, param, value, id=f"{name}-{param}")
        yield pytest.param(name, "partition_seed", cls.default_seed(None), id=f"{name}-seed")


@pytest.mark.parametrize("scheme, key, value", list(_implied_cases()))
def test_a_setting_given_at_its_implied_value_names_the_same_run(scheme, key, value):
    """``--min-size 10`` (FedNTD's rule, what dirichlet draws with when none is given), ``--alpha 0.1`` or the
    scheme's own seed, given explicitly, are the run the defaults make: same hashed settings, same name (issue 36;
    every scheme of the registry, so a new one is covered by itself)."""
    from fedfeat.runs.config import settings_hash
    from fedfeat.spec.derived import hashed

    flat = {f.name: k for k, f in spec.FIELDS.items() if f.part == "partition"}
    key = flat.get(key, key)
    base = resolve_config({"partition": scheme, "store": "s.zarr"}, None, None)
    given = resolve_config({"partition": scheme, "store": "s.zarr", key: value}, None, None)
    assert getattr(given, key) == value
    assert hashed(given) == hashed(base)
    assert settings_hash(given, {}, {}) == settings_hash(base, {}, {})
    other = value + 1 if isinstance(value, int) and not isinstance(value, bool) else None
    if other is not None:  # a value that is not the implied one still names another run
        assert hashed(
            resolve_config({"partition": scheme, "store": "s.zarr", key: other}, None, None)
        ) != hashed(base)
