"""Divergence (``fedfeat.runs.divergence``): the verdict on hand-made metric rows, the one stderr line, and real runs
that diverge (``summary.json``'s ``diverged``) or stay healthy (``null``), alone and stacked; and copl-linear's
default learning rate (``lr = 1e-4``, FST-CBDG's 0.01 over the logit scale 100), which keeps it above zero-shot
where the old 0.01 collapsed to chance.

The levels are worked by hand for K = 10 classes: chance = 10 %, "at chance" <= 10 x 1.1 = 11 %, "clearly above"
>= 2 x 10 = 20 %."""

import io
import json
import math
from types import SimpleNamespace as NS

import pytest

import fedfeat
from fedfeat.methods import get_method
from fedfeat.runs.divergence import Monitor, Watch, hint, levels, message, verdict
from tests.helpers_clip import synth_store


def _rows(accs, losses=None, **extra):
    losses = losses or [None] + [1.0] * (len(accs) - 1)
    return [
        {"round": r, "test_acc": a, "train_loss": l, **extra} for r, (a, l) in enumerate(zip(accs, losses))
    ]


# ------------------------------------------------------------------------------------------------ the verdict
def test_the_issues_copl_linear_collapse_is_a_verdict_at_round_3():
    rows = _rows([71.9, 27.7, 25.1, 10.0], [None, 19.15, 22.03, 61.78])
    assert verdict(rows, classes=10) == {
        "round": 3,
        "reason": "test_acc 10.00% is at chance (1/10 = 10.00%) after 71.90% at round 0",
    }


def test_levels_by_hand():
    assert levels(10) == pytest.approx((11.0, 20.0))
    assert levels(100) == pytest.approx((1.1, 2.0))
    assert levels(2) == pytest.approx((55.0, 75.0))  # twice chance would be 100 %: halfway to 100 instead


@pytest.mark.parametrize(
    "accs, want",
    [
        ([71.9, 78.5, 80.3, 84.3], None),  # healthy
        ([71.9, 27.7, 12.0, 11.01], None),  # low, but above 11 %: a drift, not a collapse
        ([19.99, 10.0, 10.0], None),  # never clearly above chance (< 20 %)
        ([20.0, 11.0], 1),  # both levels inclusive
        ([15.0, 25.0, 10.5], 2),  # clearly above at round 1, not round 0
        ([80.0, 10.0, 80.0, 10.0], 1),  # the first collapse only
    ],
)
def test_verdict_rounds(accs, want):
    v = verdict(_rows(accs), classes=10)
    assert (v and v["round"]) == want


def test_a_non_finite_loss_is_a_verdict_even_before_any_accuracy():
    assert verdict(_rows([5.0, 6.0, 7.0], [None, 1.0, math.nan]), classes=10) == {
        "round": 2,
        "reason": "train loss is nan",
    }
    assert verdict(_rows([50.0, 60.0], [None, math.inf]), classes=10)["reason"] == "train loss is inf"


def test_one_class_on_an_imbalanced_test_split():
    """Class 1 holds 40 % of the test images: a head predicting class 1 for all scores 40 %, well above chance
    (25 % for K = 4, at-chance <= 27.5 %), but only class 1 has anything right."""
    rows = [
        {"round": 0, "test_acc": 70.0, "per_class_acc": [60.0, 80.0, 70.0, 60.0]},
        {"round": 1, "test_acc": 40.0, "per_class_acc": [0.0, 100.0, 0.0, 0.0]},
    ]
    assert verdict(rows) == {
        "round": 1,
        "reason": "only class 1 of 4 has any test image right (test_acc 40.00% after 70.00% at round 0): the head "
        "predicts one class",
    }
    # two classes with something right: no verdict
    two = [rows[0], {**rows[1], "per_class_acc": [0.0, 100.0, 0.0, 5.0], "test_acc": 41.0}]
    assert verdict(two) is None
    # only the classes the test split holds count: class 3 has no test rows (its 0 % means nothing), so K = 3
    held = [
        {"round": 0, "test_acc": 70.0, "per_class_acc": [60.0, 80.0, 70.0, 0.0]},
        {"round": 1, "test_acc": 50.0, "per_class_acc": [0.0, 100.0, 0.0, 0.0]},
    ]
    assert verdict(held, classes=[0, 1, 2])["reason"].startswith("only class 1 of 3 has")
    assert verdict(held, classes=[0, 1, 2, 3])["reason"].startswith("only class 1 of 4 has")


def test_two_classes_use_the_chance_rule_only():
    rows = [
        {"round": 0, "test_acc": 80.0, "per_class_acc": [80.0, 80.0]},
        {"round": 1, "test_acc": 56.0, "per_class_acc": [100.0, 12.0]},
        {"round": 2, "test_acc": 50.0, "per_class_acc": [100.0, 0.0]},
    ]
    assert verdict(rows)["round"] == 2  # 56 > 55 (at chance for K = 2); 50 <= 55


def test_validation_accuracy_is_checked_too():
    rows = [
        {"round": r, "test_acc": 50.0, "val_acc": v, "train_loss": None}
        for r, v in enumerate([60.0, 30.0, 9.0])
    ]
    assert verdict(rows, classes=10) == {
        "round": 2,
        "reason": "val_acc 9.00% is at chance (1/10 = 10.00%) after 60.00% at round 0",
    }


def test_rounds_without_evaluation_are_skipped():
    """--eval-every: rows with test_acc None judge nothing and keep the best so far."""
    rows = _rows([70.0, None, None, 10.0])
    assert verdict(rows, classes=10)["reason"].endswith("after 70.00% at round 0")
    assert verdict(rows, classes=10)["round"] == 3


def test_the_number_of_classes_defaults_to_the_per_class_accuracies():
    rows = [{"round": 0, "test_acc": 30.0, "per_class_acc": [30.0] * 20},
            {"round": 1, "test_acc": 5.4, "per_class_acc": [5.4] * 20}]  # fmt: skip
    assert verdict(rows) == {
        "round": 1,
        "reason": "test_acc 5.40% is at chance (1/20 = 5.00%) after 30.00% at round 0",
    }
    assert verdict(rows[:1] + [{**rows[1], "test_acc": 5.6}]) is None  # 5.6 > 5.5


def test_the_monitor_gives_its_verdict_once():
    m = Monitor(10)
    got = [m.update(r) for r in _rows([70.0, 9.0, 70.0, 9.0])]
    assert got == [None, {"round": 1, "reason": got[1]["reason"]}, None, None]
    assert m.verdict["round"] == 1


# ---------------------------------------------------------------------------------------- the stderr line
def test_the_watch_prints_one_line_once():
    err = io.StringIO()
    method = NS(divergence_hint="fewer steps", p=NS(lr=0.01, logit_scale=100.0))
    w = Watch("RUN", method, classes=10, stream=err)
    rows = _rows([70.0, 40.0, 9.0, 8.0, 70.0, 9.0])
    for r in rows:
        w.row(r)
    assert w.final(rows) == {
        "round": 2,
        "reason": "test_acc 9.00% is at chance (1/10 = 10.00%) after 70.00% at round 0",
    }
    assert err.getvalue() == (
        "warning: RUN diverged at round 2: test_acc 9.00% is at chance (1/10 = 10.00%) after 70.00% at round 0; "
        "try fewer steps\n"
    )


def test_a_resumed_run_that_had_diverged_says_so_once_and_healthy_ones_say_nothing():
    err = io.StringIO()
    prior = _rows([70.0, 9.0, 70.0])
    w = Watch("RUN", NS(divergence_hint="x"), classes=10, prior=prior, stream=err)
    assert err.getvalue().startswith("warning: RUN diverged at round 1: ")  # printed on resuming
    later = {"round": 3, "test_acc": 5.0, "train_loss": 1.0}
    w.row(later)
    assert w.final([*prior, later])["round"] == 1
    assert err.getvalue().count("\n") == 1
    quiet = io.StringIO()
    ok = Watch("OK", NS(divergence_hint="x"), classes=10, stream=quiet)
    for r in _rows([70.0, 75.0]):
        ok.row(r)
    assert ok.final(_rows([70.0, 75.0])) is None and quiet.getvalue() == ""


def test_hints():
    assert hint(get_method("fedavgm", {})).startswith(
        "CLIP's logit scale with a small step and eta / (1 - beta) = 1"
    )
    assert hint(get_method("fedavg", {})) == (
        "CLIP's logit scale with the same weight step, --set logit_scale=100 --set lr=0.0001"
    )
    assert (
        hint(get_method("copl-linear", {})) == "a 10x smaller learning rate, --set lr=1e-05"
    )  # already at 100
    assert message("R", {"round": 4, "reason": "why"}, NS(divergence_hint="h")) == (
        "warning: R diverged at round 4: why; try h"
    )


# --------------------------------------------------------------------------------------------- real runs
@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """CIFAR-10-shaped but small (D = 256, 300 / 100 images per class): copl-linear at lr 0.01 collapses on it as
    on the default store, and at its default does not."""
    return synth_store(
        tmp_path_factory.mktemp("div") / "s.zarr", dim=256, train_per_class=300, test_per_class=100
    )


def _train(store, tmp_path, **kw):
    kw = {"clients": 20, "participation": 0.5, "rounds": 10, **kw}
    return fedfeat.train(store=store, out=tmp_path, progress=False, **kw)


def _summary(run):
    return json.loads((run.path / "summary.json").read_text())


def test_copl_linear_at_its_default_keeps_above_zero_shot_and_is_not_diverged(store, tmp_path, capfd):
    assert get_method("copl-linear", {}).p.lr == 1e-4
    run = _train(store, tmp_path, method="copl-linear")
    accs = (
        [r["test_acc"] for r in run.metrics]
        if isinstance(run.metrics, list)
        else list(run.metrics["test_acc"])
    )
    assert all(a > accs[0] for a in accs[1:]), accs  # every round above zero-shot (round 0)
    s = _summary(run)
    assert "diverged" in s and s["diverged"] is None
    assert "diverged" not in capfd.readouterr().err


def test_a_run_forced_to_diverge_writes_the_key_and_one_stderr_line(store, tmp_path, capfd):
    """copl-linear at its old lr 0.01 (a 100x step at CLIP's scale): 67.3 -> 30.3 -> 18.1 -> 10.6 % by round 3."""
    run = _train(store, tmp_path, method="copl-linear", params={"lr": 0.01})
    v = _summary(run)["diverged"]
    assert v["round"] == 3 and v["reason"].startswith(
        "test_acc 10.60% is at chance (1/10 = 10.00%) after 67."
    )
    lines = [line for line in capfd.readouterr().err.splitlines() if "diverged" in line]
    assert lines == [
        f"warning: {run.path.name} diverged at round 3: {v['reason']}; try a 10x smaller learning rate, "
        "--set lr=0.001"
    ]
    rows = run.metrics if isinstance(run.metrics, list) else run.metrics.to_dict("records")
    assert len(rows) == 11  # the run was not stopped


def test_stacked_runs_each_have_their_own_verdict(store, tmp_path, capfd):
    from fedfeat.runs.config import resolve_config
    from fedfeat.runs.train import stack_group, train_stacked

    base = {"store": str(store), "method": "fedavgm", "clients": 20, "rounds": 3, "participation": 0.5,
            "out": str(tmp_path)}  # fmt: skip
    bad = resolve_config({**base, "name": "bad"}, None, ["server_lr=100"])
    good = resolve_config({**base, "name": "good"}, None, ["logit_scale=100", "lr=1e-5", "server_lr=0.1"])
    assert stack_group(bad) == stack_group(good) is not None  # one program
    train_stacked([bad, good], log=lambda *a: None)
    sb, sg = (json.loads((tmp_path / n / "summary.json").read_text()) for n in ("bad", "good"))
    assert sb["stacked_runs"] == sg["stacked_runs"] == 2
    assert sb["diverged"]["round"] == 1 and sb["diverged"]["reason"].startswith(
        "test_acc 10.00% is at chance"
    )
    assert sg["diverged"] is None
    err = [line for line in capfd.readouterr().err.splitlines() if "diverged" in line]
    assert len(err) == 1 and err[0].startswith("warning: bad diverged at round 1: ")


def test_a_collapse_the_run_came_back_from_is_said_with_where_it_ended():
    """`make demo-clip2fl`'s fedavg (lr 0.1 under the long tail): 68.2 -> 10.0 at round 1, 55.9 at round 50. The
    collapse is reported (its numbers went through it) and so is the recovery; one that stays down has none."""
    from fedfeat.report.load import diverged_text

    rows = [{"round": 0, "test_acc": 68.2}, {"round": 1, "test_acc": 10.0}, {"round": 2, "test_acc": 40.0},
            {"round": 3, "test_acc": 55.9}]  # fmt: skip
    v = verdict(rows, classes=10)
    assert v["round"] == 1 and v["recovered"] == {"round": 3, "test_acc": 55.9}
    assert diverged_text({"name": "r", "diverged": v}).endswith("; recovered to 55.90% by round 3")
    assert "recovered" not in verdict(rows[:2] + [{"round": 2, "test_acc": 15.0}], classes=10)
