"""``fedfeat reproduce``: a paper table's grid on small synthetic stand-in stores, the paper's layout with mean ± std
over seeds beside the paper's numbers, a missing store named with its make target, and --eval-every."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from fedfeat import reproduce as R
from fedfeat.cli import app
from fedfeat.errors import FedfeatError

runner = CliRunner()


@pytest.fixture()
def small_shapes(monkeypatch):
    shapes = {
        ("cifar10", "RN50"): dict(classes=10, train_per_class=100, test_per_class=20, dim=32, templates=2),
        ("cifar100", "RN50"): dict(
            classes=100, train_per_class=20, test_per_class=4, dim=32, templates=2, s=0.1
        ),
    }
    monkeypatch.setattr(R, "SYNTH_SHAPES", shapes)


def test_table4_on_stand_in_stores_matches_its_runs(small_shapes, tmp_path):
    text = R.reproduce("fst-cbdg-table4", store_root=tmp_path / "cache", synthetic=True, seeds=2, rounds=2,
                       out=tmp_path / "runs", fmt="json", log=lambda *a: None)  # fmt: skip
    cells = json.loads(text)
    assert len(cells) == 2 * 4 and {c["n"] for c in cells} == {2}
    assert cells[0]["paper"] == 68.6 and cells[-1]["paper"] == 43.2
    # every cell = mean and sample std of its two runs' final accuracy, recomputed from the run directories
    runs = [json.loads(p.read_text()) for p in (tmp_path / "runs").glob("*/summary.json")]
    assert len(runs) == 16 and all(r["rounds"] == 2 for r in runs)
    for c in cells:
        col = next(x for x in R.TABLES["fst-cbdg-table4"].columns if x.label == c["column"])
        ds = f"synth-{col.dataset}-rn50"
        bal = "equal" if c["row"] == "Equal sampling" else "class"
        acc = [r["final_acc"] for r in runs if ds in r["store"] and r["params"]["balance"] == bal
               and r["partition"].startswith(col.settings["partition"])]  # fmt: skip
        assert len(acc) == 2
        assert c["mean"] == pytest.approx(np.mean(acc)) and c["std"] == pytest.approx(np.std(acc, ddof=1))
    # rendered again (markdown), the finished runs are reused, not redone
    logs = []
    md = R.reproduce("fst-cbdg-table4", store_root=tmp_path / "cache", synthetic=True, seeds=2, rounds=2,
                     out=tmp_path / "runs", log=logs.append)  # fmt: skip
    assert sum("finished already, skipped" in m for m in logs) == 16
    assert "SYNTHETIC STAND-IN STORES" in md and "| Balanced sampling |" in md and "(74.0)" in md


def test_missing_store_names_the_make_target(tmp_path):
    with pytest.raises(
        FedfeatError, match=r"no RN50 store of cifar10 under .*`make cache-fst-cbdg`.*--synthetic"
    ):
        R.reproduce("fst-cbdg-table1", store_root=tmp_path, log=lambda *a: None)
    r = runner.invoke(app, ["reproduce", "no-such-table"])
    assert r.exit_code == 2 and "unknown table 'no-such-table'; known: fst-cbdg-table1" in r.output


def test_undrawable_column_is_named_not_fatal(small_shapes, tmp_path, monkeypatch):
    """A Dirichlet column that FedNTD's rule cannot draw (100 clients >= 10 samples at alpha 0.05) shows n/a and
    the partitioner's reason; the other columns run."""
    t = R.TABLES["fst-cbdg-table2"]
    small = R.Table(t.name, t.title, t.backbone, t.make_target, [t.columns[6], t.columns[9]], [t.rows[0]],
                    {"CLIP-ZS": [68.7, 68.7]}, t.fixed)  # fmt: skip
    monkeypatch.setitem(R.TABLES, "fst-cbdg-table2", small)
    monkeypatch.setattr("fedfeat.partition._MAX_DRAWS", 50)
    md = R.reproduce("fst-cbdg-table2", store_root=tmp_path / "c", synthetic=True, seeds=1, rounds=1,
                     out=tmp_path / "r", log=lambda *a: None)  # fmt: skip
    assert "n/a (68.7)" not in md  # zero-shot does not depend on the partition: it is shown in every column
    assert "n/a in cifar10 a=0.05: dirichlet: no draw in 50 gave all 100 clients >= 10 samples" in md
