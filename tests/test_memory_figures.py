"""Memory is a measured figure (issue 30, item 3): every run's summary.json records its process's peak RSS, its RSS
at the end and, on CUDA, its peak device memory; stacked runs record the same; ``report --memory`` shows them."""

import json
import types

import pytest
import torch
from typer.testing import CliRunner

from fedfeat.cli.app import app
from fedfeat.runs import train as train_mod

runner = CliRunner()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    out = tmp_path_factory.mktemp("m") / "s.zarr"
    r = runner.invoke(
        app,
        ["synth", "--out", str(out), "--dim", "32", "--train-per-class", "40", "--test-per-class", "10",
         "--templates", "2", "--no-stats"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    return out


def _invoke(*args):
    r = runner.invoke(app, [str(a) for a in args])
    assert r.exit_code == 0, r.output
    return r


def _train(store, out, *extra):
    return _invoke("train", "--store", store, "--clients", "5", "--rounds", "2", "--participation", "0.4",
                   "--out", out, "--quiet", *extra)  # fmt: skip


def _check(s):
    peak, end = s["peak_rss_bytes"], s["rss_bytes_at_end"]
    assert isinstance(peak, int) and isinstance(end, int)
    # a process that imported torch holds tens of MB at least; no test process holds a TB
    assert 20e6 < end <= peak < 1e12
    assert ("peak_device_bytes" in s) == (s["device"].startswith("cuda"))


def test_summary_records_peak_and_end_rss(store, tmp_path):
    _train(store, tmp_path, "--method", "fedavg", "--name", "a")
    _check(json.loads((tmp_path / "a" / "summary.json").read_text()))


def test_stacked_runs_record_the_same(store, tmp_path):
    _invoke("sweep", "--method", "fedavg", "--store", store, "--clients", "5", "--rounds", "2",
            "--participation", "0.4", "--seed", "0,1", "--out", tmp_path, "--quiet")  # fmt: skip
    sums = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("*/summary.json"))]
    assert len(sums) == 2
    assert all(s.get("stacked_runs") == 2 for s in sums)  # really made as one stacked program
    for s in sums:
        _check(s)


@pytest.mark.parametrize("platform,maxrss,want", [("linux", 10**7, 1024 * 10**7), ("darwin", 10**11, 10**11)])
def test_ru_maxrss_units(monkeypatch, platform, maxrss, want):
    """ru_maxrss is KiB on Linux and bytes on macOS; both become bytes (the fake peaks exceed any real RSS)."""
    import resource
    import sys

    monkeypatch.setattr(sys, "platform", platform)
    monkeypatch.setattr(resource, "getrusage", lambda who: types.SimpleNamespace(ru_maxrss=maxrss))
    fig = train_mod.memory_figures("cpu")
    assert fig["peak_rss_bytes"] == want
    assert "peak_device_bytes" not in fig


def test_report_memory_column(store, tmp_path):
    _train(store, tmp_path, "--method", "fedavg", "--name", "new")
    _train(store, tmp_path, "--method", "fedprox", "--name", "old")
    old = tmp_path / "old" / "summary.json"  # a run made before the figures were recorded
    s = json.loads(old.read_text())
    for k in ("peak_rss_bytes", "rss_bytes_at_end", "peak_device_bytes"):
        s.pop(k, None)
    old.write_text(json.dumps(s))
    new = json.loads((tmp_path / "new" / "summary.json").read_text())

    plain = _invoke("report", tmp_path).stdout
    assert "peak RSS" not in plain
    lines = _invoke("report", tmp_path, "--memory").stdout.splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    i, j = head.index("peak RSS (GB)"), head.index("RSS at end (GB)")
    rows = {r[0]: r for r in ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])}
    assert rows["fedavg"][i] == f"{new['peak_rss_bytes'] / 1e9:.2f}"
    assert rows["fedavg"][j] == f"{new['rss_bytes_at_end'] / 1e9:.2f}"
    assert rows["fedprox"][i] == rows["fedprox"][j] == "-"
    js = json.loads(_invoke("report", tmp_path, "--format", "json").stdout)
    by = {r["method"]: r for r in js}
    assert by["fedavg"]["peak_rss_bytes"] == new["peak_rss_bytes"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_peak_device_bytes_on_cuda(store, tmp_path):
    _train(store, tmp_path, "--method", "fedavg", "--name", "g", "--device", "cuda")
    s = json.loads((tmp_path / "g" / "summary.json").read_text())
    _check(s)
    assert s["peak_device_bytes"] > 0  # the store's features at least were on the device
