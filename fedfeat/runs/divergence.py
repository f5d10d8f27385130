"""Divergence: a run whose training blew up or whose head collapsed says so, once, and keeps going.

A run *diverges* at the first round ``R`` whose metric row shows one of (checked in this order):

* **non-finite loss** -- ``train_loss`` is NaN or inf. (The engines stop such a run themselves, with an error and
  no summary: ``fedfeat.engine.rounds.check_finite``; the rule is here for rows made elsewhere.)
* **accuracy at chance** -- ``test_acc`` (then ``val_acc``, ``--val-split``) is at most ``chance * (1 +
  CHANCE_MARGIN)``, where ``chance = 100 / K`` over the ``K`` classes the test split holds, after the same metric
  was *clearly above* chance at an earlier evaluated round (round 0 included): at least ``CLEAR_FACTOR * chance``,
  or halfway from chance to 100 % where that is lower (``K = 2``).
* **one class** -- at most one of the test split's classes has any correct prediction (``per_class_acc``; ``K >=
  3``), after ``test_acc`` was clearly above chance: what a head that puts every test image in one class gives,
  whatever the test split's class shares (on a balanced split it is also "at chance").

The verdict is ``{"round": R, "reason": "..."}`` (``summary.json``'s ``diverged``; ``None`` for a healthy run), with
``"recovered": {"round", "test_acc"}`` when the run's last evaluated accuracy is clearly above chance again (a
collapse the run came back from is still reported: its best and final numbers went through it). It is
read off the metrics each evaluated round already has (no extra evaluation, nothing per client), one row at a time
(``Monitor``), so a run is never stopped by it; ``fedfeat.runs.train`` prints one line on stderr when it happens::

    warning: RUN diverged at round R: REASON; try HINT

The hint is the method's ``divergence_hint`` where it has one, else CLIP's logit scale with the same weight step for a
head at logit scale 1, else a 10x smaller learning rate (``hint``). Thresholds are ours (not from a paper): they flag
a collapse to chance level, not a slow drift below zero-shot.

>>> rows = [{"round": 0, "test_acc": 71.9, "train_loss": None}, {"round": 1, "test_acc": 29.2, "train_loss": 2.1},
...         {"round": 2, "test_acc": 10.0, "train_loss": 2.0}]
>>> verdict(rows, classes=10)["round"]
2
>>> verdict(rows[:2], classes=10) is None
True
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Sequence
from itertools import islice

from fedfeat.runs.writers import RowWriter

CHANCE_MARGIN = 0.1  # ours: "at chance" is up to 10 % above 1/K (K = 10: <= 11 %; a one-class head: 10 %)
CLEAR_FACTOR = 2.0  # ours: "clearly above chance" is at least twice 1/K (K = 10: >= 20 %)
ACC_KEYS = ("test_acc", "val_acc")  # the accuracies checked, in this order (val_acc: --val-split)


def levels(classes: int) -> tuple[float, float]:
    """``(at_chance, clearly_above)`` in percent for ``classes`` equally likely classes.

    >>> levels(10)
    (11.0, 20.0)
    >>> [round(v, 2) for v in levels(2)]  # twice chance would be 100 %: halfway instead
    [55.0, 75.0]
    """
    chance = 100.0 / classes
    return chance * (1 + CHANCE_MARGIN), min(CLEAR_FACTOR * chance, (chance + 100.0) / 2)


class Monitor:
    """The verdict of a run, one metric row at a time: ``update(row)`` returns the verdict at the row that makes it
    (and ``None`` before and after); ``verdict`` keeps it.

    ``classes``: the number of test classes ``K``, or the ids of the classes the test split holds (those with
    test rows; the one-class rule looks at these only); ``None``: every entry of the rows' ``per_class_acc``."""

    def __init__(self, classes: int | Sequence[int] | None = None):
        if classes is None or isinstance(classes, int):
            self.scored, self.K = None, classes
        else:
            self.scored = [int(c) for c in classes]
            self.K = len(self.scored)
        self.best: dict[str, tuple[float, int]] = {}  # metric -> (best so far, its round)
        self.verdict: dict | None = None

    def _classes(self, row: dict) -> int | None:
        if self.K is None and row.get("per_class_acc") is not None:
            self.K = len(row["per_class_acc"])
        return self.K

    def update(self, row: dict) -> dict | None:
        if self.verdict is not None:
            return None
        rnd = int(row["round"])
        reason = self._reason(row, rnd)
        for key in ACC_KEYS:  # the best so far is over the rows before this one
            acc = row.get(key)
            if acc is not None and math.isfinite(acc) and acc > self.best.get(key, (-1.0, 0))[0]:
                self.best[key] = (float(acc), rnd)
        if reason is None:
            return None
        self.verdict = {"round": rnd, "reason": reason}
        return self.verdict

    def _reason(self, row: dict, rnd: int) -> str | None:
        loss = row.get("train_loss")
        if loss is not None and not math.isfinite(loss):
            return f"train loss is {loss}"
        K = self._classes(row)
        if K is None or K < 2:
            return None
        at_chance, clear = levels(K)
        for key in ACC_KEYS:
            acc, (best, at) = row.get(key), self.best.get(key, (-1.0, 0))
            if acc is None or not math.isfinite(acc) or best < clear:  # NaN: no rows scored, not a verdict
                continue
            if acc <= at_chance:
                return (
                    f"{key} {acc:.2f}% is at chance (1/{K} = {100 / K:.2f}%) after {best:.2f}% at round {at}"
                )
        pc = row.get("per_class_acc")
        best, at = self.best.get("test_acc", (-1.0, 0))
        if K >= 3 and pc is not None and row.get("test_acc") is not None and best >= clear:
            ids = range(len(pc)) if self.scored is None else self.scored
            right = list(islice((c for c in ids if pc[c] is not None and pc[c] > 0), 2))  # NaN > 0 is False
            if len(right) <= 1:  # stops at the second class with something right: O(1) for a healthy head
                which = f"only class {right[0]}" if right else "no class"
                return (
                    f"{which} of {K} has any test image right (test_acc {row['test_acc']:.2f}% after "
                    f"{best:.2f}% at round {at}): the head predicts one class"
                )
        return None


def verdict(rows: Iterable[dict], classes: int | Sequence[int] | None = None) -> dict | None:
    """The first divergence in ``rows`` (metric rows in round order, as ``metrics.jsonl`` holds them), ``{"round":
    R, "reason": "..."}``, or ``None`` (module docstring; ``classes`` as ``Monitor``'s)."""
    m = Monitor(classes)
    rows = list(rows)
    for row in rows:
        if m.update(row) is not None:
            break
    if m.verdict is None:
        return None
    # a collapse the run came back from is still said (its best / final numbers went through it), with where it ended
    last = [r for r in rows if r.get("test_acc") is not None and math.isfinite(r["test_acc"])]
    if last and int(last[-1]["round"]) > m.verdict["round"] and m.K and last[-1]["test_acc"] >= levels(m.K)[1]:
        return {**m.verdict, "recovered": {"round": int(last[-1]["round"]), "test_acc": float(last[-1]["test_acc"])}}
    return m.verdict


def hint(method) -> str:
    """What to try: the method's ``divergence_hint``; else, for a head at logit scale 1, CLIP's scale 100 with the
    same weight step (``lr / 100``: the cross-entropy's gradient w.r.t. the head grows with the scale); else its
    learning rate divided by 10.

    At logit scale 1 the cosine logits of different classes differ by hundredths and a learned bias swamps them: on
    the default synthetic store (Dirichlet 0.1, 100 clients x 10 %) FedAvg at lr 0.01 falls to 10 % by round 2 and
    at lr 0.001 by round 7, while ``logit_scale=100, lr=1e-4`` stays at 58.5-86.9 % over 10 rounds (83.1 % at the
    last; FedProx the same, FedNTD 60.0-85.2 %).

    >>> from types import SimpleNamespace as NS
    >>> hint(NS(divergence_hint="", p=NS(lr=0.01, logit_scale=1.0)))
    "CLIP's logit scale with the same weight step, --set logit_scale=100 --set lr=0.0001"
    >>> hint(NS(divergence_hint="", p=NS(lr=0.01)))
    'a 10x smaller learning rate, --set lr=0.001'
    """
    own = getattr(method, "divergence_hint", None)
    if own:
        return own
    p = getattr(method, "p", None)
    lr, scale = getattr(p, "lr", None), getattr(p, "logit_scale", None)
    if isinstance(lr, (int, float)) and not isinstance(lr, bool):
        if scale == 1:
            return (
                f"CLIP's logit scale with the same weight step, --set logit_scale=100 --set lr={lr / 100:g}"
            )
        return f"a 10x smaller learning rate, --set lr={lr / 10:g}"
    return "a smaller learning rate (fedfeat methods lists the method's settings)"


def message(name: str, v: dict, method) -> str:
    """The one stderr line: ``warning: NAME diverged at round R: REASON; try HINT``."""
    return f"warning: {name} diverged at round {v['round']}: {v['reason']}; try {hint(method)}"


class Watch(RowWriter):
    """The train loop's divergence check (a row writer): each row goes through a ``Monitor``; the first verdict is
    printed once on stderr. ``prior``: a resumed run's rows before its checkpoint (judged without printing unless
    they already diverged: then the line is printed once, now). ``final(metrics)`` is ``summary.json``'s value,
    over all of the run's rows."""

    def __init__(self, name: str, method, classes=None, prior: Iterable[dict] = (), stream=None):
        self.name, self.method, self.classes = name, method, classes
        self.stream = stream
        self.monitor = Monitor(classes)
        self.warned = False
        for row in prior:
            self.monitor.update(row)
        self._warn()

    def _warn(self) -> None:
        if self.monitor.verdict is not None and not self.warned:
            self.warned = True
            print(message(self.name, self.monitor.verdict, self.method), file=self.stream or sys.stderr)

    def row(self, row: dict) -> None:
        if self.monitor.update(row) is not None:
            self._warn()

    def final(self, metrics: list[dict]) -> dict | None:
        v = verdict(metrics, self.classes)
        if v is not None and not self.warned:
            self.monitor.verdict = v
            self._warn()
        return v


__all__ = ["CHANCE_MARGIN", "CLEAR_FACTOR", "Monitor", "Watch", "hint", "levels", "message", "verdict"]
