"""Fed-MP / FedCLIP as the reference code (huiminzeng/Fed-MP@a40e585) ran them: the prototype score, the per-dataset
ε, the class order the base/novel split is drawn in, the optimiser, and the local model selection. Each reading is
checked on values the other reading would not give: hand cases, and ports of the reference functions run on the
same inputs."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from fedfeat.cli.app import app
from fedfeat.engine.context import Context, RoundPlan
from fedfeat.engine.data import RunData
from fedfeat.engine.optim import BatchedAdam, BatchedAdamW
from fedfeat.engine.rounds import run_federated
from fedfeat.errors import FedfeatError
from fedfeat.methods import get_method
from fedfeat.methods.fedmp import ADAPTER, prototype_stream
from fedfeat.partition import openvocab as ov
from fedfeat.runs.config import resolve_config
from fedfeat.runs.session import run_partition, session

runner = CliRunner()

# Fed-MP dataset/attributes_dict.py `flower_attribute_dict`, as the authors wrote it (their key order)
FLOWER_ATTRIBUTE_DICT = {
    "21": "fire lily",
    "3": "canterbury bells",
    "45": "bolero deep blue",
    "1": "pink primrose",
    "34": "mexican aster",
    "27": "prince of wales feathers",
    "7": "moon orchid",
    "16": "globe-flower",
    "25": "grape hyacinth",
    "26": "corn poppy",
    "79": "toad lily",
    "39": "siam tulip",
    "24": "red ginger",
    "67": "spring crocus",
    "35": "alpine sea holly",
    "32": "garden phlox",
    "10": "globe thistle",
    "6": "tiger lily",
    "93": "ball moss",
    "33": "love in the mist",
    "9": "monkshood",
    "102": "blackberry lily",
    "14": "spear thistle",
    "19": "balloon flower",
    "100": "blanket flower",
    "13": "king protea",
    "49": "oxeye daisy",
    "15": "yellow iris",
    "61": "cautleya spicata",
    "31": "carnation",
    "64": "silverbush",
    "68": "bearded iris",
    "63": "black-eyed susan",
    "69": "windflower",
    "62": "japanese anemone",
    "20": "giant white arum lily",
    "38": "great masterwort",
    "4": "sweet pea",
    "86": "tree mallow",
    "101": "trumpet creeper",
    "42": "daffodil",
    "22": "pincushion flower",
    "2": "hard-leaved pocket orchid",
    "54": "sunflower",
    "66": "osteospermum",
    "70": "tree poppy",
    "85": "desert-rose",
    "99": "bromelia",
    "87": "magnolia",
    "5": "english marigold",
    "92": "bee balm",
    "28": "stemless gentian",
    "97": "mallow",
    "57": "gaura",
    "40": "lenten rose",
    "47": "marigold",
    "59": "orange dahlia",
    "48": "buttercup",
    "55": "pelargonium",
    "36": "ruby-lipped cattleya",
    "91": "hippeastrum",
    "29": "artichoke",
    "71": "gazania",
    "90": "canna lily",
    "18": "peruvian lily",
    "98": "mexican petunia",
    "8": "bird of paradise",
    "30": "sweet william",
    "17": "purple coneflower",
    "52": "wild pansy",
    "84": "columbine",
    "12": "colt's foot",
    "11": "snapdragon",
    "96": "camellia",
    "23": "fritillary",
    "50": "common dandelion",
    "44": "poinsettia",
    "53": "primula",
    "72": "azalea",
    "65": "californian poppy",
    "80": "anthurium",
    "76": "morning glory",
    "37": "cape flower",
    "56": "bishop of llandaff",
    "60": "pink-yellow dahlia",
    "82": "clematis",
    "58": "geranium",
    "75": "thorn apple",
    "41": "barbeton daisy",
    "95": "bougainvillea",
    "43": "sword lily",
    "83": "hibiscus",
    "78": "lotus lotus",
    "88": "cyclamen",
    "94": "foxglove",
    "81": "frangipani",
    "74": "rose",
    "89": "watercress",
    "73": "water lily",
    "46": "wallflower",
    "77": "passion flower",
    "51": "petunia",
}


# ----------------------------------------------------------------------------- 1. the prototype score
def _ref_eval(z, text, order, scale, batch, uncertainty):
    """Port of eval.py:119-163 with utils/core.py's get_prototypes (:4-21), get_threshold (:23-28) and
    update_support_set (:30-47): a support set per class [text prototype, running-mean image prototype, count];
    text-only prototypes while any count is 0, else text + image; logits = scale · z @ prototypesᵀ; then every sample
    whose entropy (of those logits) is below the threshold updates its predicted class's running mean."""
    K = text.shape[0]
    support = [[text[i], torch.zeros(text.shape[1], dtype=text.dtype), 0] for i in range(K)]
    probs = torch.full((K,), 1 / K, dtype=torch.float64)
    threshold = float(-torch.sum(probs * torch.log(probs))) * uncertainty
    preds = {}
    for s in range(0, len(order), batch):
        idx = order[s : s + batch]
        zb = z[idx]
        counts = [c for _, _, c in support]
        if 0 in counts:
            protos = torch.stack([t for t, _, _ in support])
        else:
            protos = torch.stack([t for t, _, _ in support]) + torch.stack([q for _, q, _ in support])
        logits = scale * zb @ protos.T
        pred = torch.argmax(logits, dim=-1)
        p = torch.softmax(logits, dim=-1)
        ent = -torch.sum(p * torch.log(p), dim=-1)
        for i in torch.where((ent < threshold) != 0)[0].tolist():
            key = int(pred[i])
            q, n = support[key][1], support[key][2]
            support[key][1] = (q * n + zb[i]) / (n + 1)
            support[key][2] = n + 1
        preds.update(zip(idx.tolist(), pred.tolist()))
    return torch.tensor([preds[i] for i in range(len(z))])


def test_prototype_score_sum_is_the_default_and_differs_from_eq12_by_hand():
    """p0 = (1, 0, 0), p1 = (0, 1, 0), scale 100, batch 1, ε = 0.1. a = (0.2, 0, 0.98) and b = (0.2, 0, -0.98) join
    class 0 (text logits (20, 0): entropy ~ 4e-8), c = (0, 1, 0) joins class 1: q̄0 = (0.2, 0, 0) (norm 0.2), q̄1 = c.
    The query x = (0.8, 0.6, 0): the code's z·(p + q̄) gives class 0 0.8 · 1.2 = 0.96 < class 1 0.6 · 2 = 1.2 ->
    class 1; Eq. 12's cosines give class 0 0.8 + 0.8 = 1.6 > class 1 0.6 + 0.6 = 1.2 -> class 0. After its
    prediction x joins class 0 by its text pseudo-label (logits (80, 60)): q̄0 = (a + b + x) / 3 = (0.4, 0.2, 0)."""
    w = math.sqrt(1 - 0.04)
    z = torch.tensor([[0.2, 0, w], [0.2, 0, -w], [0, 1, 0], [0.8, 0.6, 0]], dtype=torch.float64)
    text = torch.tensor([[1.0, 0, 0], [0, 1.0, 0]], dtype=torch.float64)
    kw = dict(scale=100.0, batch=1, threshold=0.1 * math.log(2))
    pred, cent, counts = prototype_stream(z, text, torch.arange(4), **kw)  # the function's default: "sum"
    assert pred.tolist() == [0, 0, 1, 1] and counts.tolist() == [3, 1]
    torch.testing.assert_close(cent[0], torch.tensor([0.4, 0.2, 0], dtype=torch.float64))
    assert prototype_stream(z, text, torch.arange(4), combine="cos", **kw)[0].tolist() == [0, 0, 1, 0]
    assert (
        get_method("fed-mp").p.combine == "sum"
        and get_method("fed-mp", {"combine": "cos"}).p.combine == "cos"
    )
    from fedfeat.runs.reproduce import TABLES

    row = next(r for r in TABLES["fed-mp-table1"].rows if r.method == "fed-mp")
    assert row.params["combine"] == "sum"


@pytest.mark.parametrize("batch, uncertainty", [(18, 0.1), (18, 0.3), (5, 0.2)])
def test_prototype_stream_equals_a_port_of_the_reference_eval(batch, uncertainty):
    """120 queries of 6 classes in a shuffled order: the code's score with the code's pseudo-label (the batch's own
    prediction) gives the port's predictions, sample for sample; the paper's score gives others."""
    g = torch.Generator().manual_seed(7)
    K, D = 6, 16
    text = F.normalize(torch.randn(K, D, generator=g, dtype=torch.float64), dim=-1)
    y = torch.arange(K).repeat(20)
    z = F.normalize(text[y] + 0.9 * torch.randn(len(y), D, generator=g, dtype=torch.float64), dim=-1)
    order = torch.randperm(len(y), generator=g)
    ref = _ref_eval(z, text, order, 100.0, batch, uncertainty)
    kw = dict(scale=100.0, batch=batch, threshold=uncertainty * math.log(K), pseudo_label="prediction")
    ours = prototype_stream(z, text, order, combine="sum", **kw)[0]
    assert torch.equal(ours, ref)
    assert not torch.equal(prototype_stream(z, text, order, combine="cos", **kw)[0], ref)


# ----------------------------------------------------------------------------- 2. ε per dataset
def test_epsilon_per_dataset_from_the_preset_unless_set():
    """Appendix A: 20 % of the maximum entropy on Caltech101 / UCF101 / Flower102, 30 % on FGVC / Food101, 10 % on
    StanfordCars; a preset applies it to fed-mp's uncertainty, --set wins, other methods are left alone."""
    want = {"caltech101": "0.2", "ucf101": "0.2", "flowers102": "0.2", "fgvc-aircraft": "0.3", "food101": "0.3",
            "stanford-cars": "0.1"}  # fmt: skip
    assert {d: ov.fedmp_preset_params(d)["uncertainty"] for d in ov.PRESETS} == want
    assert (
        ov.fedmp_preset_params("flower102") == ov.fedmp_preset_params("Flowers-102") == {"uncertainty": "0.2"}
    )
    assert (
        ov.fedmp_preset_params("cars") == {"uncertainty": "0.1"}
        and ov.fedmp_preset_params("FGVC")["uncertainty"] == "0.3"
    )
    with pytest.raises(FedfeatError, match="no Fed-MP preset for dataset 'cifar10'"):
        ov.fedmp_preset_params("cifar10")
    cfg = resolve_config({"preset": "fgvc-aircraft", "method": "fed-mp"}, None, None)
    assert cfg.params["uncertainty"] == "0.3"
    assert get_method("fed-mp", cfg.params).p.uncertainty == 0.3
    assert resolve_config(
        {"preset": "fgvc-aircraft", "method": "fed-mp"}, None, ["uncertainty=0.05"]
    ).params == {"uncertainty": "0.05"}
    assert resolve_config({"preset": "fgvc-aircraft", "method": "fedclip"}, None, None).params == {}
    assert resolve_config({"method": "fed-mp"}, None, None).params == {}  # no preset: the code's 0.1
    assert get_method("fed-mp").p.uncertainty == 0.1


# ----------------------------------------------------------------------------- 3. the class order
def _ref_flower_split(num_users=10):
    """Port of dataset/utils.py:82-116 (``flower_split_clients``), its class draws: the classes are the integers
    1..102 (not the folder names as strings), client i draws with ``np.random.seed(i + 1)``; names through
    ``flower_attribute_dict`` (:103, :114). Returns (each client's class names in draw order, the novel names)."""
    all_categories = list(range(1, 103))
    per_client = len(all_categories) // (num_users + 1)
    clients = []
    for i in range(num_users):
        rs = np.random.RandomState(i + 1)  # the reference's np.random.seed(i + 1): the same stream
        selected = rs.choice(all_categories, per_client, replace=False)
        all_categories = sorted(set(all_categories) - set(selected))
        clients.append([FLOWER_ATTRIBUTE_DICT[str(c)] for c in selected])
    return clients, [FLOWER_ATTRIBUTE_DICT[str(c)] for c in all_categories]


class FakeStore:
    """What ``run_partition`` reads of a store: its class names, labels and stored partitions."""

    def __init__(self, names, per_class=12):
        self.class_names, self.n_classes, self.path = list(names), len(names), "fake.zarr"
        self._labels = np.repeat(np.arange(len(names)), per_class)

    def labels(self, split):
        return self._labels

    def partition_keys(self):
        return []


def _names(store, part):
    clients = [[store.class_names[c] for c in dict.fromkeys(store._labels[p].tolist())] for p in part.clients]
    return clients, sorted(store.class_names[c] for c in part.params["novel_classes"])


def test_flowers_classes_in_imagefolder_order_are_drawn_in_the_reference_order():
    """A Flowers102 store read as an ImageFolder (folders "1", "10", "100", ... sorted as strings, named by
    flower_attribute_dict): with class_order "preset" (the default with --preset) every client draws the classes the
    reference draws, in its order, and the 12 novel classes are the reference's; in the store's order only 2 of 12
    novel classes agree."""
    ref_clients, ref_novel = _ref_flower_split()
    assert ov.preset_class_names("flowers102") == [FLOWER_ATTRIBUTE_DICT[str(i)] for i in range(1, 103)]
    store = FakeStore([FLOWER_ATTRIBUTE_DICT[f] for f in sorted(str(i) for i in range(1, 103))])
    with session():
        cfg = resolve_config({"preset": "flowers102", "store": "fake.zarr", "method": "zeroshot"}, None, None)
        assert cfg.class_order is None and ov.class_order_mode(cfg.class_order, cfg.preset) == "preset"
        key, part, _ = run_partition(store, cfg, False)
        clients, novel = _names(store, part)
        assert clients == ref_clients and novel == sorted(ref_novel) and len(novel) == 12
        assert (
            key == "disjoint-classes-shot10-c10-s0-oflowers102" and part.params["class_order"] == "flowers102"
        )
        cfg_s = resolve_config(
            {"preset": "flowers102", "store": "fake.zarr", "class_order": "store"}, None, None
        )
        key_s, part_s, _ = run_partition(
            store, cfg_s, False
        )  # the same session: never the cached "preset" one
        clients_s, novel_s = _names(store, part_s)
        assert key_s == "disjoint-classes-shot10-c10-s0" and key_s != key
        assert len(set(novel_s) & set(ref_novel)) == 2 and clients_s[0] != ref_clients[0]
    # names compare without case, '_' or spaces; the draw does not depend on the store's order
    shuffled = FakeStore(
        [n.upper().replace(" ", "_") for n in np.random.RandomState(3).permutation(store.class_names)]
    )
    _, part2, _ = run_partition(shuffled, cfg, False)
    assert [n.lower().replace("_", " ") for n in _names(shuffled, part2)[1]] == sorted(ref_novel)


def test_a_store_missing_a_preset_class_is_one_line_error():
    names = [FLOWER_ATTRIBUTE_DICT[str(i)] for i in range(1, 103)]
    names[names.index("fire lily")] = "fire lilly"
    cfg = resolve_config({"preset": "flowers102", "store": "fake.zarr"}, None, None)
    with pytest.raises(FedfeatError) as e:
        run_partition(FakeStore(names), cfg, False)
    msg = str(e.value)
    assert (
        "\n" not in msg
        and "'fire lily'" in msg
        and "1 of its 102 classes" in msg
        and "--class-order store" in msg
    )
    twins = [FLOWER_ATTRIBUTE_DICT[str(i)] for i in range(1, 103)]
    twins[1] = twins[0].upper()  # two store classes that are one name
    with pytest.raises(FedfeatError, match="are one name"):
        ov.preset_class_order("flowers102", twins)
    cfg_s = resolve_config({"preset": "flowers102", "store": "fake.zarr", "class_order": "store"}, None, None)
    assert len(run_partition(FakeStore(names), cfg_s, False)[1].clients) == 10  # "store": no name check
    with pytest.raises(FedfeatError, match="--class-order preset needs --preset"):
        resolve_config({"class_order": "preset"}, None, None)
    with pytest.raises(FedfeatError, match="--class-order must be one of store, preset"):
        resolve_config({"class_order": "alphabetical"}, None, None)


def test_every_preset_list_has_its_class_count_and_unique_names():
    """The shipped lists: the preset's class count, no two names equal after normalisation, and the reference
    code's order (Python's sort of its folder / label names for all but Flowers, whose order is 1..102)."""
    for preset, spec in ov.PRESETS.items():
        names = ov.preset_class_names(preset)
        assert len(names) == spec["classes"] and len({ov.normalise_class_name(n) for n in names}) == len(
            names
        )
    for preset in ("caltech101", "food101", "fgvc-aircraft", "stanford-cars"):
        names = ov.preset_class_names(preset)
        assert names == sorted(names), preset
    cal = ov.preset_class_names("caltech101")
    assert cal[:6] == ["BACKGROUND_Google", "Faces", "Faces_easy", "Leopards", "Motorbikes", "accordion"]
    assert ov.preset_class_names("food101").index("cheese_plate") < ov.preset_class_names("food101").index(
        "cheesecake"
    )
    ucf = ov.preset_class_names("ucf101")  # sorted as CamelCase folders, named by the code's regex
    assert ucf[:2] == ["Apply Eye Makeup", "Apply Lipstick"] and ucf.index("Hammer Throw") < ucf.index(
        "Hammering"
    )
    assert (
        ucf[-1] == "Yo Yo" and ov.preset_class_names("stanford-cars")[-1] == "smart fortwo Convertible 2012"
    )


def test_cli_class_order_on_a_stand_in_store(tmp_path):
    """A synthetic 102-class store (names class_000 ...) with --preset flowers102: the default class order is a
    one-line error naming the flag; --class-order store runs (the stand-ins' setting)."""
    store = tmp_path / "s.zarr"
    r = runner.invoke(
        app,
        ["synth", "--out", str(store), "--classes", "102", "--dim", "8", "--train-per-class", "12",
         "--test-per-class", "2", "--templates", "1", "--no-stats"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    base = [
        "train",
        "--store",
        str(store),
        "--preset",
        "flowers102",
        "--method",
        "zeroshot",
        "--out",
        str(tmp_path),
    ]
    r = runner.invoke(app, base + ["--name", "a", "--quiet"])
    assert r.exit_code == 2 and "'pink primrose'" in r.output and "--class-order store" in r.output
    r = runner.invoke(app, base + ["--name", "b", "--quiet", "--class-order", "store"])
    assert r.exit_code == 0, r.output


# ----------------------------------------------------------------------------- 4. the optimiser
def test_batched_adamw_equals_torch_adamw_per_client_and_is_not_adam():
    """Three clients with 4, 2 and 1 steps, lr 0.05, weight decay 0.2: each client's parameters equal its own
    torch.optim.AdamW's after every step (decoupled decay), and differ from Adam's L2 reading."""
    g = torch.Generator().manual_seed(5)
    steps = [4, 2, 1]
    p0 = {
        "W": torch.randn(3, 3, 4, generator=g, dtype=torch.float64),
        "b": torch.randn(3, 4, generator=g, dtype=torch.float64),
    }
    grads = [{k: torch.randn_like(v[: sum(s > t for s in steps)]) for k, v in p0.items()} for t in range(4)]
    kw = dict(lr=0.05, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.2)
    params = {k: v.clone() for k, v in p0.items()}
    opt = BatchedAdamW(**kw)
    opt.reset(params)
    refs = [{k: v[j].clone().requires_grad_(True) for k, v in p0.items()} for j in range(3)]
    topts = [torch.optim.AdamW(list(r.values()), **kw) for r in refs]
    for gr in grads:
        n = next(iter(gr.values())).shape[0]
        opt.step(params, {k: v.clone() for k, v in gr.items()}, n)
        for j in range(n):
            for k in refs[j]:
                refs[j][k].grad = gr[k][j].clone()
            topts[j].step()
        for j in range(3):  # every client after every step, the ones that sat out included
            for k in params:
                torch.testing.assert_close(params[k][j], refs[j][k].detach(), atol=1e-13, rtol=1e-12)
    adam = {k: v.clone() for k, v in p0.items()}
    a = BatchedAdam(**kw)
    a.reset(adam)
    for gr in grads:
        a.step(adam, {k: v.clone() for k, v in gr.items()}, next(iter(gr.values())).shape[0])
    assert (adam["W"] - params["W"]).abs().max() > 1e-3
    assert BatchedAdamW(lr=0.1).weight_decay == 0.01  # torch.optim.AdamW's default
    assert isinstance(get_method("fed-mp", {"optimizer": "adamw"}).make_optimizer(1), BatchedAdamW)
    for name in ("fedclip", "fed-mp"):
        m = get_method(name).make_optimizer(1)
        assert type(m) is BatchedAdam and (m.lr, m.weight_decay, m.betas, m.eps) == (
            5e-5,
            0.2,
            (0.9, 0.98),
            1e-6,
        )
    from fedfeat.runs.reproduce import TABLES

    for row in TABLES["fed-mp-table1"].rows:
        if row.method in ("fedclip", "fed-mp"):
            assert {k: row.params[k] for k in ("optimizer", "lr", "weight_decay", "local_epochs", "batch_size")} == {
                "optimizer": "adam", "lr": "5e-5", "weight_decay": "0.2", "local_epochs": "2", "batch_size": "18"
            }  # fmt: skip


# ----------------------------------------------------------------------------- 5. local model selection
def _hand_ctx():
    """D = 2, one client holding classes 0 and 1 (raw prompts (1, 0), (0, 1)), α = 0 (residuals do not move the
    prompts): validation shots s0 = (2, 1) of class 0 and s1 = (1, 2) of class 1."""
    text = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    e = torch.zeros(0, 2, dtype=torch.float64)
    o = ov.OpenVocab(
        base=torch.tensor([0, 1]), novel=torch.tensor([2]), client_classes=[torch.tensor([0, 1])],
        local_index=torch.zeros(0, dtype=torch.int64), val_x=torch.tensor([[2.0, 1.0], [1.0, 2.0]], dtype=torch.float64),
        val_y=torch.tensor([0, 1]), val_offsets=torch.tensor([0, 2]), query_x=e, query_y=torch.zeros(0, dtype=torch.int64),
        qval_x=e, qval_y=torch.zeros(0, dtype=torch.int64), base_x=e, base_y=torch.zeros(0, dtype=torch.int64),
    )  # fmt: skip
    return Context(
        device=torch.device("cpu"), feats=e, offsets=torch.tensor([0, 0]), text=F.normalize(text, dim=-1),
        text_all=F.normalize(text, dim=-1)[None], test_x=e, clip_logit_scale=100.0, seed=0, n_clients=1,
        open_vocab=o, text_raw=text,
    )  # fmt: skip


def _adapter(b2):
    """W1 = b1 = W2 = 0: the attention is softmax(b2), z' = normalise(softmax(b2) ⊙ z)."""
    z = torch.zeros(1, 2, 2, dtype=torch.float64)
    return {"W1": z.clone(), "b1": torch.zeros(1, 2, dtype=torch.float64), "W2": z.clone(),
            "b2": torch.tensor([b2], dtype=torch.float64), "res": torch.zeros(1, 2, 2, dtype=torch.float64)}  # fmt: skip


def test_best_val_keeps_the_best_local_epoch_by_hand():
    """Adapter A (b2 = 0) keeps z's direction: s0 -> class 0, s1 -> class 1, accuracy 1. Adapter B (b2 = (0, 10))
    keeps only the second coordinate: both shots -> class 1, accuracy 1/2. A after epoch 1, B at the end: best-val
    uploads A, final uploads B. A tie keeps the earlier epoch; a client that never scores above 0 keeps its final
    adapter (the code's fallback)."""
    ctx = _hand_ctx()
    plan = RoundPlan(1, torch.tensor([0]), torch.tensor([8]), torch.tensor([1]), 18, 2)
    A, B = _adapter([0.0, 0.0]), _adapter([0.0, 10.0])
    m = get_method("fed-mp", {"local_select": "best-val", "alpha": "0"})
    m.setup(ctx)
    local = m.local_begin(ctx, plan, {})
    assert m.local_val_acc(ctx, A, local, 1).tolist() == [1.0] and m.local_val_acc(
        ctx, B, local, 1
    ).tolist() == [0.5]
    m.keep_if_better(ctx, A, local, 1)  # after epoch 1
    final = {k: v.clone() for k, v in B.items()}
    m.local_end(ctx, plan, local, final)
    assert torch.equal(final["b2"], A["b2"]) and torch.equal(final["res"], B["res"])
    # the default uploads the final adapter
    d = get_method("fed-mp", {"alpha": "0"})
    assert d.p.local_select == "final" and d.local_begin(ctx, plan, {}) == {}
    # a tie keeps the earlier epoch: B after epoch 1, B' (also 1/2) at the end
    local = m.local_begin(ctx, plan, {})
    m.keep_if_better(ctx, B, local, 1)
    Bp = _adapter([0.0, 20.0])
    got = {k: v.clone() for k, v in Bp.items()}
    m.local_end(ctx, plan, local, got)
    assert torch.equal(got["b2"], B["b2"])
    # a client whose every epoch scores 0 (the prompts swapped: class 0 is (0, 1), class 1 is (1, 0)) keeps its final
    # adapter, not the first epoch's
    ctx.text_raw = torch.tensor([[0.0, 1.0], [1.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
    local = m.local_begin(ctx, plan, {})
    assert m.local_val_acc(ctx, A, local, 1).tolist() == [0.0]
    m.keep_if_better(ctx, A, local, 1)
    got = {k: v.clone() for k, v in A.items()}
    got["b2"] += 1.0  # the final adapter, also accuracy 0
    m.local_end(ctx, plan, local, got)
    assert torch.equal(got["b2"], A["b2"] + 1.0)


def _ov_data(dtype=torch.float64) -> RunData:
    """12 classes, D = 12; 3 clients of 5, 23 and 40 training shots (1, 2 and 3 steps of 18: ragged) on classes
    [2, 0, 1], [3, 4, 5], [8, 6, 7] and 2 validation shots per class; classes 9-11 novel, 10 query images each."""
    g = torch.Generator().manual_seed(11)
    K, D = 12, 12
    means = F.normalize(torch.randn(K, D, generator=g, dtype=torch.float64), dim=-1)
    text = F.normalize(means + 0.6 * torch.randn(K, D, generator=g, dtype=torch.float64), dim=-1) * 2.5
    client_classes = [[2, 0, 1], [3, 4, 5], [8, 6, 7]]
    ys = [torch.tensor(c * 20)[:n] for c, n in zip(client_classes, [5, 23, 40])]
    y = torch.cat(ys)

    def draw(lab):
        return (3 * (means[lab] + 0.7 * torch.randn(len(lab), D, generator=g, dtype=torch.float64))).to(dtype)

    local = torch.cat([torch.tensor([c.index(int(v)) for v in yy]) for c, yy in zip(client_classes, ys)])
    vy = torch.tensor([c for cc in client_classes for c in cc for _ in range(2)])
    ty = torch.tensor([9, 10, 11]).repeat_interleave(10)
    by = torch.arange(9).repeat_interleave(4)
    x, vx, tx, bx = draw(y), draw(vy), draw(ty), draw(by)
    e = torch.zeros(0, D, dtype=dtype)
    o = ov.OpenVocab(
        base=torch.arange(9), novel=torch.tensor([9, 10, 11]), client_classes=[torch.tensor(c) for c in client_classes],
        local_index=local, val_x=vx, val_y=vy, val_offsets=torch.tensor([0, 6, 12, 18]), query_x=tx, query_y=ty,
        qval_x=e, qval_y=torch.zeros(0, dtype=torch.int64), base_x=bx, base_y=by,
    )  # fmt: skip
    return RunData(
        train_x=x, train_y=y, offsets=torch.tensor([0, 5, 28, 68]), test_x=tx, test_y=ty, text_all=text[None].to(dtype),
        clip_logit_scale=100.0, class_names=[f"c{i}" for i in range(K)], train_counts=torch.bincount(y, minlength=K),
        open_vocab=o,
    )  # fmt: skip


def test_best_val_batched_equals_loop_and_selects():
    """best-val on ragged clients: the batched engine equals the loop engine; at a large step size it uploads
    another adapter than the final epoch's (the selection acts)."""
    sets = {"lr": "0.05", "local_epochs": "4", "local_select": "best-val", "uncertainty": "1"}
    runs = {}
    for engine in ("batched", "loop"):
        runs[engine] = run_federated(get_method("fed-mp", sets), _ov_data(), rounds=2, participation=1.0, seed=5,
                                     engine=engine)  # fmt: skip
    (gb, mb), (gl, ml) = runs["batched"], runs["loop"]
    for k in ADAPTER:
        torch.testing.assert_close(gb[k], gl[k], atol=1e-9, rtol=1e-9)
    assert [r["test_acc"] for r in mb] == pytest.approx([r["test_acc"] for r in ml], abs=1e-9)
    gf, _ = run_federated(get_method("fed-mp", sets | {"local_select": "final"}), _ov_data(), rounds=2,
                          participation=1.0, seed=5)  # fmt: skip
    assert any(not torch.allclose(gb[k], gf[k]) for k in ADAPTER)


def test_best_val_needs_validation_shots():
    data = _ov_data()
    o = data.open_vocab
    data.open_vocab = ov.OpenVocab(**{**o.__dict__, "val_x": o.val_x[:0], "val_y": o.val_y[:0],
                                      "val_offsets": torch.zeros(4, dtype=torch.int64)})  # fmt: skip
    with pytest.raises(FedfeatError, match="--local-val paper or code"):
        run_federated(
            get_method("fed-mp", {"local_select": "best-val"}), data, rounds=1, participation=1.0, seed=0
        )
