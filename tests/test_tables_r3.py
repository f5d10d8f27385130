"""Issue 37, the CLIP2FL and Fed-MP tables as their authors ran them, and honest labels:

* ``clip2fl-table1``'s rows are linear heads on frozen ViT-B/32 features, the paper's ResNet-8s from scratch: its
  TOML's ``reading`` says so in every output format (markdown / CSV header, JSON on every cell and in ``--list``),
  beside the stand-in flag; the paper's KD weight beta = 3.0 is printed beside the code's 1 that the row runs;
* its FedAvgM row runs CReFF's ``--init_belta 0.97`` (``options.py:37-38``), the method's default staying 0.9;
* ``fed-mp-table1``'s PromptFL / FedTPG rows run Fed-MP's App. A (AdamW, lr 1e-5, 2 local x 2 global epochs), and
  ``optimizer=adamw`` is torch.optim.AdamW in the prompt engine (against a torch loop on the tiny CLIP);
* every ``key=value`` switch docs/paper-code.md gives for a named method exists in that method's params.
"""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fedfeat.errors import FedfeatError
from fedfeat.methods import REGISTRY, get_method
from fedfeat.runs import reproduce as R

DOCS = Path(__file__).resolve().parents[1] / "docs" / "paper-code.md"
PAPERS = Path(__file__).resolve().parents[2] / "shared" / "papers"


def _render_clip2fl(fmt: str, synthetic: bool = True) -> str:
    """``clip2fl-table1`` rendered from made-up summaries (one seed per cell): the path ``reproduce`` prints."""
    t = R.TABLES["clip2fl-table1"]
    summaries, where = [], {}
    for r in range(len(t.rows)):
        for c in range(len(t.columns)):
            where[(r, c)] = [len(summaries)]
            summaries.append({"final_acc": 50.0 + r + c, "store": f"/s/{t.columns[c].dataset}.zarr"})
    return R.render(t, summaries, where, synthetic, fmt, rounds=1)


READING = "frozen-feature reading of ResNet-8 methods: linear head on ViT-B/32 features"


def test_clip2fl_table_declares_its_reading_in_the_toml():
    t = R.TABLES["clip2fl-table1"]
    assert t.reading.startswith(READING)
    for words in ("zero-shot init", "L2-normalised", "logit scale 1", "ResNet-8 models", "not comparison"):
        assert words in t.reading
    # the reading is what the rows' methods do at the params the table passes
    for row in t.rows:
        p = get_method(row.method, dict(row.params)).p
        assert (p.init, p.normalize, p.logit_scale) == ("text", True, 1.0), row.label
    # the other papers' tables run the paper's model class (or say n/a): no reading
    assert not R.TABLES["fst-cbdg-table1"].reading


def test_clip2fl_markdown_and_csv_carry_the_reading_the_stand_in_flag_and_the_kd_note():
    md = _render_clip2fl("markdown")
    head = md.split("\n\n")[0]
    assert head.startswith("SYNTHETIC STAND-IN, NOT A REPRODUCTION")
    assert "\nreading: " + READING in head
    note = next(x for x in head.splitlines() if x.startswith("note: "))
    assert "kd_alpha = 1" in note and "beta = 3.0" in note
    real = _render_clip2fl("markdown", synthetic=False).split("\n\n")[0]
    assert "\nreading: " + READING in real  # an encoded store: still not the paper's model

    text = _render_clip2fl("csv")
    got = [r for r in csv.reader(io.StringIO(text)) if r]
    comments = [",".join(r) for r in got if r[0].startswith("#")]
    data = [r for r in got if not r[0].startswith("#")]
    assert any(c.startswith("# reading: " + READING) for c in comments)
    assert any(c.startswith("# note: ") and "beta = 3.0" in c for c in comments)
    assert data[0][-1] == "source" and {r[-1] for r in data[1:]} == {"synthetic stand-in"}


def test_clip2fl_json_cells_and_list_carry_the_reading_and_the_stand_in_flag():
    cells = json.loads(_render_clip2fl("json"))
    assert len(cells) == 12 * 6
    for c in cells:
        assert c["reading"].startswith(READING)
        assert c["synthetic"] is True and c["source"] == "synthetic stand-in" and c["stand_in"] == "features"
    listed = json.loads(R.list_tables("json"))
    by = {t["name"]: t for t in listed}
    assert by["clip2fl-table1"]["reading"].startswith(READING)
    assert by["fed-mp-table1"]["reading"] is None


def test_clip2fl_fedavgm_row_runs_creffs_init_belta():
    """CReFF options.py:37-38 (``# FedAvgM``, ``--init_belta 0.97``; CLIP2FL's :61-62): the table's row; the method's
    default stays Hsu et al.'s 0.9."""
    t = R.TABLES["clip2fl-table1"]
    (row,) = [r for r in t.rows if r.method == "fedavgm"]
    assert get_method("fedavgm", dict(row.params)).p.server_momentum == pytest.approx(0.97)
    assert get_method("fedavgm", {}).p.server_momentum == pytest.approx(0.9)
    # the TOML names its source
    toml = (R.TABLES_DIR / "clip2fl.toml").read_text(encoding="utf-8")
    assert "options.py:37-38" in toml and "init_belta 0.97" in toml
    # the CLIP2FL row runs the code's KD weight (kd_alpha 1), the paper's 3.0 only printed
    (c2,) = [r for r in t.rows if r.method == "clip2fl"]
    assert get_method("clip2fl", dict(c2.params)).p.kd_alpha == 1.0


@pytest.mark.parametrize("name", ["fed-mp-table1", "fed-mp-table1-f1"])
def test_fed_mp_prompt_rows_run_appendix_a(name):
    """Fed-MP App. A: "all baseline methods that use CLIP ... learning rate is initialized as 1e-5 ... optimized via
    AdamW. The local training epoch is 2 and the global epoch is also 2"."""
    t = R.TABLES[name]
    rows = {r.method: r for r in t.rows if r.method in ("promptfl", "fedtpg")}
    assert set(rows) == {"promptfl", "fedtpg"}
    for method, row in rows.items():
        p = get_method(method, dict(row.params)).p
        assert p.optimizer == "adamw" and p.lr == pytest.approx(1e-5) and p.local_epochs == 2, method
        assert p.precision == "fp32", method
    assert t.fixed["rounds"] == 2
    # the methods' own defaults stay their codes' SGD
    assert get_method("promptfl", {}).p.optimizer == "sgd" and get_method("fedtpg", {}).p.optimizer == "sgd"
    toml = (R.TABLES_DIR / "fed_mp.toml").read_text(encoding="utf-8")
    assert "App. A" in toml and "optimized via" in toml
    paper = next(PAPERS.glob("002_*"), None)
    if paper is not None:  # the quoted sentence is the paper's
        assert "The models are optimized via AdamW" in paper.read_text(encoding="utf-8")


def test_adamw_refuses_what_it_cannot_run():
    with pytest.raises(FedfeatError, match="optimizer_state=fresh"):
        get_method("fedtpg", {"optimizer": "adamw"})
    with pytest.raises(FedfeatError):
        get_method("promptfl", {"optimizer": "adam"})  # only sgd | adamw


# ------------------------------------------------------------------ docs/paper-code.md's switches exist
def _doc_switches():
    """(line number, methods, key, value) for every `key=value` (alternatives `a\\|b`) in the default and switch
    columns of docs/paper-code.md's method tables whose first cell names registered methods."""
    out = []
    for n, line in enumerate(DOCS.read_text(encoding="utf-8").splitlines(), 1):
        if not line.startswith("| ") or line.startswith("|---"):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if len(cells) != 5 or cells[0] in ("method", "item"):
            continue
        names = [
            w for w in re.findall(r"[a-z0-9][a-z0-9-]*", re.sub(r"`[^`]*`", "", cells[0])) if w in REGISTRY
        ]
        if not names:
            continue
        for cell in cells[3:]:
            for span in re.findall(r"`([^`]*)`", cell):
                m = re.fullmatch(r"(?:--set )?([a-z_][a-z0-9_]*)=(\S+)", span)
                if m is None:
                    continue
                key, values = m.groups()
                for v in values.split("\\|"):
                    if not v or "..." in v or re.search(r"[A-Z]{3,}", v):  # a placeholder: PATH, NAME
                        continue
                    out.append((n, tuple(names), key, v))
    return out


def test_every_documented_switch_of_a_named_method_exists():
    switches = _doc_switches()
    assert len(switches) > 30  # the parser reads the tables (guards against a silently empty check)
    keys = {(k, v) for _, _, k, v in switches}
    for want in [("init", "zeros"), ("normalize", "false"), ("logit_scale", "100"), ("server_momentum", "0.97"),
                 ("kd_alpha", "3"), ("optimizer", "adamw")]:  # fmt: skip
        assert want in keys, want
    bad = []
    for n, names, key, value in switches:
        ok = []
        for name in names:
            try:
                get_method(name, {key: value})
                ok.append(name)
            except (FedfeatError, TypeError, ValueError):
                pass
        if not ok:  # a row naming several methods documents a switch of at least one of them
            bad.append(f"docs/paper-code.md:{n}: {key}={value} is no param of {', '.join(names)}")
    assert not bad, "\n".join(bad)


# ------------------------------------------------------------------ optimizer=adamw is torch's AdamW
@pytest.fixture(scope="module")
def live_data(tmp_path_factory):
    from helpers_clip import TINY_NAME, make_tiny_clip, run_cli, write_cifar10

    from fedfeat.encoders.live import load_live_text
    from fedfeat.engine.data import load_run_data
    from fedfeat.partition.make import make_partition
    from fedfeat.store.featurestore import FeatureStore

    tc = make_tiny_clip(tmp_path_factory.mktemp("tinyclip"))
    root = tmp_path_factory.mktemp("data")
    c10 = write_cifar10(root / "cifar-10-batches-py", n_train=60, n_test=20)
    out = tmp_path_factory.mktemp("cache")
    args = ["encode", "--dataset", "cifar10", "--root", c10.root, "--backbone", tc.config]
    args += ["--pretrained", tc.weights, "--out", out, "--device", "cpu", "--templates", "cifar"]
    r = run_cli(args)
    assert r.exit_code == 0, (r.output, r.exception)
    st = FeatureStore.open(out / "cifar10" / f"{TINY_NAME}-tiny.zarr")
    live = load_live_text(st)
    part = make_partition(st.labels("train"), "dirichlet", clients=3, alpha=0.5, seed=3)
    data = load_run_data(st, part)
    data.live = live
    return data


@pytest.mark.parametrize("state", ["fresh", "carried"])
def test_promptfl_adamw_is_torchs_adamw(live_data, state):
    """PromptFL with ``optimizer=adamw``: every client trains ``local_epochs`` one-batch epochs with torch.optim.AdamW
    (made per client per round, or one for every client: ``carried``), the server averages unweighted."""
    from fedfeat.encoders.prompt import PromptLearner
    from fedfeat.engine.rounds import run_federated

    data = live_data
    sets = {"n_ctx": "2", "local_epochs": "2", "batch_size": "64", "lr": "0.05", "weight_decay": "0.01",
            "optimizer": "adamw", "schedule": "constant", "precision": "fp32", "optimizer_state": state}  # fmt: skip
    p = get_method("promptfl", sets).p
    glob0 = run_federated(get_method("promptfl", sets), data, rounds=0, participation=1.0, seed=0)[0]["ctx"]
    learner = PromptLearner(data.live.tower, data.class_names, p.n_ctx)
    x = F.normalize(data.train_x.float(), dim=-1)
    off = data.offsets.tolist()
    ctx = torch.nn.Parameter(glob0.clone())
    make = lambda: torch.optim.AdamW([ctx], lr=p.lr, weight_decay=p.weight_decay)  # noqa: E731
    opt, glob = make(), glob0.clone()
    for _ in range(2):
        outs = []
        for i in range(len(off) - 1):
            xi, yi = x[off[i] : off[i + 1]], data.train_y[off[i] : off[i + 1]]
            if state == "fresh":
                opt = make()
            with torch.no_grad():
                ctx.copy_(glob)
            for _ in range(p.local_epochs):
                t = F.normalize(learner.features(ctx[None])[0], dim=-1)
                loss = F.cross_entropy(data.clip_logit_scale * xi @ t.T, yi)
                opt.zero_grad()
                loss.backward()
                opt.step()
            outs.append(ctx.detach().clone())
        glob = torch.stack(outs).mean(0)
    got = run_federated(get_method("promptfl", sets), data, rounds=2, participation=1.0, seed=0)[0]["ctx"]
    torch.testing.assert_close(got, glob, atol=1e-4, rtol=1e-4)
    sgd = run_federated(get_method("promptfl", sets | {"optimizer": "sgd"}), data, rounds=2, participation=1.0,
                        seed=0)[0]["ctx"]  # fmt: skip
    assert float((sgd - glob).abs().max()) > 1e-3  # another reading


def test_adamw_refuses_fp16(live_data):
    from fedfeat.engine.rounds import run_federated

    sets = {"n_ctx": "2", "local_epochs": "1", "optimizer": "adamw", "precision": "fp16"}
    with pytest.raises(FedfeatError, match="precision=fp32"):
        run_federated(get_method("promptfl", sets), live_data, rounds=1, participation=1.0, seed=0)


def test_every_table_file_names_its_paper_and_every_table_is_listed():
    """Each table TOML opens with a comment citing the paper it transcribes (../shared/papers/NNN_*, or the authors'
    repository at a commit where the paper's text is not there; the table or section) and every table it defines is in ``reproduce --list`` (issue 37: "each table TOML names its sources")."""
    import re
    from pathlib import Path

    from fedfeat.runs.reproduce import load_tables

    root = Path(__import__("fedfeat.runs", fromlist=["x"]).__file__).parent / "tables"
    listed = set(load_tables()[0])
    for f in sorted(root.glob("*.toml")):
        text = f.read_text(encoding="utf-8")
        header = "\n".join(ln for ln in text.splitlines()[:12] if ln.startswith("#"))
        # the paper's text (../shared/papers), or where the paper is not there, the authors' repository at a commit
        # (or, for fedfeat's own tables, "No paper:" and what the table is)
        cited = r"\.\./shared/papers/00\d_|[\w.-]+/[\w.-]+ @ [0-9a-f]{7}|^# No paper: "
        assert re.search(cited, header, flags=re.M), (
            f"{f.name}: no paper (or authors' repository at a commit) cited in its header"
        )
        assert re.search(r"Table \d|table|Ablation|§\d", header), f"{f.name}: no table or section named"
        names = re.findall(r'^name = "([^"]+)"', text, flags=re.M)
        assert names and set(names) <= listed, (f.name, set(names) - listed)
