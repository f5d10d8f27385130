"""``fedfeat train --partition FILE.json``: a partition made elsewhere, in ``fedfeat partition --export``'s format,
checked against the store (one line per problem), named by its content (``fedfeat.partition.external``; issue 35)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from typer.testing import CliRunner

from fedfeat.cli.app import app

runner = CliRunner()
N_TRAIN = 10 * 30  # the store's train rows: 10 classes x 30


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A small store, a Dirichlet partition of it exported to p.json, and a run on the stored partition."""
    d = tmp_path_factory.mktemp("pf")
    store = d / "s.zarr"
    r = runner.invoke(app, ["synth", "--out", str(store), "--dim", "16", "--train-per-class", "30",
                            "--test-per-class", "12", "--templates", "2", "--no-stats"])  # fmt: skip
    assert r.exit_code == 0, r.output
    part = ["--alpha", "0.5", "--clients", "5", "--min-size", "2"]
    # stored in the store (the drawn run below reads it from there) and exported
    r = runner.invoke(app, ["partition", str(store), "--scheme", "dirichlet", *part, "--export",
                            str(d / "p.json")])  # fmt: skip
    assert r.exit_code == 0, r.output
    run = _train(store, d / "runs", "drawn", "--partition", "dirichlet", *part)
    return store, d / "p.json", run, d


def _train(store, out, name, *extra):
    r = runner.invoke(app, ["train", "--store", str(store), "--method", "fedavg", "--rounds", "2",
                            "--participation", "0.6", "--kernel", "torch", "--out", str(out), "--name", name,
                            "--quiet", *extra])  # fmt: skip
    assert r.exit_code == 0, r.output
    return out / name


def _clients(run):
    return [np.asarray(c) for c in json.loads((run / "partition.json").read_text())["clients"]]


def _rows(run):
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if "seconds" not in k} for r in rows]


def test_exported_file_trains_as_the_stored_partition(env):
    from fedfeat.partition.stored import read
    from fedfeat.store.featurestore import FeatureStore

    store, pfile, drawn, d = env
    run = _train(store, d / "runs", "file", "--partition", str(pfile))  # no --clients: the file sets it
    a = json.loads((drawn / "summary.json").read_text())
    b = json.loads((run / "summary.json").read_text())
    assert b["final_acc"] == a["final_acc"] and _rows(run) == _rows(drawn)
    assert b["clients"] == 5
    st = FeatureStore.open(store)
    # the export names the store it was made for, so the file is refused on another store
    assert json.loads(pfile.read_text())["store_fingerprint"] == st.attrs["fingerprint_hash"]
    stored = read(st, a["partition"])  # the partition the first run read from the store
    got = _clients(run)  # the run keeps the partition it trained on
    assert len(got) == 5 and all(np.array_equal(x, y) for x, y in zip(got, stored.clients))
    sha = __import__("hashlib").sha256(pfile.read_bytes()).hexdigest()
    assert b["partition"] == f"file-{sha[:12]}-c5"
    cfg = (run / "config.toml").read_text()
    assert f'partition = "{pfile}"' in cfg and "clients = 5" in cfg


def test_the_content_names_the_run_not_the_path(env, tmp_path):
    from fedfeat.runs.config import resolve_config
    from fedfeat.runs.session import signatures
    from fedfeat.spec import hashed

    store, pfile, _, _ = env
    copy = tmp_path / "elsewhere" / "copy.json"
    copy.parent.mkdir()
    shutil.copy(pfile, copy)
    doc = json.loads(pfile.read_text())
    # the same clients in another order: another file
    doc["clients"] = doc["clients"][1:] + doc["clients"][:1]
    other = tmp_path / "other.json"
    other.write_text(json.dumps(doc))

    def cfg(p):
        return resolve_config({"store": str(store), "partition": str(p), "clients": 5}, None, None)

    a, b, c = cfg(pfile), cfg(copy), cfg(other)
    assert hashed(a) == hashed(b) and hashed(a) != hashed(c)
    assert signatures(a)["partitions"] == signatures(b)["partitions"] != signatures(c)["partitions"]
    assert str(pfile) not in json.dumps(hashed(a))  # the path is not in the hash
    runs = []
    for out, p in (("r1", pfile), ("r2", copy), ("r3", other)):
        r = runner.invoke(app, ["train", "--store", str(store), "--method", "fedavg", "--rounds", "1",
                                "--kernel", "torch", "--out", str(tmp_path / out), "--quiet", "--partition",
                                str(p)])  # fmt: skip
        assert r.exit_code == 0, r.output
        runs.append(next((tmp_path / out).iterdir()).name)
    assert runs[0] == runs[1] and runs[0] != runs[2]


def _bad(env, tmp_path, doc, *extra, raw: str | None = None):
    store, _, _, _ = env
    p = tmp_path / "bad.json"
    p.write_text(raw if raw is not None else json.dumps(doc))
    out = tmp_path / "runs"
    r = runner.invoke(app, ["train", "--store", str(store), "--method", "fedavg", "--rounds", "1", "--out",
                            str(out), "--quiet", "--partition", str(p), *extra])  # fmt: skip
    assert r.exit_code != 0, r.output
    assert len(r.output.strip().splitlines()) == 1, r.output
    assert not out.exists() or not any(out.iterdir())  # nothing half-written
    return r.output


def _good_clients(env):
    return json.loads(env[1].read_text())["clients"]


def test_a_float_or_boolean_index_is_refused(env, tmp_path):
    c = _good_clients(env)
    c[1][0] = 3.0
    assert "client 1 holds 3.0, not an integer row index" in _bad(env, tmp_path, {"clients": c})
    c = _good_clients(env)
    c[2].append(True)
    assert "client 2 holds true, not an integer row index" in _bad(env, tmp_path, {"clients": c})
    c = _good_clients(env)
    c[0][0] = "5"
    assert 'client 0 holds "5"' in _bad(env, tmp_path, {"clients": c})


def test_an_index_out_of_range_is_refused(env, tmp_path):
    c = _good_clients(env)
    c[3].append(N_TRAIN)
    out = _bad(env, tmp_path, {"clients": c})
    assert f"client 3 holds row {N_TRAIN}, but the store's train split has {N_TRAIN} rows" in out
    c = _good_clients(env)
    c[0].append(-1)
    assert "client 0 holds row -1" in _bad(env, tmp_path, {"clients": c})


def test_an_index_in_two_clients_or_twice_in_one_is_refused(env, tmp_path):
    c = _good_clients(env)
    row = c[0][0]
    c[4].append(row)
    assert f"row {row} is in client 0 and client 4; a row belongs to one client" in _bad(
        env, tmp_path, {"clients": c}
    )
    c = _good_clients(env)
    c[2].append(c[2][0])
    assert f"client 2 holds row {c[2][0]} twice" in _bad(env, tmp_path, {"clients": c})


def test_an_empty_client_is_refused(env, tmp_path):
    c = _good_clients(env) + [[]]
    assert "client 5 holds no rows (1 of 6 clients are empty)" in _bad(env, tmp_path, {"clients": c})


def test_the_client_count_must_match_clients(env, tmp_path):
    out = _bad(env, tmp_path, {"clients": _good_clients(env)}, "--clients", "3")
    assert "has 5 clients, but --clients is 3; drop --clients (the file sets it) or pass --clients 5" in out


def test_the_store_fingerprint_must_match_when_the_file_has_one(env, tmp_path):
    from fedfeat.store.featurestore import FeatureStore

    doc = {"clients": _good_clients(env), "store_fingerprint": "0000000000000000"}
    have = FeatureStore.open(env[0]).attrs["fingerprint_hash"]
    out = _bad(env, tmp_path, doc)
    assert f"made for a store with fingerprint 0000000000000000, but store {env[0]} has {have}" in out
    doc["store_fingerprint"] = have  # the right one: accepted
    store = env[0]
    p = tmp_path / "fp.json"
    p.write_text(json.dumps(doc))
    _train(store, tmp_path / "ok", "fp", "--partition", str(p))


@pytest.mark.parametrize(
    ("doc", "raw", "says"),
    [
        (None, "{not json", "is not valid JSON"),
        ({"scheme": "iid"}, None, "has no 'clients' list"),
        ([[1, 2]], None, "is a JSON list"),
        ({"clients": [[0, 1], 5]}, None, "client 1 is int 5, not a list of row indices"),
        ({"clients": []}, None, "has no clients"),
        ({"clients": [[0]], "params": {"split": "test"}}, None, "partitions split 'test'"),
    ],
)
def test_a_file_not_in_the_format_is_refused(env, tmp_path, doc, raw, says):
    assert says in _bad(env, tmp_path, doc, raw=raw)


def test_a_missing_file_and_the_settings_of_a_drawn_partition_are_refused(env, tmp_path):
    store, pfile, _, _ = env
    for extra, says in (
        (["--partition", str(tmp_path / "nope.json")], "no such partition file"),
        (["--partition", str(pfile), "--partition-seed", "3"], "drop --partition-seed"),
        (["--partition", str(pfile), "--imbalance-factor", "10"], "drop --imbalance-factor"),
        (["--partition", str(pfile), "--alpha", "0.3"], "--alpha applies to --partition"),
        (["--partition", "nope"], "(or a partition file FILE.json"),
    ):
        r = runner.invoke(app, ["train", "--store", str(store), "--method", "fedavg", "--rounds", "1", "--out",
                                str(tmp_path / "runs"), "--quiet", *extra])  # fmt: skip
        assert r.exit_code == 2 and says in r.output and len(r.output.strip().splitlines()) == 1, r.output
    r = runner.invoke(app, ["partition", str(store), "--scheme", str(pfile)])
    assert r.exit_code == 2 and "fedfeat train --partition" in r.output, r.output
