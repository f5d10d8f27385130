"""Live logging (``fedfeat.runs.callbacks``, ``fedfeat.integrations.loggers``): callbacks from the API see exactly
the rounds of metrics.jsonl (after ``--resume`` only the new ones), the TensorBoard event file and the offline W&B
run read back equal metrics.jsonl, a failing logger is handled by the documented policy, a missing extra is one
line naming its ``pip install``."""

import json
import sys

import pytest
from typer.testing import CliRunner

import fedfeat
from fedfeat.cli.app import app
from fedfeat.errors import FedfeatError
from fedfeat.runs.callbacks import Callback

runner = CliRunner()
ROUNDS = 6


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    out = tmp_path_factory.mktemp("t") / "s.zarr"
    r = runner.invoke(
        app,
        ["synth", "--out", str(out), "--dim", "16", "--train-per-class", "30", "--test-per-class", "10",
         "--templates", "2", "--no-stats"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    return out


def _settings(store, out, **kw):
    return dict(method="fedavg", store=store, out=out, clients=6, participation=0.5, rounds=ROUNDS, **kw)


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


class Recorder(Callback):
    def __init__(self, stop_after=None):
        self.events, self.stop_after = [], stop_after

    def on_run_start(self, run):
        self.events.append(("start", run))

    def on_round_end(self, row):
        self.events.append(("round", row))
        if row["round"] == self.stop_after:
            raise KeyboardInterrupt  # a kill: not swallowed by the dispatcher

    def on_run_end(self, summary):
        self.events.append(("end", summary))

    def on_run_failed(self, error):
        self.events.append(("failed", error))

    def rounds(self):
        return [e[1]["round"] for e in self.events if e[0] == "round"]


def test_api_callback_sees_exactly_the_rounds(store, tmp_path):
    cb = Recorder()
    rec = fedfeat.train(**_settings(store, tmp_path), eval_every=2, callbacks=[cb], name="r")
    run = tmp_path / "r"
    kinds = [e[0] for e in cb.events]
    assert kinds == ["start"] + ["round"] * (ROUNDS + 1) + ["end"]
    start = cb.events[0][1]
    assert start["name"] == "r" and start["path"] == str(run) and start["resumed_after_round"] is None
    assert start["dir"] != start["path"] and start["config"]["rounds"] == ROUNDS
    seen = [e[1] for e in cb.events if e[0] == "round"]
    assert seen == _rows(run)  # every row, as written, in order (eval_every: test_acc None on odd rounds)
    assert [r["test_acc"] is None for r in seen] == [False, True, False, True, False, True, False]
    end = cb.events[-1][1]
    assert end["final_acc"] == rec["final_acc"] and end["path"] == str(run)


def test_a_kill_calls_on_run_failed_and_is_not_swallowed(store, tmp_path):
    killer = Recorder(stop_after=3)
    with pytest.raises(KeyboardInterrupt):
        fedfeat.train(**_settings(store, tmp_path), name="k", callbacks=[killer])
    assert killer.rounds() == [0, 1, 2, 3] and killer.events[-1][0] == "failed"
    assert isinstance(killer.events[-1][1], KeyboardInterrupt)
    assert not list(tmp_path.iterdir())  # no checkpoint yet: nothing to resume, nothing left


def test_resume_after_a_checkpoint_sees_only_the_new_rounds(store, tmp_path):
    from fedfeat.runs.config import resolve_config
    from fedfeat.runs.train import train as run_train

    cfg = resolve_config({**_settings(str(store), str(tmp_path)), "name": "k"}, None, None)
    with pytest.raises(KeyboardInterrupt):
        run_train(
            cfg, checkpoint_every=2, progress=False, log=lambda *a: None, callbacks=[Recorder(stop_after=5)]
        )
    cb = Recorder()
    run_train(None, resume=tmp_path / "k", progress=False, log=lambda *a: None, callbacks=[cb])
    start = cb.events[0][1]
    assert start["resumed_after_round"] == 4 and start["first_round"] == 5
    assert cb.rounds() == [5, 6] and cb.events[-1][0] == "end"
    assert [e[1] for e in cb.events if e[0] == "round"] == _rows(tmp_path / "k")[5:]


def test_a_logger_failing_mid_run_is_warned_once_and_the_run_goes_on(store, tmp_path, capsys):
    class Broken(Callback):
        name = "broken"
        calls = 0

        def on_round_end(self, row):
            Broken.calls += 1
            raise RuntimeError("disk says no")

    good = Recorder()
    fedfeat.train(**_settings(store, tmp_path), name="b", callbacks=[Broken(), good])
    err = capsys.readouterr().err
    assert err.count("logger broken failed in on_round_end (RuntimeError: disk says no)") == 1
    assert Broken.calls == 1 and good.rounds() == list(range(ROUNDS + 1))
    assert (tmp_path / "b" / "summary.json").is_file()


def test_a_logger_failing_to_start_stops_the_run_in_one_line(store, tmp_path):
    class NoStart(Callback):
        name = "nostart"

        def on_run_start(self, run):
            raise OSError("no such project")

    other = Recorder()
    with pytest.raises(FedfeatError) as e:
        fedfeat.train(**_settings(store, tmp_path), name="n", callbacks=[other, NoStart()])
    assert str(e.value).startswith("logger nostart failed to start: OSError: no such project")
    assert other.events[-1][0] == "failed"  # the logger that had started is closed
    assert not list(tmp_path.iterdir())  # nothing trained, nothing left


def test_not_a_callback_and_unknown_logger_are_one_line(store, tmp_path):
    with pytest.raises(FedfeatError, match="is not a callback"):
        fedfeat.train(**_settings(store, tmp_path), callbacks=[object()])
    r = runner.invoke(
        app, ["train", "--store", str(store), "--out", str(tmp_path), "--logger", "nope", "--quiet"]
    )
    assert r.exit_code == 2 and "unknown logger 'nope'; known: tensorboard, wandb" in r.output


def test_missing_extra_is_one_line_naming_pip_install(store, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as without the package
    monkeypatch.setitem(sys.modules, "wandb", None)
    for name in ("tensorboard", "wandb"):
        r = runner.invoke(app, ["train", "--store", str(store), "--out", str(tmp_path), "--logger", name])
        assert r.exit_code == 2, r.output
        line = r.output.strip()
        assert "\n" not in line and f"pip install fedfeat[{name}]" in line, line
    assert not list(tmp_path.iterdir())  # refused before anything is written


def _scalar_rows(rows, key):
    return [(r["round"], r[key]) for r in rows if r.get(key) is not None]


def test_tensorboard_event_file_equals_metrics(store, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    r = runner.invoke(
        app,
        ["train", "--store", str(store), "--out", str(tmp_path), "--method", "fedavg", "--clients", "6",
         "--participation", "0.5", "--rounds", str(ROUNDS), "--name", "tb", "--quiet", "--logger", "tensorboard"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    run = tmp_path / "tb"
    assert list((run / "tb").glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    rows = _rows(run)
    for key in ("test_acc", "train_loss", "bytes_up"):
        got = [(e.step, e.value) for e in acc.Scalars(key)]
        want = _scalar_rows(rows, key)
        assert [s for s, _ in got] == [s for s, _ in want], key
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6), (
            key
        )  # float32 in the file
    assert {"config/text_summary", "summary/text_summary"} <= set(acc.Tags()["tensors"])


def test_tensorboard_resume_purges_the_redone_rounds(store, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fedfeat.integrations.loggers import TensorBoardLogger
    from fedfeat.runs.config import resolve_config
    from fedfeat.runs.train import train as run_train

    cfg = resolve_config({**_settings(str(store), str(tmp_path)), "name": "k"}, None, None)
    with pytest.raises(KeyboardInterrupt):
        run_train(cfg, checkpoint_every=2, progress=False, log=lambda *a: None,
                  callbacks=[TensorBoardLogger(), Recorder(stop_after=5)])  # fmt: skip
    run_train(
        None, resume=tmp_path / "k", progress=False, log=lambda *a: None, callbacks=[TensorBoardLogger()]
    )
    run = tmp_path / "k"
    assert len(list((run / "tb").glob("events.out.tfevents.*"))) == 2
    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    got = [(e.step, e.value) for e in acc.Scalars("test_acc")]
    want = _scalar_rows(_rows(run), "test_acc")
    assert [s for s, _ in got] == list(range(ROUNDS + 1))  # round 5 once: the interrupted run's was purged
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)


def test_wandb_offline_run_reads_back(store, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    rec = fedfeat.train(**_settings(store, tmp_path), name="wb", callbacks=["wandb"])
    run = tmp_path / "wb"
    dirs = list((run / "wandb").glob("offline-run-*"))
    assert len(dirs) == 1, list((run / "wandb").iterdir())
    assert list(dirs[0].glob("run-*.wandb"))
    records = _wandb_records(next(dirs[0].glob("run-*.wandb")))
    history = [r for t, r in records if t == "history"]
    rows = _rows(run)
    assert [h["_step"] for h in history] == [r["round"] for r in rows]
    for key in ("test_acc", "train_loss", "bytes_up"):
        assert [h.get(key) for h in history] == pytest.approx([r[key] for r in rows]), key
    summary = {}
    for t, r in records:  # the run's summary: its updates in order
        if t == "summary":
            summary.update(r)
    assert summary["test_acc"] == pytest.approx(rows[-1]["test_acc"])
    assert summary["run/final_acc"] == pytest.approx(rec["final_acc"])
    assert summary["run/bytes_up"] == rec["bytes_up"] != rows[-1]["bytes_up"]


def _wandb_records(path):
    """(type, {key: value}) of each history and summary record of a .wandb file: wandb's record log (a 7-byte
    header ``:W&B`` 0xBEE1 v0, then 32 KiB blocks of records: crc32, length, type FULL/FIRST/MIDDLE/LAST) holding
    wandb's own protobuf ``Record`` messages (wandb 0.31 ships no reader of its own)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    b = path.read_bytes()
    assert b[:7] == b":W&B\xe1\xbe\x00"
    block, pos, raw, cur = 32768, 7, [], b""
    while pos + 7 <= len(b):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, n, t = struct.unpack("<IHB", b[pos : pos + 7])
        if n == 0 and t == 0:
            pos += left
            continue
        data, pos = b[pos + 7 : pos + 7 + n], pos + 7 + n
        if t == 1:
            raw.append(data)
        elif t == 2:
            cur = data
        elif t == 3:
            cur += data
        elif t == 4:
            raw.append(cur + data)
    out = []
    for d in raw:
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(d)
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            items.setdefault("_step", rec.history.step.num)
            out.append((kind, items))
        elif kind == "summary":
            out.append(
                (
                    kind,
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.summary.update},
                )
            )
    return out


def test_sweep_logs_every_run_live(store, tmp_path):
    """``sweep --logger tensorboard`` (a stacked sweep: the default) writes each run's own event file, equal to its
    metrics (issue 35: sweeps could not log live)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    r = runner.invoke(
        app,
        ["sweep", "--store", str(store), "--out", str(tmp_path), "--method", "fedavg", "--clients", "6",
         "--participation", "0.5", "--rounds", str(ROUNDS), "--seed", "0,1", "--quiet", "--logger", "tensorboard"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    runs = sorted(p for p in tmp_path.iterdir() if (p / "summary.json").exists())
    assert len(runs) == 2
    for run in runs:
        acc = EventAccumulator(str(run / "tb"))
        acc.Reload()
        got = [(e.step, round(e.value, 4)) for e in acc.Scalars("test_acc")]
        assert got == [(s, round(v, 4)) for s, v in _scalar_rows(_rows(run), "test_acc")]
    a, b = ([e.value for e in EventAccumulator(str(p / "tb")).Reload().Scalars("test_acc")] for p in runs)
    assert a != b  # each run its own curve, not one run's written twice
