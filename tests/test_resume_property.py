"""Property (issue 26): for every registered method that checkpoints (every method that trains in rounds:
all but ``zeroshot``), a run killed at random points and resumed -- once or twice, with random ``--checkpoint-every``
before and after, a row torn by the kill or not -- ends byte for byte equal to the uninterrupted run: the
``metrics.jsonl`` text without its timing fields, ``weights.safetensors``' bytes, and the summary's results.

The kill is in-process (a ``KeyboardInterrupt`` raised at the run's fault point ``after-round-N``, which keeps the
checkpointed partial directory) and the resume is ``fedfeat.runs.train.train(..., resume=)`` -- a fresh method
object, fresh data, the checkpoint read back from disk. ``test_sigkill_and_resume_in_fresh_processes`` does the same
with a real SIGKILL and a new interpreter for a prompt method (``tests/test_runs.py`` does it for fst-cbdg and
fedavgm). The prompt methods run on the tiny open_clip store of ``tests/helpers_clip.py``.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_clip import (
    feature_and_prompt_stores,
    subprocess_env,
    train_killed,
)
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from fedfeat.methods import REGISTRY
from fedfeat.runs.config import RunConfig

ROUNDS = 5
FEATURE = {  # method -> its settings on the synthetic store (those a method needs to run there)
    "fedavg": {}, "centralized": {}, "fedprox": {}, "fedavgm": {}, "fedntd": {}, "fst-cbdg": {}, "creff": {},
    "clip2fl": {}, "fedclip": {}, "copl-linear": {}, "fednova": {}, "fed-focal": {}, "fedavg-tau-norm": {},
    "ccvr": {},
    "fedadagrad": {}, "fedadam": {}, "fedyogi": {},  # their server moments m, v are checkpointed state
    "scaffold": {}, "feddyn": {},  # every client's c_i / nu_i (all N, not only the sampled) is checkpointed
    "fed-mp": {"partition": "disjoint-classes", "clients": 2},
    "ratio-loss": {"params": {"aux_per_class": 5}},
    "feddf": {"imbalance_factor": 10.0, "params": {"val_data": "train"}},
    "fedbe": {"imbalance_factor": 10.0},
    # the training-free family (issue 39): the statistics uploaded so far and who sent them are checkpointed
    "fedncm": {}, "fed3r": {}, "fedcof": {}, "fedpft": {},
}  # fmt: skip
PROMPT = {  # on the tiny open_clip store (pixels kept: fedcopl and fedopt re-encode images)
    "promptfl": {"params": {"n_ctx": 4}},
    "fedtpg": {},
    "fedcopl": {},
    "fedcopl/carried": {"params": {"optimizer_state": "carried"}},  # one optimiser carried client to client
    "pfedprompt": {},
    "fedopt": {},
    "fedkgcoop": {"params": {"n_ctx": 2}},  # FedTPG's CoOp baselines (issue 39)
    "fedcocoop": {"params": {"n_ctx": 2}},
    "fedpgp": {"params": {"n_ctx": 2}},  # personalised: every client's low-rank part / local prompt is state
    "promptfolio": {"params": {"n_ctx": 2}},
    "pfedmoap": {"params": {"n_ctx": 2}},
}
NOT_IN_ROUNDS = {"zeroshot"}  # trains nothing in rounds: never checkpoints
# every other registered method is covered by itself at its defaults, on the store its needs call for (the lists
# above hold only the settings a method needs beyond its defaults)
for _name, _cls in REGISTRY.items():
    if _name not in NOT_IN_ROUNDS and not any(k.split("/")[0] == _name for k in (*FEATURE, *PROMPT)):
        (PROMPT if _cls.needs_live_text or _cls.needs_pixels else FEATURE)[_name] = {}


def test_every_method_that_checkpoints_is_covered():
    covered = {m.split("/")[0] for m in (*FEATURE, *PROMPT)}
    assert covered == set(REGISTRY) - NOT_IN_ROUNDS
    # each on a store it can run on: the feature store has no live encoder and no pixels
    assert not [k for k in FEATURE if REGISTRY[k].needs_live_text or REGISTRY[k].needs_pixels]


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    return feature_and_prompt_stores(tmp_path_factory.mktemp("resume-prop"))


def _cfg(stores, key: str, out: Path) -> RunConfig:
    feature = key in FEATURE
    extra = dict(FEATURE[key] if feature else PROMPT[key])
    params = dict(extra.pop("params", {}))
    if not feature:
        params.setdefault("batch_size", 8)
    base = dict(method=key.split("/")[0], store=str(stores["feature" if feature else "prompt"]),
                clients=4 if feature else 3, participation=0.5 if feature else 0.67, rounds=ROUNDS,
                kernel="torch", device="cpu", out=str(out), name="x")  # fmt: skip
    return RunConfig(**{**base, **extra, "params": params})


def _run(cfg: RunConfig, every: int, kill: int | None = None, resume: Path | None = None) -> None:
    train_killed(cfg, every, kill, resume)


def _timing(key: str) -> bool:
    """Timings and memory figures differ between any two runs: ``seconds``, ``train_seconds``, ``seconds_per_round``,
    ``sec_*``, ``peak_rss_bytes``, ``rss_bytes_at_end``, ``peak_device_bytes``."""
    return (
        "seconds" in key
        or key.startswith("sec_")
        or key in ("peak_rss_bytes", "rss_bytes_at_end", "peak_device_bytes")
    )


def _result(run: Path) -> tuple:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    text = "".join(json.dumps({k: v for k, v in r.items() if not _timing(k)}) + "\n" for r in rows)
    summary = json.loads((run / "summary.json").read_text())
    summary.get("env", {}).pop(
        "threads", None
    )  # how the process ran (the CLI's thread policy vs the API), not a result
    results = {
        k: v for k, v in summary.items() if not _timing(k) and k not in ("provenance", "resumed_after_round")
    }
    return text, (run / "weights.safetensors").read_bytes(), results


_REFERENCE: dict = {}
_COUNTER = itertools.count()


def _reference(stores, key: str) -> tuple:
    if key not in _REFERENCE:
        out = stores["root"] / f"u-{key.replace('/', '-')}"
        _run(_cfg(stores, key, out), every=0)
        _REFERENCE[key] = _result(out / "x")
    return _REFERENCE[key]


@st.composite
def schedules(draw):
    """Checkpoint intervals and kill rounds: the first kill comes after a checkpoint (an in-process kill before
    one leaves nothing to resume; the kill after round N comes before N's checkpoint); a second kill, if any,
    during the resumed run."""
    every = draw(st.integers(1, ROUNDS - 1))
    first = draw(st.integers(every + 1, ROUNDS))
    done = ((first - 1) // every) * every  # the checkpoint it resumes from
    steps = [(every, first)]
    if draw(st.booleans()):
        every2 = draw(st.integers(1, ROUNDS - 1))
        steps.append((every2, draw(st.integers(done + 1, ROUNDS))))
    return steps, draw(st.integers(1, ROUNDS)), draw(st.booleans())


def _check(stores, key: str, schedule) -> None:
    steps, every_last, torn = schedule
    want = _reference(stores, key)
    out = stores["root"] / f"k{next(_COUNTER)}"
    cfg = _cfg(stores, key, out)
    _run(cfg, every=steps[0][0], kill=steps[0][1])
    for every, kill in steps[1:]:
        _run(cfg, every=every, kill=kill, resume=out / "x")
    if torn:  # the kill cut a row short
        with open(out / ".partial-x" / "metrics.jsonl", "a") as f:
            f.write('{"round": 3, "test_acc": 1')
    _run(cfg, every=every_last, resume=out / "x")
    got = _result(out / "x")
    assert got[0] == want[0], f"{key} {schedule}: metrics differ"
    assert got[1] == want[1], f"{key} {schedule}: weights differ"
    assert got[2] == want[2], f"{key} {schedule}: summary differs"
    assert sorted(p.name for p in out.iterdir()) == ["x"]


# no shrinking: a failing schedule is printed as drawn (shrinking re-runs trainings for minutes)
PROFILE = settings(max_examples=3, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
                   suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip


@pytest.mark.parametrize("key", list(FEATURE))
@PROFILE
@given(schedule=schedules())
def test_kill_and_resume_equals_the_uninterrupted_run_feature_methods(stores, key, schedule):
    _check(stores, key, schedule)


@pytest.mark.parametrize("key", list(PROMPT))
@PROFILE
@given(schedule=schedules())
def test_kill_and_resume_equals_the_uninterrupted_run_prompt_methods(stores, key, schedule):
    _check(stores, key, schedule)


def test_sigkill_and_resume_in_fresh_processes(stores, tmp_path):
    """A real SIGKILL (nothing of the clean-up runs) and a resume in a new interpreter: fedcopl, whose state is
    the largest of the prompt methods (pseudo-labels, prompts, optimiser state)."""
    args = [sys.executable, "-m", "fedfeat", "train", "--method", "fedcopl", "--store", str(stores["prompt"]),
            "--clients", "3", "--participation", "0.67", "--rounds", str(ROUNDS), "--kernel", "torch", "--device",
            "cpu", "--set", "batch_size=8", "--set", "optimizer_state=carried", "--name", "x", "--quiet",
            "--out", str(tmp_path)]  # fmt: skip
    p = subprocess.run([*args, "--checkpoint-every", "2"], env=subprocess_env(FEDFEAT_FAULT="after-round-3",
                       OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == -9, p.stderr
    p = subprocess.run([sys.executable, "-m", "fedfeat", "train", "--resume", str(tmp_path / "x"), "--quiet"],
                       env=subprocess_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 0 and "after round 2" in p.stdout, p.stdout + p.stderr
    assert "taking over the stale lock" in p.stderr  # the killed process's lock
    assert _result(tmp_path / "x") == _reference(stores, "fedcopl/carried")
