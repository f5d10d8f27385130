"""Paper tables: ``fedfeat reproduce NAME`` runs a paper's grid (datasets x partitions x methods x seeds) in one
process (``fedfeat.runs.sweep``) and prints it in the paper's layout, ours (mean ± std over seeds) beside the paper's.

Stores come from ``--store-root``: ``ROOT/<dataset>/<backbone>-*.zarr`` as ``fedfeat encode`` (and the
``make cache-...`` targets) write them; a missing one is named with the target that builds it. ``--synthetic``
builds stand-in stores instead (``fedfeat synth``, shaped like each dataset under the paper's backbone), so that
the grid runs anywhere -- and its numbers then say nothing about real data.

Tables (the paper's numbers are transcribed from ``../shared/papers``; the settings are the papers' and
``reference-notes.md``'s):

* ``fst-cbdg-table1`` -- FST-CBDG Table 1: IID, 100 clients, 10 % per round, 10 rounds, RN50; CLIP-ZS,
  CLIP-FC-Centralized, FedAvg, FedNTD, FST-CBDG on CIFAR-10 / CIFAR-100 / CINIC-10.
* ``fst-cbdg-table2`` -- Table 2: sharding (s = 2, 3, 5, 10 on CIFAR-10; 10 on CIFAR-100; 2 on CINIC-10) and
  LDA (alpha = 0.05, 0.1, 0.3, 0.5 on CIFAR-10; 0.1 on CIFAR-100 and CINIC-10); FedAvg, FedNTD, FST-CBDG, with
  CLIP-ZS and centralized once per dataset (they do not depend on the partition).
* ``fst-cbdg-table3`` -- Table 3, ablations (self-training only, sampling only, sampling centralized, both) on
  CIFAR-10 (s = 2, IID) and CIFAR-100 (s = 10, IID).
* ``fst-cbdg-table4`` -- Table 4, equal vs class-balanced sampling on CIFAR-10 and CIFAR-100 (s = 10, IID).
* ``clip2fl-table1`` -- CLIP2FL Table 1 (ours: the methods fedfeat has): FedAvg, FedAvgM, FedProx, CReFF, CLIP2FL on
  CIFAR-10-LT / CIFAR-100-LT at IF = 100, 50, 10; 20 clients, 40 % per round, Dirichlet-equal alpha = 0.5,
  ViT-B/32; the paper's 200 rounds (``--rounds`` for fewer: CReFF's server costs ~1 s a round on a CPU).
* ``fed-mp-table1`` -- Fed-MP Table 1, novel-class accuracy (open vocabulary: ``fedfeat.partition.openvocab``'s presets,
  disjoint classes, 10 clients x 10 shots, all clients, 2 rounds, ViT-L/14@336), in the paper's layout (datasets
  as rows, methods as columns, an Average row); ``fed-mp-table1-f1`` the same runs' novel macro-F1 (the table's
  Phi_F1 rows). FedAvg (NN) / FedKA (NN) fine-tune a ResNet-18 end to end: not fedfeat methods, shown n/a beside
  the paper's numbers; CLIP zero-shot is added (not in the paper).
* ``fedcopl-table1`` -- FedCoPL's main table (Dirichlet beta = 0.1 label shift, ViT-B/32): mean local test
  accuracy (``local_acc``, ``--partition dirichlet-joint --local-test joint``), 20 rounds, all clients, 10
  clients (5 for CUB and UCF101, reference-notes), DTD / RESISC45 / CUB / UCF101 / CIFAR-10 / CIFAR-100 and Avg.
  pFedPrompt + CPL and FedOPT + CPL are not in fedfeat (n/a); PromptFL + CPL and CoPL + linear head (fedfeat's
  cached-feature path) are added (not in the paper).

A table reports its ``metric`` (a key of the runs' ``summary.json``: ``final_acc``, ``local_acc``,
``novel_f1`` ...), named in its header. A cell that cannot run is ``n/a`` with the reason printed under the table,
never a crash: a partition the partitioner cannot draw (``drawable``); a row fedfeat does not have; a prompt
method (``needs_live_text``: ``promptfl``, ``fedtpg``, ``fedcopl``) on a store without a live encoder (every
``--synthetic`` stand-in: its backbone is "synthetic") or whose encoder cannot be rebuilt here (weights not
cached); ``fedcopl`` on a store without pixels (``encode --pixels``); a run its method refuses (FedTPG in the
open-vocabulary setting).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fedfeat.errors import FedfeatError


@dataclass(frozen=True)
class Column:
    dataset: str
    label: str
    settings: dict  # partition settings of this column


@dataclass(frozen=True)
class Row:
    label: str
    method: str | None  # None: a method of the paper's that fedfeat does not have (``why`` says so)
    params: dict = field(default_factory=dict)
    once_per_dataset: bool = (
        False  # partition-free (zero-shot, centralized): one run per dataset, shown per column
    )
    settings: dict = field(default_factory=dict)  # run settings of this row (e.g. centralized-by-one-client)
    why: str = ""  # method None: why the row is n/a
    per_dataset: Callable[[str], dict] | None = None  # dataset -> extra params (CPL's per-dataset quantiles)


@dataclass(frozen=True)
class Table:
    name: str
    title: str
    backbone: str  # the stores' backbone (file name prefix) and the synthetic stand-in's shape
    make_target: str  # how a missing store is built: a make target, or a command with {dataset} / {root}
    columns: list[Column]
    rows: list[Row]
    paper: dict[str, list[float | None]]  # row label -> the paper's value per column, as the paper prints it
    fixed: dict  # run settings shared by every run
    metric: str = "final_acc"  # the summary.json key the table reports
    metric_label: str = "final accuracy (%)"
    paper_scale: float = 1.0  # paper's number x this = ours' unit (Fed-MP prints fractions: 100)
    paper_std: dict[str, list[float | None]] | None = None  # the paper's ± per cell, where it prints one
    paper_avg: dict[str, float | None] | None = None  # an "Avg." over the columns: the paper's per row
    transpose: bool = False  # the paper's layout has datasets as rows, methods as columns
    paper_format: str = ""  # format spec of the paper's numbers as shown ("" : as transcribed, 74.0)
    runs: str | None = None  # the runs' folder name (tables over the same runs share it); default: name


# synthetic stand-ins: (classes, train per class, test per class, dim)
SYNTH_SHAPES = {
    ("cifar10", "RN50"): dict(classes=10, train_per_class=5000, test_per_class=1000, dim=1024),
    ("cifar100", "RN50"): dict(classes=100, train_per_class=500, test_per_class=100, dim=1024, s=0.1),
    # CINIC-10 has 90,000 train and 90,000 test images; the stand-in keeps the train split and 10,000 test images
    ("cinic10", "RN50"): dict(classes=10, train_per_class=9000, test_per_class=1000, dim=1024),
    ("cifar10", "ViT-B-32"): dict(classes=10, train_per_class=5000, test_per_class=1000, dim=512),
    ("cifar100", "ViT-B-32"): dict(classes=100, train_per_class=500, test_per_class=100, dim=512, s=0.1),
    # FedCoPL's other datasets (CPL's splits, train (+ val) as the unlabelled train split; sizes approximate)
    ("dtd", "ViT-B-32"): dict(classes=47, train_per_class=80, test_per_class=40, dim=512, s=0.15),
    ("resisc45", "ViT-B-32"): dict(classes=45, train_per_class=560, test_per_class=140, dim=512, s=0.15),
    ("cub", "ViT-B-32"): dict(classes=200, train_per_class=30, test_per_class=29, dim=512, s=0.1),
    ("ucf101", "ViT-B-32"): dict(classes=101, train_per_class=76, test_per_class=37, dim=512, s=0.1),
}
# Fed-MP's six datasets under ViT-L/14@336 (D = 768): `fedfeat synth --preset caltech101-vitl14`'s parameters
# (20 train + 30 test images per class: 10 shots per client class, the rest for the query set) at each
# openvocab preset's class count, which ``--preset`` checks
for _ds, _k in (("caltech101", 102), ("ucf101", 101), ("food101", 101), ("flowers102", 102),
                ("fgvc-aircraft", 70), ("stanford-cars", 196)):  # fmt: skip
    SYNTH_SHAPES[(_ds, "ViT-L-14-336")] = dict(
        classes=_k, train_per_class=20, test_per_class=30, dim=768, templates=1, s=0.1, eta=0.7
    )

FST = {"clients": 100, "participation": 0.1, "rounds": 10}
_ZS = Row("CLIP-ZS", "zeroshot", once_per_dataset=True)
_CENT = Row("CLIP-FC-Centralized", "centralized", once_per_dataset=True)
_FST_ROWS = [Row("FedAvg", "fedavg"), Row("FedNTD", "fedntd"), Row("FST-CBDG", "fst-cbdg")]


def _shard(ds: str, s: int) -> Column:
    return Column(ds, f"{ds} s={s}", {"partition": "shard", "shards": s})


def _lda(ds: str, a: float) -> Column:
    return Column(ds, f"{ds} a={a}", {"partition": "dirichlet", "alpha": a})


def _iid(ds: str) -> Column:
    return Column(ds, f"{ds} iid", {"partition": "iid"})


def _lt(ds: str, f: int) -> Column:
    return Column(
        ds, f"{ds}-LT IF={f}", {"partition": "dirichlet-equal", "alpha": 0.5, "imbalance_factor": f}
    )


TABLES: dict[str, Table] = {
    "fst-cbdg-table1": Table(
        "fst-cbdg-table1",
        "FST-CBDG Table 1: test accuracy (%), homogeneous (IID) partition",
        "RN50",
        "make cache-fst-cbdg",
        [_iid("cifar10"), _iid("cifar100"), _iid("cinic10")],
        [_ZS, _CENT, *_FST_ROWS],
        {
            "CLIP-ZS": [68.7, 39.0, 63.2],
            "CLIP-FC-Centralized": [77.5, 42.9, 70.4],
            "FedAvg": [73.3, 37.8, 66.0],
            "FedNTD": [72.8, 39.8, 66.2],
            "FST-CBDG": [74.0, 43.2, 66.3],
        },
        FST,
    ),  # fmt: skip
    "fst-cbdg-table2": Table(
        "fst-cbdg-table2",
        "FST-CBDG Table 2: test accuracy (%), heterogeneous partitions (sharding s, LDA alpha)",
        "RN50",
        "make cache-fst-cbdg",
        [
            _shard("cifar10", 2),
            _shard("cifar10", 3),
            _shard("cifar10", 5),
            _shard("cifar10", 10),
            _shard("cifar100", 10),
            _shard("cinic10", 2),
            _lda("cifar10", 0.05),
            _lda("cifar10", 0.1),
            _lda("cifar10", 0.3),
            _lda("cifar10", 0.5),
            _lda("cifar100", 0.1),
            _lda("cinic10", 0.1),
        ],
        [_ZS, _CENT, *_FST_ROWS],
        {
            "CLIP-ZS": [68.7] * 4 + [39.0, 63.2] + [68.7] * 4 + [39.0, 63.2],
            "CLIP-FC-Centralized": [77.5] * 4 + [42.9, 70.4] + [77.5] * 4 + [42.9, 70.4],
            "FedAvg": [32.3, 42.0, 43.5, 47.7, 34.1, 30.9, 20.1, 32.4, 41.9, 45.1, 16.4, 29.1],
            "FedNTD": [42.0, 64.1, 47.6, 55.6, 26.6, 35.8, 26.6, 28.2, 37.1, 52.9, 15.9, 26.6],
            "FST-CBDG": [72.0, 72.8, 73.6, 73.2, 43.3, 65.9, 71.5, 71.9, 72.2, 72.4, 43.1, 65.0],
        },
        FST,
    ),  # fmt: skip
    "fst-cbdg-table3": Table(
        "fst-cbdg-table3",
        "FST-CBDG Table 3: ablation of the two losses, test accuracy (%)",
        "RN50",
        "make cache-fst-cbdg",
        [_shard("cifar10", 2), _iid("cifar10"), _shard("cifar100", 10), _iid("cifar100")],
        [
            _ZS,
            Row("L_iST", "fst-cbdg", {"sampling": "false"}),
            Row("L_tSamp", "fst-cbdg", {"self_training": "false"}),
            Row(
                "L_tSamp (Centralized)",
                "fst-cbdg",
                {"self_training": "false"},
                once_per_dataset=True,
                settings={"clients": 1, "participation": 1.0, "partition": "iid"},
            ),
            Row("L_iST + L_tSamp", "fst-cbdg"),
        ],
        {
            "CLIP-ZS": [68.7, 68.7, 39.0, 39.0],
            "L_iST": [68.9, 68.2, 37.5, 37.5],
            "L_tSamp": [68.9, 65.7, 37.3, 35.5],
            "L_tSamp (Centralized)": [69.4, 69.4, 39.1, 39.1],
            "L_iST + L_tSamp": [72.0, 74.0, 43.3, 43.2],
        },
        FST,
    ),  # fmt: skip
    "fst-cbdg-table4": Table(
        "fst-cbdg-table4",
        "FST-CBDG Table 4: sampling strategy, test accuracy (%)",
        "RN50",
        "make cache-fst-cbdg",
        [_shard("cifar10", 10), _iid("cifar10"), _shard("cifar100", 10), _iid("cifar100")],
        [Row("Equal sampling", "fst-cbdg", {"balance": "equal"}), Row("Balanced sampling", "fst-cbdg")],
        {"Equal sampling": [68.6, 68.6, 37.4, 37.4], "Balanced sampling": [73.2, 74.0, 43.3, 43.2]},
        FST,
    ),  # fmt: skip
    "clip2fl-table1": Table(
        "clip2fl-table1",
        "CLIP2FL Table 1: top-1 accuracy (%), long-tailed CIFAR (the rows fedfeat implements)",
        "ViT-B-32",
        "make cache-clip2fl",
        [
            _lt("cifar10", 100),
            _lt("cifar10", 50),
            _lt("cifar10", 10),
            _lt("cifar100", 100),
            _lt("cifar100", 50),
            _lt("cifar100", 10),
        ],
        [
            Row(
                "FedAvg",
                "fedavg",
                {"local_epochs": "10", "batch_size": "32", "lr": "0.1", "momentum": "0", "weight_decay": "0"},
            ),
            Row("FedAvgM", "fedavgm"),
            Row("FedProx", "fedprox"),
            Row("CReFF", "creff"),
            Row("CLIP2FL", "clip2fl"),
        ],
        {
            "FedAvg": [56.17, 59.36, 77.45, 30.34, 36.35, 45.87],
            "FedAvgM": [52.03, 57.11, 70.81, 30.80, 35.33, 44.66],
            "FedProx": [56.92, 60.89, 76.53, 31.67, 36.30, 46.10],
            "CReFF": [70.55, 73.08, 80.71, 34.67, 37.64, 47.08],
            "CLIP2FL": [73.37, 75.35, 81.18, 37.56, 41.29, 48.20],
        },
        {"clients": 20, "participation": 0.4, "rounds": 200},
    ),  # fmt: skip
}

# ---- Fed-MP (Zeng et al., NAACL 2024) Table 1: open-vocabulary classification, 6 datasets x 6 methods, 5 seeds.
# The paper prints fractions (0.9936), mean ± std over its 5 repetitions; transcribed as printed
# (../shared/papers/002_*, the table's A and Phi_F1 rows; the A rows agree with reference-notes' copy).
_FEDMP_COLS = [
    Column(ds, label, {"preset": ds})
    for ds, label in (("caltech101", "Caltech101"), ("ucf101", "UCF101"), ("food101", "Food101"),
                      ("flowers102", "Flower102"), ("fgvc-aircraft", "FGVC"), ("stanford-cars", "StanfordCars"))
]  # fmt: skip
_NN = ("an ImageNet ResNet-18 fine-tuned end to end, then K-means + linear assignment to the novel classes "
       "(Fed-MP App. A): not a method on frozen CLIP features, not in fedfeat")  # fmt: skip
_FEDMP_ROWS = [
    Row("CLIP-ZS (not in the paper)", "zeroshot"),
    Row("FedAvg (NN)", None, why=_NN),
    Row("FedKA (NN)", None, why=_NN),
    Row("PromptFL", "promptfl"),
    Row("FedTPG", "fedtpg"),
    Row("FedCLIP", "fedclip"),
    Row("Fed-MP", "fed-mp"),
]
# Fed-MP's setting (§5.1, App. A; fedfeat.partition.openvocab.PRESET_RUN, which ``preset`` applies with the dataset's
# client seeds): 10 clients, all of them every round, 2 rounds, 10 shots per class (8 train + 2 validation)
_FEDMP = {"partition": "disjoint-classes", "shots": 10, "clients": 10, "participation": 1.0, "rounds": 2}
_FEDMP_BUILD = (
    "fedfeat encode --dataset imagefolder --root ~/data/{dataset} --name {dataset} --backbone ViT-L-14-336 "
    "--pretrained openai --templates 'A photo of {{}}.' --out {root}` (the images as an imagefolder or listfile "
    "tree, class names as `fedfeat.partition.openvocab.PRESETS` says; there is no make target for Fed-MP's datasets)"
)

TABLES["fed-mp-table1"] = Table(
    "fed-mp-table1",
    "Fed-MP Table 1: open-vocabulary classification, accuracy A on the novel classes (ViT-L/14@336, 10 clients "
    "with disjoint classes x 10 shots, 2 rounds)",
    "ViT-L-14-336",
    _FEDMP_BUILD,
    _FEDMP_COLS,
    _FEDMP_ROWS,
    {
        "FedAvg (NN)": [.5090, .6491, .5521, .6365, .3369, .2844],
        "FedKA (NN)": [.5652, .6465, .5474, .7462, .3476, .2842],
        "PromptFL": [.9920, .8582, .9240, .8628, .7682, .9635],
        "FedTPG": [.9909, .8473, .9257, .9025, .7661, .9519],
        "FedCLIP": [.9185, .8855, .9719, .8829, .7841, .9590],
        "Fed-MP": [.9936, .9127, .9828, .9098, .8082, .9721],
    },
    _FEDMP,
    metric="final_acc",
    metric_label="novel-class accuracy (%; final_acc of an open-vocabulary run)",
    paper_scale=100.0,
    paper_std={
        "FedAvg (NN)": [.0627, .0869, .0055, .0421, .0182, .0076],
        "FedKA (NN)": [.0526, .0312, .0046, .0258, .0216, .0123],
        "PromptFL": [.0015, .0093, .0203, .0826, .0193, .0063],
        "FedTPG": [.0037, .0424, .0359, .0394, .0065, .0164],
        "FedCLIP": [.0285, .0178, .0008, .0215, .0089, .0025],
        "Fed-MP": [.0010, .0225, .0005, .0251, .0199, .0032],
    },
    paper_avg={"FedAvg (NN)": .4947, "FedKA (NN)": .5245, "PromptFL": .8948, "FedTPG": .8974, "FedCLIP": .9003,
               "Fed-MP": .9299},
    transpose=True,
    paper_format=".2f",
    runs="fed-mp-table1",
)  # fmt: skip
TABLES["fed-mp-table1-f1"] = Table(
    "fed-mp-table1-f1",
    "Fed-MP Table 1: open-vocabulary classification, macro-F1 Phi_F1 over the novel classes (the runs of "
    "fed-mp-table1)",
    "ViT-L-14-336",
    _FEDMP_BUILD,
    _FEDMP_COLS,
    _FEDMP_ROWS,
    {
        "FedAvg (NN)": [.6071, .6318, .5655, .6421, .3338, .2861],
        "FedKA (NN)": [.6472, .6404, .5624, .7902, .3480, .2833],
        "PromptFL": [.9784, .8318, .9162, .8872, .7063, .9619],
        "FedTPG": [.9741, .8185, .9124, .8883, .7328, .9505],
        "FedCLIP": [.9106, .8760, .9721, .8696, .7408, .9586],
        "Fed-MP": [.9876, .9086, .9828, .9132, .7842, .9720],
    },
    _FEDMP,
    metric="novel_f1",
    metric_label="novel-class macro-F1 (%; sklearn's macro definition, novel_f1)",
    paper_scale=100.0,
    paper_std={
        "FedAvg (NN)": [.0047, .0921, .0054, .0435, .0185, .0090],
        "FedKA (NN)": [.0522, .0385, .0044, .0361, .0228, .0092],
        "PromptFL": [.0047, .0093, .0260, .0485, .0224, .0076],
        "FedTPG": [.0122, .0576, .0463, .0525, .0093, .0172],
        "FedCLIP": [.0213, .0229, .0008, .0135, .0134, .0025],
        "Fed-MP": [.0020, .0298, .0005, .0253, .0336, .0032],
    },
    paper_avg={"FedAvg (NN)": .5111, "FedKA (NN)": .5452, "PromptFL": .8803, "FedTPG": .8794, "FedCLIP": .8880,
               "Fed-MP": .9247},
    transpose=True,
    paper_format=".2f",
    runs="fed-mp-table1",
)  # fmt: skip


# ---- FedCoPL (Guo et al., ICCV 2025) main table: Dirichlet beta = 0.1 label shift, ViT-B/32, mean local test
# accuracy (%), transcribed from ../shared/papers/003_* (the paper's summary; no ± printed there).
def _cpl_params(dataset: str) -> dict:
    """CPL's per-dataset quantiles (``fedfeat.methods.pseudolabel.CPL_DEFAULTS``; CPL_GENERAL for CIFAR and UCF101)."""
    from fedfeat.methods.pseudolabel import cpl_preset

    q, t = cpl_preset(dataset)
    return {"conf_quantile": str(q), "regular_threshold": str(t)}


def _copl_col(ds: str, label: str, clients: int) -> Column:
    return Column(ds, label, {"partition": "dirichlet-joint", "alpha": 0.1, "local_test": "joint",
                              "clients": clients})  # fmt: skip


_NOT_FEDFEAT = "{} is not in fedfeat (its nearest here: PromptFL + CPL)"
TABLES["fedcopl-table1"] = Table(
    "fedcopl-table1",
    "FedCoPL main table: Dirichlet label shift (beta = 0.1), ViT-B/32, mean local test accuracy (%)",
    "ViT-B-32",
    "fedfeat encode --dataset {format} --root {data} --name {dataset} --backbone ViT-B-32 --pretrained openai "
    "--templates 'a photo of a {{}}' --pixels --out {root}` (--pixels: fedcopl re-encodes images; there is no "
    "make target for FedCoPL's datasets)",
    [_copl_col("dtd", "DTD", 10), _copl_col("resisc45", "RESISC45", 10), _copl_col("cub", "CUB", 5),
     _copl_col("ucf101", "UCF101", 5), _copl_col("cifar10", "CIFAR10", 10), _copl_col("cifar100", "CIFAR100", 10)],
    [
        Row("CLIP Zero-shot", "zeroshot"),
        Row("PromptFL + FPL", "promptfl", {"pseudo": "fpl"}),
        Row("pFedPrompt + CPL", None, why=_NOT_FEDFEAT.format("pFedPrompt")),
        Row("FedOPT + CPL", None, why=_NOT_FEDFEAT.format("FedOPT")),
        Row("PromptFL + CPL (not in the paper)", "promptfl", {"pseudo": "cpl"}, per_dataset=_cpl_params),
        Row("FedCoPL", "fedcopl"),
        Row("CoPL + linear head (not in the paper)", "copl-linear"),
    ],
    {
        "CLIP Zero-shot": [43.24, 54.51, 51.28, 61.00, 86.93, 64.17],
        "PromptFL + FPL": [45.79, 59.76, 47.29, 64.39, 87.51, 63.26],
        "pFedPrompt + CPL": [44.22, 61.76, 47.23, 65.59, 90.26, 65.63],
        "FedOPT + CPL": [37.43, 51.10, 46.61, 58.93, 91.08, 57.87],
        "FedCoPL": [60.89, 75.76, 56.09, 73.20, 95.38, 73.59],
    },
    {"participation": 1.0, "rounds": 20},
    metric="local_acc",
    metric_label="mean local test accuracy (%; local_acc, each client's own test split)",
    paper_avg={"CLIP Zero-shot": 60.19, "PromptFL + FPL": 61.33, "pFedPrompt + CPL": 62.45, "FedOPT + CPL": 57.17,
               "FedCoPL": 72.49},
    paper_format=".2f",
)  # fmt: skip

# where `fedfeat encode` reads a dataset for the encode commands above: (format, folder); others: listfile, ~/data/NAME
_DATA = {
    "cifar10": ("cifar10", "~/data/cifar-10-batches-py"),
    "cifar100": ("cifar100", "~/data/cifar-100-python"),
}


def build_hint(table: Table, dataset: str, root: Path) -> str:
    """How to build ``table``'s store of ``dataset``: its make target, or the ``fedfeat encode`` command."""
    if table.make_target.startswith("make "):
        return f"`{table.make_target}` (datasets under DATA=~/data)"
    fmt, data = _DATA.get(dataset, ("listfile", f"~/data/{dataset}"))
    return "`" + table.make_target.format(dataset=dataset, root=root, format=fmt, data=data)


def find_store(root: Path, dataset: str, backbone: str, table: Table, synthetic: bool, log) -> Path:
    """The store of ``dataset`` under ``root``: a stand-in built on first use (``synthetic``), else the encoded
    one; a missing store is a one-line error naming the make target that builds it."""
    if synthetic:
        from fedfeat.store.featurestore import is_store
        from fedfeat.store.synth import SynthParams, write_synthetic_store

        path = root / f"synth-{dataset}-{backbone.lower()}.zarr"
        if not is_store(path):
            log(f"building the synthetic stand-in {path} (its numbers say nothing about real {dataset})")
            write_synthetic_store(path, SynthParams(**SYNTH_SHAPES[(dataset, backbone)]), stats=False,
                                  log=lambda *a: None)  # fmt: skip
        return path
    found = sorted((root / dataset).glob(f"{backbone}*.zarr")) if (root / dataset).is_dir() else []
    if not found:
        raise FedfeatError(
            f"no {backbone} store of {dataset} under {root}/{dataset}/; build it with "
            f"{build_hint(table, dataset, root)}, pass --store-root, or run with --synthetic"
        )
    return found[0]


def drawable(table: Table, stores: dict[str, Path]) -> dict[int, str]:
    """Columns whose partition cannot be drawn on their store, with the partitioner's reason (FedNTD's Dirichlet
    rule never gives 100 clients >= 10 samples each at alpha = 0.05 on 10 classes: its code loops forever)."""
    from fedfeat.runs.session import open_store, run_partition
    from fedfeat.runs.config import resolve_config

    bad = {}
    for c, col in enumerate(table.columns):
        cfg = resolve_config({**table.fixed, **col.settings, "store": str(stores[col.dataset])}, None, None)
        try:  # inside the sweep's session: the partition is computed once, here, and reused by its runs
            run_partition(open_store(cfg), cfg, False)
        except FedfeatError as e:
            bad[c] = str(e)
    return bad


def _needs(method: str) -> tuple[bool, bool]:
    """(live text encoder, pixels) that ``method``'s runs need of their store."""
    from fedfeat.methods import REGISTRY

    cls = REGISTRY.get(method)
    if cls is None:
        raise FedfeatError(f"table row method '{method}' is not registered; known: {', '.join(REGISTRY)}")
    live = bool(getattr(cls, "needs_live_text", False))
    pixels = bool(getattr(cls, "needs_pixels", "pixels" in str(getattr(cls, "runs_on", ""))))
    return live, pixels


def runnable(table: Table, stores: dict[str, Path], skip=()) -> dict[tuple[int, int], str]:
    """Cells ``(row, column)`` that cannot run, with the reason, found before any run: a row whose method fedfeat
    does not have; a prompt method (``needs_live_text``) on a store without a live encoder (a synthetic stand-in)
    or whose encoder cannot be rebuilt here (loaded now, inside the sweep's session, and reused by the runs); a
    method that re-encodes images (``fedcopl``) on a store without pixels. Columns in ``skip`` are left out."""
    from fedfeat.engine.rounds import resolve_device
    from fedfeat.runs.session import _live_text, open_store
    from fedfeat.runs.config import resolve_config

    out: dict[tuple[int, int], str] = {}
    for r, row in enumerate(table.rows):
        if row.method is None:
            out.update({(r, c): row.why for c in range(len(table.columns))})
            continue
        live, pixels = _needs(row.method)
        if not (live or pixels):
            continue
        for c, col in enumerate(table.columns):
            if c in skip:
                continue
            cfg = resolve_config({**table.fixed, **col.settings, **row.settings, "method": row.method,
                                  "store": str(stores[col.dataset])}, None, None)  # fmt: skip
            st = open_store(cfg)
            need = ["the store's live text encoder (a real backbone and its weights)"] if live else []
            if pixels and not st.has_pixels:
                need.append("the images' pixels (`fedfeat encode ... --pixels`)")
            if st.attrs.get("backbone") in (None, "synthetic"):
                has = "neither" if len(need) > 1 else "none"
                out[(r, c)] = (
                    f"{row.method} needs {' and '.join(need)}; a synthetic stand-in store has {has} (encode "
                    "the dataset with `fedfeat encode`)"
                )
            elif pixels and not st.has_pixels:
                out[(r, c)] = (
                    f"{row.method} re-encodes images: its store needs pixels; re-encode it with --pixels"
                )
            elif live:
                try:
                    _live_text(st, cfg, resolve_device(cfg.device))
                except FedfeatError as e:
                    out[(r, c)] = str(e)
    return out


def points(
    table: Table,
    stores: dict[str, Path],
    seeds: list[int],
    out: Path,
    rounds: int | None,
    skip=(),
    blocked=(),
) -> tuple[list, dict]:
    """The sweep points of ``table`` and, per (row, column), the indices of its points (one per seed); columns in
    ``skip`` and cells in ``blocked`` get none."""
    pts, where = [], {}
    fixed = dict(table.fixed)
    if rounds is not None:
        fixed["rounds"] = rounds
    fixed["eval_every"] = fixed[
        "rounds"
    ]  # the tables report final metrics: evaluate at rounds 0 and last only
    for r, row in enumerate(table.rows):
        done_ds: dict[str, list[int]] = {}
        for c, col in enumerate(table.columns):
            if (c in skip and not row.once_per_dataset) or (r, c) in blocked:
                where[(r, c)] = []
                continue
            if row.once_per_dataset and col.dataset in done_ds:
                where[(r, c)] = done_ds[col.dataset]
                continue
            params = {**row.params, **(row.per_dataset(col.dataset) if row.per_dataset else {})}
            idx = []
            for s in seeds:
                settings = {**fixed, **col.settings, **row.settings, "method": row.method, "seed": s,
                            "store": str(stores[col.dataset]), "out": str(out)}  # fmt: skip
                if row.once_per_dataset and "partition" not in row.settings:
                    settings.update({"partition": "iid", "alpha": None, "shards": None})
                    settings.pop("imbalance_factor", None)
                settings = {k: v for k, v in settings.items() if v is not None}
                idx.append(len(pts))
                pts.append((settings, dict(params)))
            where[(r, c)] = idx
            if row.once_per_dataset:
                done_ds[col.dataset] = idx
    return pts, where


def _paper(table: Table, label: str, c: int, avg: bool = False) -> tuple[float | None, float | None]:
    """The paper's (value, ± std) of a cell in ours' unit (``paper_scale``); None where it prints none."""
    k = table.paper_scale
    if avg:
        p = (table.paper_avg or {}).get(label)
        return (None if p is None else round(p * k, 10)), None
    p = table.paper.get(label, [None] * len(table.columns))[c]
    sd = (table.paper_std or {}).get(label, [None] * len(table.columns))[c]
    return (None if p is None else round(p * k, 10)), (None if sd is None else round(sd * k, 10))


def render(
    table: Table,
    summaries: list,
    where: dict,
    synthetic: bool,
    fmt: str = "markdown",
    skipped=None,
    blocked=None,
) -> str:
    """The paper's layout: rows = methods, columns = settings (transposed where the paper has datasets as rows);
    a cell = ours (the table's metric: mean ± std (n) over seeds) and the paper's number beside it. ``summaries``
    holds None for a run that was not made."""
    import json

    from fedfeat.report.tables import _table

    skipped, blocked = skipped or {}, dict(blocked or {})
    ncol = len(table.columns)
    cells = {}
    for (r, c), idx in where.items():
        recs = [summaries[i] for i in idx if summaries[i] is not None]
        got = [x.get(table.metric) for x in recs]
        v = np.array([g for g in got if g is not None], dtype=np.float64)
        if recs and not len(v) and (r, c) not in blocked:
            blocked[(r, c)] = f"its runs record no {table.metric} (a metric of another setting?)"
        cells[(r, c)] = (
            (float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else None, len(v))
            if len(v)
            else (None, None, 0)
        )
    avg = {}
    if table.paper_avg is not None:  # ours: the mean of the row's column means, where every column has one
        for r in range(len(table.rows)):
            ms = [cells[(r, c)][0] for c in range(ncol)]
            avg[r] = float(np.mean(ms)) if all(m is not None for m in ms) else None
    if fmt == "json":
        out = []
        for r, row in enumerate(table.rows):
            for c, col in enumerate(table.columns):
                p, ps = _paper(table, row.label, c)
                m, s, n = cells[(r, c)]
                why = blocked.get((r, c)) or (skipped.get(c) if m is None else None)
                out.append({"row": row.label, "column": col.label, "metric": table.metric, "mean": m, "std": s,
                            "n": n, "paper": p, "paper_std": ps, "why": why})  # fmt: skip
            if table.paper_avg is not None:
                out.append({"row": row.label, "column": "Avg.", "metric": table.metric, "mean": avg[r],
                            "std": None, "n": ncol, "paper": _paper(table, row.label, 0, avg=True)[0],
                            "paper_std": None, "why": None})  # fmt: skip
        return json.dumps(out, indent=1)

    def num(x: float) -> str:
        return format(x, table.paper_format) if table.paper_format else str(x)

    def cell(r: int, c: int) -> str:
        m, s, _ = cells[(r, c)]
        p, ps = _paper(table, table.rows[r].label, c)
        ours = "n/a" if m is None else f"{m:.2f} ± {s:.2f}" if s is not None else f"{m:.2f}"
        if p is None:
            return ours
        return f"{ours} ({num(p)} ± {num(ps)})" if ps is not None else f"{ours} ({num(p)})"

    def avg_cell(r: int) -> str:
        p = _paper(table, table.rows[r].label, 0, avg=True)[0]
        ours = "-" if avg[r] is None else f"{avg[r]:.2f}"
        return f"{ours} ({num(p)})" if p is not None else ours

    if table.transpose:  # datasets as rows, methods as columns (Fed-MP's Table 1)
        cols = ["dataset"] + [row.label for row in table.rows]
        rows = [
            [col.label] + [cell(r, c) for r in range(len(table.rows))] for c, col in enumerate(table.columns)
        ]
        if table.paper_avg is not None:
            rows.append(["Average"] + [avg_cell(r) for r in range(len(table.rows))])
    else:
        cols = (
            ["method"] + [c.label for c in table.columns] + (["Avg."] if table.paper_avg is not None else [])
        )
        rows = [[row.label] + [cell(r, c) for c in range(ncol)] + ([avg_cell(r)] if table.paper_avg is not None
                else []) for r, row in enumerate(table.rows)]  # fmt: skip
    n = max((x[2] for x in cells.values()), default=0)
    head = (
        f"{table.title}\nmetric: {table.metric_label} [summary.json: {table.metric}]; ours: mean ± std over {n} "
        "seed(s), the paper's number (± its std where it prints one) in parentheses"
    )
    if table.paper_scale != 1:
        head += f"; the paper prints fractions, shown x{table.paper_scale:g}"
    if table.paper_avg is not None:
        head += "; Avg.: the mean over the columns ('-' where a column has no number)"
    if synthetic:
        head += (
            "\nSYNTHETIC STAND-IN STORES (--synthetic): these numbers say nothing about real data; they show the "
            "grid runs"
        )
    notes = "".join(f"\nn/a in {table.columns[c].label}: {why}" for c, why in skipped.items())
    by_reason: dict[tuple[int, str], list[int]] = {}
    for (r, c), why in sorted(blocked.items()):
        by_reason.setdefault((r, why), []).append(c)
    for (r, why), cs in by_reason.items():
        where_ = "all columns" if len(cs) == ncol else ", ".join(table.columns[c].label for c in cs)
        notes += f"\nn/a for {table.rows[r].label} ({where_}): {why}"
    return head + "\n\n" + _table(cols, rows, fmt) + ("\n" + notes if notes else "")


def reproduce(
    name: str,
    *,
    store_root: str | Path = "cache",
    synthetic: bool = False,
    seeds: int = 5,
    rounds: int | None = None,
    out: str | Path | None = None,
    fmt: str = "markdown",
    overwrite: bool = False,
    log=print,
) -> str:
    """Run table ``name``'s grid (finished runs are reused) and return it rendered."""
    from fedfeat.runs.sweep import run_sweep
    from fedfeat.report.load import load_run

    if name not in TABLES:
        raise FedfeatError(f"unknown table '{name}'; known: {', '.join(TABLES)}")
    if seeds < 1:
        raise FedfeatError(f"--seeds must be >= 1, got {seeds}")
    if fmt not in ("markdown", "csv", "json"):
        raise FedfeatError(f"unknown format '{fmt}'; choose markdown, csv or json")
    table = TABLES[name]
    root = Path(store_root)
    stores = {
        c.dataset: find_store(root, c.dataset, table.backbone, table, synthetic, log) for c in table.columns
    }
    out = (
        Path(out)
        if out is not None
        else Path("runs") / ("reproduce-" + (table.runs or name) + ("-synthetic" if synthetic else ""))
    )
    from fedfeat.runs.sweep import session

    with session():  # the columns' partitions, checked here, are the ones the runs use
        skipped = drawable(table, stores)
        for c, why in skipped.items():
            log(f"{table.columns[c].label}: the partition cannot be drawn ({why}); the column is left empty")
        blocked = runnable(table, stores, skip=skipped)
        for r in sorted({r for r, _ in blocked}):
            why = next(w for (rr, _), w in blocked.items() if rr == r)
            log(f"{table.rows[r].label}: n/a ({why})")
        pts, where = points(table, stores, list(range(seeds)), out, rounds, skip=skipped, blocked=blocked)
        log(
            f"{name}: {len(pts)} runs ({len(table.rows)} rows x {len(table.columns)} columns x {seeds} seeds"
            + (f", {sum(1 for v in where.values() if not v)} cells n/a)" if any(not v for v in where.values())
               else ")")
        )  # fmt: skip
        # prompt methods' runs go cell by cell: one a method refuses (FedTPG in the open-vocabulary setting) or a
        # live encoder that fails is that cell's n/a, not the grid's end; the others run as one sweep (stacked)
        live = {r for r, row in enumerate(table.rows) if row.method is not None and _needs(row.method)[0]}
        paths: list = [None] * len(pts)
        safe = [i for (r, _), idx in where.items() if r not in live for i in idx]
        safe = sorted(set(safe))
        if safe:
            for i, p in zip(
                safe, run_sweep([pts[i] for i in safe], overwrite=overwrite, progress=False, log=log)
            ):
                paths[i] = p
        for (r, c), idx in where.items():
            if r not in live or not idx:
                continue
            try:
                got = run_sweep([pts[i] for i in idx], overwrite=overwrite, progress=False, log=log)
            except FedfeatError as e:
                blocked[(r, c)] = str(e)
                log(f"{table.rows[r].label} in {table.columns[c].label}: n/a ({e})")
                continue
            for i, p in zip(idx, got):
                paths[i] = p
    summaries = [None if p is None else load_run(p)[0] for p in paths]
    return render(table, summaries, where, synthetic, fmt, skipped, blocked)


__all__ = ["TABLES", "reproduce"]
