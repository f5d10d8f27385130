"""``domain``: clients by domain (feature shift): one client per domain, or ``per_domain`` clients inside each
domain by a Dirichlet label skew; optionally one domain held out of training and tested alone (leave-one-domain-out).

The rows' domains are the store's (``FeatureStore.domains``: DomainNet, PACS, OfficeHome, VLCS, Office-Caltech10
readers, ``fedfeat synth --domains``); domain ``d``'s train rows are its rows of the train split in store order, its
test rows those of the test split.

``per_domain = 1`` (FedBN, FedCLIP, FedOTP without label skew): client ``d`` holds all of domain ``d``'s train rows
and its test rows are domain ``d``'s test rows (``test_clients``: each client's personal test, ``--local-test
joint``). Sources: FedOTP ``HongxiaLee/FedOTP`` @ 506d68c ``utils/data_utils.py`` ``prepare_data_domainNet`` /
``prepare_data_office`` (one train and one test set per site, in site order); FedBN (``med-air/FedBN``
``federated/fed_office.py`` / ``fed_domainnet.py``: one client per site); FedCLIP (PersonalizedFL
``prepare_data_dg_clip.py``: one client per domain, the per-domain split is the reader's, ``fedfeat.data.domains``).

``per_domain = k > 1`` (FedOTP / FedPGP with label skew, ``DATASET.SPLIT_CLIENT``): each domain is cut among ``k``
clients by FedOTP's ``Dataset_partition_domainnet`` (``utils/data_utils.py``; ``Dataset_partition_office`` is the same
function on Office-Caltech10), transcribed call for call on a private ``RandomState``:

1. for each class ``c``: its train positions and test positions within the domain (``np.where`` order);
   ``np.random.seed(0)`` (reset for every class); shuffle the train positions, then the test positions;
   ``p ~ Dirichlet(alpha x 1_k)``; ``p_j = 0`` for clients already holding ``>= N_train / k`` train rows; normalised;
   both splits cut at ``(cumsum(p) * n).astype(int)[:-1]``, each client appending its pieces;
2. ``min_size`` = the smallest client, train or test, after the last class: below ``min_require_size`` the code draws
   again -- the same draws, since the seed is reset for every class: it never ends. Here that is a one-line error;
3. each client's train positions, then its test positions, shuffled in client order (the stream continuing from the
   last class's draws).

The code's seed is ``np.random.seed(0)`` inside the function, so the run's partition seed does not enter this draw
(it is recorded in the key as for every scheme). A reading of ours: FedOTP's ``DomainNetDataset_sub`` /
``OfficeDataset_sub`` subset only the labels (``self.target = self.target[net_dataidx_map]``), not the image paths,
so the code pairs the first ``n`` images of a domain with the labels of the drawn rows; fedfeat pairs every image
with its own label (docs/paper-code.md).

``held_out`` (a domain name): that domain gets no client; the global test (``test_acc``) is its test rows only
(``test_rows``), the leave-one-domain-out evaluation of domain generalisation; ``held_out_eval = "all"`` tests every
row of it, all splits (FedCLIP's target client: ``prepare_data_dg_clip.py`` ``getfeadataloader`` loads the whole
``test_envs`` domain, unsplit). Without ``held_out``, the global test is every domain's test rows.
"""

import math
from dataclasses import dataclass, field

import numpy as np

from fedfeat.errors import FedfeatError
from fedfeat.partition.kinds.dirichlet import ALPHA, ALPHA_KEY
from fedfeat.partition.registry import Draw, KeyPart, Scheme, register_scheme

FEDOTP_DOMAIN_SEED = 0  # Dataset_partition_domainnet: np.random.seed(0) for every class
FEDOTP_MIN_REQUIRE = 2  # prepare_data_domainNet_partition_client_train: min_require_size = 2
FEDOTP_BETA = 0.1  # federated_main.py:522: --beta default 0.1 (cfg.DATASET.BETA)


def _at_least_one(v) -> str | None:
    return None if v >= 1 else f"must be >= 1, got {v} (FedOTP: 5 clients per domain with label skew)"


def _at_least_zero(v) -> str | None:
    return None if v >= 0 else f"must be >= 0, got {v} (FedOTP: 2)"


def _eval_choice(v) -> str | None:
    return (
        None
        if v in ("test", "all")
        else f"must be test or all, got {v!r} (FedCLIP tests the whole held-out domain: all)"
    )


def fedotp_domain_split(
    train_labels, test_labels, beta: float, n_parties: int, min_require_size: int, K: int
):
    """FedOTP's ``Dataset_partition_domainnet`` on one domain: ``(train positions, test positions)`` per client,
    positions within the domain's rows (module docstring)."""
    train_labels = np.asarray(train_labels)
    test_labels = np.asarray(test_labels)
    n_train = train_labels.shape[0]
    rs = np.random.RandomState(FEDOTP_DOMAIN_SEED)
    idx_train: list[list[int]] = [[] for _ in range(n_parties)]
    idx_test: list[list[int]] = [[] for _ in range(n_parties)]
    for k in range(K):
        tr = np.where(train_labels == k)[0]
        te = np.where(test_labels == k)[0]
        rs.seed(FEDOTP_DOMAIN_SEED)
        rs.shuffle(tr)
        rs.shuffle(te)
        p = rs.dirichlet(np.repeat(beta, n_parties))
        p = np.array([q * (len(j) < n_train / n_parties) for q, j in zip(p, idx_train)])
        p = p / p.sum()
        cut_tr = (np.cumsum(p) * len(tr)).astype(int)[:-1]
        cut_te = (np.cumsum(p) * len(te)).astype(int)[:-1]
        idx_train = [j + piece.tolist() for j, piece in zip(idx_train, np.split(tr, cut_tr))]
        idx_test = [j + piece.tolist() for j, piece in zip(idx_test, np.split(te, cut_te))]
    smallest = min(min(len(j) for j in idx_train), min(len(j) for j in idx_test))
    if smallest < min_require_size:
        raise FedfeatError(
            f"domain: a client of this domain gets {smallest} rows (< min_require_size {min_require_size}); FedOTP's "
            "code would redraw the same split forever (np.random.seed(0) per class): use fewer clients per domain, "
            "a larger alpha or --min-require-size 0"
        )
    out_tr, out_te = [], []
    for j in range(n_parties):
        a = np.array(idx_train[j], dtype=np.int64)
        b = np.array(idx_test[j], dtype=np.int64)
        rs.shuffle(a)
        rs.shuffle(b)
        out_tr.append(a)
        out_te.append(b)
    return out_tr, out_te


def domain_partition(
    d: Draw, per_domain: int, alpha: float | None, min_require_size: int, held_out: str | None
):
    """``(train clients, test clients or None, client domains, test rows or None)``: positions into ``d.labels`` /
    ``d.test_labels`` (module docstring)."""
    doms = d.domains
    n_dom = (
        int(max(doms.max(initial=-1), -1 if d.test_domains is None else d.test_domains.max(initial=-1))) + 1
    )
    names = list(d.domain_names) if d.domain_names else [f"domain {i}" for i in range(n_dom)]
    n_dom = max(n_dom, len(names))
    hold = None
    if held_out is not None:
        if held_out not in names:
            raise FedfeatError(
                f"domain: held_out {held_out!r} is not a domain of this store; its domains: {', '.join(names)}"
            )
        hold = names.index(held_out)
    train_doms = [i for i in range(n_dom) if i != hold]
    want = len(train_doms) * per_domain
    if d.clients != want:
        raise FedfeatError(
            f"domain: {len(train_doms)} training domain(s) x {per_domain} per domain = {want} clients, not {d.clients}; "
            f"pass --clients {want}"
        )
    if per_domain > 1 and alpha is None:
        raise FedfeatError(
            "domain: per_domain > 1 cuts each domain by a Dirichlet label skew; pass alpha (e.g. 0.1)"
        )
    tl, td = d.test_labels, d.test_domains
    if (tl is None) != (td is None):
        td = None
    train, test, owner = [], [] if td is not None else None, []
    for dom in train_doms:
        rows = np.flatnonzero(doms == dom)
        trows = np.flatnonzero(td == dom) if td is not None else np.zeros(0, np.int64)
        if not len(rows):
            raise FedfeatError(f"domain: domain {names[dom]!r} has no training rows; hold it out or drop it")
        if per_domain == 1:
            train.append(rows)
            if test is not None:
                test.append(trows)
        else:
            a, b = fedotp_domain_split(
                d.labels[rows], tl[trows] if td is not None else np.zeros(0, np.int64), alpha, per_domain,
                min_require_size if td is not None else min(min_require_size, 0), d.n_classes,
            )  # fmt: skip
            train += [rows[x] for x in a]
            if test is not None:
                test += [trows[x] for x in b]
        owner += [dom] * per_domain
    test_rows = None
    if hold is not None:
        test_rows = np.flatnonzero(td == hold) if td is not None else np.zeros(0, np.int64)
    return train, test, owner, test_rows


@register_scheme
class Domain(Scheme):
    name = "domain"
    summary = (
        "clients = domains (feature shift): per_domain clients each, a Dirichlet label skew inside a domain"
    )
    source = (
        "FedOTP prepare_data_domainNet / Dataset_partition_domainnet (HongxiaLee/FedOTP utils/data_utils.py); "
        "FedBN / FedCLIP one client per domain"
    )
    order = 80
    seed = FEDOTP_DOMAIN_SEED
    needs_domains = True
    uses_test_labels = True
    takes_imbalance = False

    @dataclass(frozen=True)
    class Params:
        per_domain: int = field(
            default=1,
            metadata={
                "help": "clients per domain (FedOTP with label skew: 5)",
                "example": "5",
                "check": _at_least_one,
            },
        )
        # per_domain > 1 only: FedOTP's --beta (cfg.DATASET.BETA), default 0.1 (federated_main.py:522)
        alpha: float | None = field(default=None, metadata=ALPHA)
        min_require_size: int = field(
            default=FEDOTP_MIN_REQUIRE,
            metadata={"help": "every client of a domain holds >= N train and test rows (FedOTP: 2)", "example": "1",
                      "check": _at_least_zero},
        )  # fmt: skip
        held_out: str | None = field(
            default=None,
            metadata={"help": "a domain left out of training and tested alone (leave-one-domain-out)",
                      "example": "sketch"},
        )  # fmt: skip
        held_out_eval: str | None = field(
            default=None,
            metadata={"help": "the held-out domain's rows tested: its test split (default) or all (FedCLIP)",
                      "example": "all", "check": _eval_choice},
        )  # fmt: skip

    key_parts = (
        KeyPart("per_domain", "pd", "{} per domain"),
        ALPHA_KEY,
        KeyPart("min_require_size", "mr", "min {} rows", after=True),
        KeyPart("held_out", "ho", "{} held out", "text", True),
        KeyPart("held_out_eval", "he", "{} of it tested", "text", True),
    )
    words = "domains"
    implied_values = {"alpha": FEDOTP_BETA}  # per_domain > 1 without alpha draws with FedOTP's 0.1

    @classmethod
    def check(cls, params):
        if params.alpha is not None and not (math.isfinite(params.alpha) and params.alpha > 0):
            raise FedfeatError(f"alpha must be a finite number > 0, got {params.alpha} (e.g. 0.1)")
        if params.held_out_eval is not None and _eval_choice(params.held_out_eval):
            raise FedfeatError(f"held_out_eval {_eval_choice(params.held_out_eval)}")
        if params.held_out_eval is not None and params.held_out is None:
            raise FedfeatError(
                "held_out_eval says which rows of the held-out domain are tested; pass held_out too"
            )
        if params.alpha is not None and params.per_domain == 1:
            raise FedfeatError(
                "alpha cuts a domain among its clients (per_domain > 1); with one client per domain drop alpha, or "
                "pass per_domain (FedOTP: 5)"
            )
        return params

    @classmethod
    def record(cls, params) -> dict:
        out = {"per_domain": int(params.per_domain)}
        if params.per_domain > 1:
            out["alpha"] = float(FEDOTP_BETA if params.alpha is None else params.alpha)
        if params.min_require_size != FEDOTP_MIN_REQUIRE:
            out["min_require_size"] = int(params.min_require_size)
        if params.held_out is not None:
            out["held_out"] = str(params.held_out)
        if params.held_out_eval not in (None, "test"):
            out["held_out_eval"] = str(params.held_out_eval)
        return out

    @classmethod
    def describe(cls, values: dict[str, str]) -> str:
        """The scheme in words (the held-out domain and its rows are the key's later parts, said after this)."""
        out = f"domains, {values.get('per_domain', '1')} client(s) per domain"
        if values.get("alpha") is not None:
            out += f", Dir(α = {values['alpha']}) inside"
        return out

    @classmethod
    def draw(cls, d: Draw, params):
        alpha = FEDOTP_BETA if params.alpha is None else params.alpha
        train, test, owner, test_rows = domain_partition(
            d, params.per_domain, alpha, params.min_require_size, params.held_out
        )
        names = list(d.domain_names) or [f"domain {i}" for i in range(max(owner) + 1)]
        extra: dict = {"client_domains": [names[o] for o in owner], "domain_names": names}
        if test is not None:
            extra["test_clients"] = [t.tolist() for t in test]
        if test_rows is not None:
            extra["test_rows"] = test_rows.tolist()
        return train, extra
