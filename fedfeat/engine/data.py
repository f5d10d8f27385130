"""A run's data, loaded once from a store: ``load_run_data`` reads a partition's features client-major (and the test
split, local test splits, the open-vocabulary split), ``build_context`` turns it into the ``Context`` a method
sees (normalised as the method asks; training labels only for methods that use them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from fedfeat.engine.context import Context, state_for
from fedfeat.errors import FedfeatError


@dataclass
class RunData:
    """Everything a run reads from the store, loaded once."""

    train_x: torch.Tensor  # [N, D] client-major, as stored (float16), on device; ``build_context`` upcasts
    train_y: torch.Tensor  # [N] client-major labels (kept by the engine; handed only to labelled methods)
    offsets: torch.Tensor  # [clients+1]
    test_x: torch.Tensor  # [Nt, D] as stored (float16)
    test_y: torch.Tensor  # [Nt]
    text_all: torch.Tensor  # [T, K, D] raw
    clip_logit_scale: float
    class_names: list[str]
    train_counts: torch.Tensor  # [K] counts over the partition's samples
    open_vocab: object | None = (
        None  # fedfeat.partition.openvocab.OpenVocab; test_x/test_y are then the query set
    )
    live: object | None = (
        None  # fedfeat.encoders.live.LiveText (``needs_live_text`` methods; set by the caller)
    )
    memo: dict | None = None  # a sweep's shared RunData keeps its normalised copies here (``build_context``)
    local_test: list | None = None  # per client: int64 rows of test_x (``local_test="proportional"``)
    store: object | None = None  # the FeatureStore it was read from
    rows: np.ndarray | None = None  # [N] store rows of train_x (client-major)
    test_rows: np.ndarray | None = None  # [N_test] store rows of test_x (closed runs)
    val_mask: torch.Tensor | None = (
        None  # [N_test] bool: rows of test_x held out for validation (``val_split``)
    )
    compute_dtype: torch.dtype | None = None  # what methods compute in (None: float32 over float16 features)
    test_domains: torch.Tensor | None = (
        None  # [N_test] int64 domain of each test_x row (a store with domains)
    )
    domain_names: list | None = None
    domain_classes: list | None = (
        None  # per domain, its class ids (a combined store: the dataset's vocabulary)
    )

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the run computes in: over half-precision (stored) features ``load_run_data``'s ``dtype``
        (float32 unless asked); features already in float32 / float64 (a ``RunData`` made or replaced by hand)
        are computed in their own dtype."""
        if self.train_x.dtype in (torch.float16, torch.bfloat16):
            return self.compute_dtype or torch.float32
        return self.train_x.dtype


def upcast(x: torch.Tensor, dtype: torch.dtype, normalize: bool, chunk: int = 8192) -> torch.Tensor:
    """``x`` (stored float16 rows) as ``dtype``, L2-normalised per row if asked, made a block of rows at a time:
    the values equal ``F.normalize(x.to(dtype))`` exactly (the upcast is exact and each row is normalised on
    its own), without the full-size upcast temporary beside the result (issue 30: features are held as they are
    stored; this working copy is the one float32 array a run needs, which the fused CPU kernels read directly)."""
    if x.dtype == dtype and not normalize:
        return x
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    for a in range(0, x.shape[0], chunk):
        xb = x[a : a + chunk].to(dtype)
        out[a : a + chunk] = F.normalize(xb, dim=-1) if normalize else xb
    return out


def _normalize(x: torch.Tensor) -> torch.Tensor:
    return F.normalize(x, dim=-1)


def build_context(data: RunData, method, seed: int, device: torch.device) -> Context:
    p = method.p
    norm = getattr(p, "normalize", True)
    memo = data.memo

    dtype = data.dtype

    def _normalize(x: torch.Tensor, name: str = "") -> torch.Tensor:
        """L2-normalised rows; a sweep's shared data normalises each array once (the copies are never written:
        methods replace context tensors, they do not modify them in place)."""
        if memo is None or not name:
            return F.normalize(x, dim=-1)
        if name not in memo:
            memo[name] = F.normalize(x, dim=-1)
        return memo[name]

    def _features(x: torch.Tensor, name: str) -> torch.Tensor:
        """A stored (float16) split as the method reads it: upcast to the run's dtype, normalised if the method
        asks (``upcast``); made once per shared ``RunData`` (a sweep's memo) and per normalisation."""
        key = f"{name}:{'norm' if norm else 'raw'}:{dtype}"
        if memo is not None and key in memo:
            return memo[key]
        out = upcast(x, dtype, norm)
        if memo is not None:
            memo[key] = out
        return out

    text_all = _normalize(data.text_all.to(dtype))
    tmpl = getattr(p, "templates", "first")
    if tmpl == "first":
        text = text_all[0]
    elif tmpl == "ensemble":
        text = _normalize(text_all.mean(0))
    else:
        raise FedfeatError(f"templates must be 'first' or 'ensemble', got {tmpl!r}")
    ctx = Context(
        device=device,
        feats=_features(data.train_x, "train_x"),
        offsets=data.offsets,
        text=text.to(device),
        text_all=text_all.to(device),
        test_x=_features(data.test_x, "test_x"),
        clip_logit_scale=data.clip_logit_scale,
        seed=seed,
        n_clients=len(data.offsets) - 1,
        labels=data.train_y if method.uses_labels else None,
        train_counts=data.train_counts if method.uses_labels else None,
        text_raw=(data.text_all[0].to(text.dtype) if tmpl == "first" else text_all.mean(0)).to(device),
        live=data.live,
        class_names=list(data.class_names),
        local_test=data.local_test,
        store=data.store,
        train_rows=data.rows,
        test_rows=data.test_rows,
        val_mask=data.val_mask,
        test_domains=None if data.test_domains is None else data.test_domains.to(device),
        domain_names=data.domain_names,
        domain_classes=data.domain_classes,
        state=state_for(method),  # writes only the keys the method (state_keys) or the engine declares
    )
    if method.needs_live_text and data.live is None:
        raise FedfeatError(
            f"method {method.name} trains prompts and needs the store's live text encoder (fedfeat.encoders.live)"
        )
    ov = data.open_vocab
    if ov is not None:
        f = _normalize if norm else (lambda x: x)
        ctx.open_vocab = dataclasses.replace(
            ov, val_x=f(ov.val_x), query_x=f(ov.query_x), qval_x=f(ov.qval_x), base_x=f(ov.base_x)
        )
    return ctx


@torch.no_grad()
def check_labels(store) -> None:
    """Every train and test label is a class id of the store or -1 (a skipped image)."""
    K = store.n_classes
    for split in ("train", "test"):
        lab = store.labels(split)
        bad = np.flatnonzero((lab < -1) | (lab >= K))
        if len(bad):
            raise FedfeatError(
                f"store {store.path}: {split} label {int(lab[bad[0]])} at row {int(bad[0])} is not a class id "
                f"(the store has {K} classes, 0..{K - 1}; -1 marks a skipped image); rebuild the store"
            )


def load_run_data(
    store,
    partition,
    *,
    device="cpu",
    centralized: bool = False,
    dtype=torch.float32,
    local_val: str = "paper",
    query_val: str = "paper",
    query_seed: int = 0,
    local_test: str = "none",
    val_split: float = 0.0,
) -> RunData:
    """Load a store's train (in the partition's client-major order) and test splits onto ``device``.

    ``dtype`` float32 by default, the dtype methods compute in (never compute in float16 on a CPU); float64 is
    for exactness checks. The train and test features are **held as stored** (float16: half the bytes of a float32
    copy); ``build_context`` makes the method's working copy (upcast, normalised as the method asks, one block of
    rows at a time), whose values are exactly those of upcasting first. Small arrays (text embeddings, an
    open-vocabulary run's query / base / validation sets) are held in ``dtype`` (the engines agree to ~1e-12 there). A ``disjoint-classes`` partition makes the run
    open-vocabulary (``fedfeat.partition.openvocab``: ``local_val`` and ``query_val`` say how the clients' shots and the
    query set are split; the query set, not the whole test split, is then ``test_x`` / ``test_y``).

    ``val_split`` f > 0 (closed runs) holds out a validation set from the test split, as Fed-MP holds out 20 % of its
    query set (``query_val="paper"``): per class, ``round(f · n_c)`` test images chosen by a permutation seeded with
    ``query_seed`` (the same for every training seed, so the seeds of a setting share one split). They stay in
    ``test_x`` (one prediction pass serves both) and ``val_mask`` marks them: the test metrics (``test_acc``,
    per-class and local accuracies) leave them out, ``val_acc`` is measured on them. Open-vocabulary runs validate on
    the query set's validation part instead."""
    check_labels(store)
    labels = store.labels("train")
    ov_parts = None
    b2n = bool(partition.params.get("base_novel"))
    if (
        b2n
    ):  # CoOp's base-to-novel: every shot trains, every test image of a class is tested (no held-out parts)
        local_val, query_val = "none", "code"
    if partition.scheme == "disjoint-classes" or b2n:
        from fedfeat.partition import openvocab
        from fedfeat.partition.core import Partition

        openvocab.check_modes(local_val, query_val)
        train_pos, val_pos = openvocab.local_split(partition.clients, labels, local_val)
        ov_parts = (partition.clients, train_pos, val_pos)
        partition = Partition(partition.scheme, partition.params, train_pos)
    order, offsets = partition.order_and_offsets()
    if centralized:
        offsets = np.array([0, len(order)], dtype=np.int64)
    feats = store.features("train")
    K = store.n_classes
    x = torch.from_numpy(feats[order]).to(device=device)  # [N, D] as stored
    y = torch.from_numpy(labels[order]).to(device)
    has_test = "test" in store.splits
    tx_np = store.features("test") if has_test else feats
    ty_np = store.labels("test") if has_test else labels
    keep = ty_np >= 0
    test_rows = partition.params.get(
        "test_rows"
    )  # a held-out domain (the domain scheme): the global test is its rows
    if test_rows is not None:
        only = np.zeros(len(keep), dtype=bool)
        only[np.flatnonzero(keep)[np.asarray(test_rows, dtype=np.int64)]] = (
            True  # positions among the valid rows
        )
        keep &= only
        if partition.params.get("held_out_eval") == "all":  # FedCLIP: the whole target domain, every split
            tx_np, ty_np = _whole_domain(store, partition.params)
            keep = np.ones(len(ty_np), dtype=bool)
            has_test = False  # its rows come from several splits: no one split's row numbers
        if not keep.any():
            raise FedfeatError("the held-out domain has no test rows; hold out another domain")
        if local_test != "none":
            raise FedfeatError(
                "a run with a held-out domain tests on that domain's rows; its clients have no local test there: "
                "drop --local-test, or drop held_out for each domain's personal test"
            )
    ov = None
    if ov_parts is not None:
        novel = partition.params.get("novel_classes") if b2n else None  # the protocol's, not the draws'
        ov, keep = _open_vocab(
            ov_parts, labels, feats, tx_np, ty_np, has_test, K, query_val, query_seed, device, dtype, novel
        )
    tx = torch.from_numpy(tx_np[keep]).to(device=device)  # [Nt, D] as stored
    lt = None
    if local_test != "none":
        from fedfeat.partition.make import LOCAL_TEST, local_test_split

        if local_test not in LOCAL_TEST:
            raise FedfeatError(f"--local-test must be one of {', '.join(LOCAL_TEST)}, got {local_test!r}")
        if ov is not None or not has_test:
            raise FedfeatError(
                "--local-test splits a store's test split among the clients of a closed partition; this run "
                + ("is open-vocabulary (disjoint-classes)" if ov is not None else "has no test split")
                + ": drop --local-test"
            )
        if local_test == "joint":  # the test positions drawn with the train split (dirichlet-joint, FedCoPL)
            tc = partition.params.get("test_clients")
            if tc is None:
                raise FedfeatError(
                    "--local-test joint takes the test split drawn with the partition: use --partition "
                    "dirichlet-joint (FedCoPL) or domain (each client's domain), or --local-test proportional for "
                    "another partition"
                )
            split = [np.asarray(t, dtype=np.int64) for t in tc]
        else:
            split = local_test_split(partition, labels, ty_np[keep], K, seed=query_seed)
        lt = [torch.from_numpy(r) for r in split]
    vmask = None
    if val_split:
        if not 0 < val_split < 1:
            raise FedfeatError(
                f"--val-split must be in [0, 1), got {val_split} (e.g. 0.2: 20 % of each test class)"
            )
        if ov is not None:
            raise FedfeatError(
                "--val-split holds out part of a closed run's test split; an open-vocabulary run validates on its "
                "query set's validation part (--query-val paper): drop --val-split"
            )
        if not has_test:
            raise FedfeatError(
                "--val-split holds out part of the test split, and this store has none: drop it"
            )
        vm = holdout(ty_np[keep], val_split, query_seed)
        if not vm.any() or vm.all():
            raise FedfeatError(
                f"--val-split {val_split} leaves {'no validation' if not vm.any() else 'no test'} images on a test "
                "split this small; choose a fraction between 0.05 and 0.5"
            )
        vmask = torch.from_numpy(vm).to(device)
        if lt is not None:  # the local test splits keep their test rows only
            lt = [r[~torch.from_numpy(vm)[r]] for r in lt]
    return RunData(
        train_x=x,
        train_y=y,
        offsets=torch.from_numpy(offsets.astype(np.int64)),
        test_x=tx,
        test_y=torch.from_numpy(ty_np[keep]).to(device),
        text_all=torch.from_numpy(store.text_features()).to(device=device, dtype=dtype),
        clip_logit_scale=store.logit_scale,
        class_names=store.class_names,
        train_counts=torch.bincount(y.cpu(), minlength=K),
        open_vocab=ov,
        local_test=lt,
        store=store,
        rows=order,
        test_rows=np.flatnonzero(keep) if ov is None and has_test else None,
        val_mask=vmask,
        compute_dtype=dtype,
        **_domain_data(store, keep, device, ov is None and has_test, partition.params),
    )


def _whole_domain(store, params: dict) -> tuple[np.ndarray, np.ndarray]:
    """``(features, labels)`` of every row of the held-out domain, split after split in the store's order (FedCLIP's
    target client: ``prepare_data_dg_clip.py`` tests the whole ImageFolder of a ``test_envs`` domain); rows a store
    marks unreadable (label -1) left out."""
    d = list(params.get("domain_names") or []).index(params["held_out"])
    xs, ys = [], []
    for split in store.splits:
        doms, lab = store.domains(split), store.labels(split)
        rows = np.flatnonzero((doms == d) & (lab >= 0))
        xs.append(store.features_rows(split, rows))
        ys.append(lab[rows])
    return np.concatenate(xs), np.concatenate(ys)


def _domain_data(store, keep: np.ndarray, device, closed: bool, params: dict) -> dict:
    """A store with domains (closed runs): each kept test row's domain, the names, and a combined store's per-domain
    vocabulary (attr ``domain_classes``), checked against the store's classes. A whole held-out domain as the test
    set (``held_out_eval = "all"``): every test row is that domain's."""
    doms = getattr(store, "domains", None)
    d = doms("test") if closed and doms is not None else None
    if params.get("held_out_eval") == "all":
        d = np.full(len(keep), list(params["domain_names"]).index(params["held_out"]), dtype=np.int64)
    if (
        d is None
        and not closed
        and getattr(store, "domain_names", None)
        and store.attrs.get("domain_classes")
    ):
        # an open-vocabulary / base-to-novel run on a combined store: each dataset's vocabulary, no test_domains
        # (its evaluation groups the query and base rows by their classes' dataset)
        names = list(store.domain_names)
        return {"domain_names": names, "domain_classes": _checked_classes(store, names)}
    if d is None:
        return {}
    names = list(store.domain_names or [f"domain {i}" for i in range(int(d.max(initial=-1)) + 1)])
    classes = _checked_classes(store, names)
    return {
        "test_domains": torch.from_numpy(d[keep].astype(np.int64)).to(device),
        "domain_names": names,
        "domain_classes": classes,
    }


def _checked_classes(store, names: list) -> list | None:
    """A combined store's ``domain_classes`` (each dataset's class ids), checked; None for another store."""
    classes = store.attrs.get("domain_classes")
    if classes is None:
        return None
    K = store.n_classes
    if len(classes) != len(names) or any(not 0 <= int(c) < K for cs in classes for c in cs):
        raise FedfeatError(
            f"store {store.path}: domain_classes does not list class ids of its {len(names)} domains; rebuild it "
            "with `fedfeat combine`"
        )
    return [[int(c) for c in cs] for cs in classes]


def holdout(y: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """``[len(y)]`` bool: per class, ``round(fraction · n_c)`` (Python's round) positions (a permutation of the class's positions
    from one ``RandomState(seed)``, classes in ascending order) are held out.

    >>> holdout(np.array([0, 0, 0, 0, 1, 1, 1, 1, 1]), 0.5, 0).astype(int).tolist()
    [0, 0, 1, 1, 1, 0, 1, 0, 0]
    """
    rs = np.random.RandomState(seed)
    out = np.zeros(len(y), dtype=bool)
    for c in np.unique(y):
        idx = np.flatnonzero(y == c)
        out[idx[rs.permutation(len(idx))[: int(round(fraction * len(idx)))]]] = True
    return out


def _open_vocab(
    parts, labels, feats, tx_np, ty_np, has_test, K, query_val, query_seed, device, dtype, novel=None
):
    """The ``OpenVocab`` of a disjoint-classes partition (novel: the classes no client drew) or of a base-to-novel
    run (``novel``: the protocol's second half of the classes, base the first), and the query set's test rows
    (``keep``)."""
    from fedfeat.partition import openvocab

    clients, train_pos, val_pos = parts
    lists = openvocab.class_lists(clients, labels)
    if novel is not None:
        novel = np.asarray(novel, dtype=np.int64)
        base = np.setdiff1d(np.arange(K), novel)
    else:
        base = np.unique(np.concatenate(lists)) if lists else np.zeros(0, dtype=np.int64)
        novel = np.setdiff1d(np.arange(K), base)
    local = []  # per training row: its class's index in its client's list (Fed-MP's residual rows)
    for c, p in zip(lists, train_pos):
        lookup = np.full(K, -1, dtype=np.int64)
        lookup[c] = np.arange(len(c))
        local.append(lookup[labels[p]])
    used = np.zeros(len(labels), dtype=bool)
    used[np.concatenate(clients)] = True
    avail = (ty_np >= 0) if has_test else ((labels >= 0) & ~used)  # no test split: the images clients lack
    q_rows = np.flatnonzero(avail & np.isin(ty_np, novel))
    qv, qt = openvocab.query_split(ty_np[q_rows], query_val, query_seed)
    b_rows = np.flatnonzero(avail & np.isin(ty_np, base))
    vorder = np.concatenate(val_pos) if val_pos else np.zeros(0, dtype=np.int64)
    voffs = np.concatenate([[0], np.cumsum([len(v) for v in val_pos])]).astype(np.int64)

    def t(a, dt=dtype):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dt)

    ov = openvocab.OpenVocab(
        base=t(base, torch.int64),
        novel=t(novel, torch.int64),
        client_classes=[t(c, torch.int64) for c in lists],
        local_index=t(np.concatenate(local) if local else np.zeros(0), torch.int64),
        val_x=t(feats[vorder]),
        val_y=t(labels[vorder], torch.int64),
        val_offsets=torch.from_numpy(voffs),
        query_x=t(tx_np[q_rows[qt]]),
        query_y=t(ty_np[q_rows[qt]], torch.int64),
        qval_x=t(tx_np[q_rows[qv]]),
        qval_y=t(ty_np[q_rows[qv]], torch.int64),
        base_x=t(tx_np[b_rows]),
        base_y=t(ty_np[b_rows], torch.int64),
    )
    keep = np.zeros(len(ty_np), dtype=bool)
    keep[q_rows[qt]] = True
    return ov, keep
