"""A synthetic CLIP-like feature store, so that everything runs offline on a fresh machine.

Generative model (all vectors in R^D, ``nz`` = L2-normalise; one ``torch.Generator`` seeded by ``seed``):

* Orthonormal directions ``c_img`` (the image cone's axis), ``c_txt`` (the text cone's axis: the two
  differ, which is CLIP's "modality gap").
* Class directions ``U_k = nz(rho * S_g(k) + sqrt(1 - rho^2) * E_k)`` with ``G = max(2, ceil(K / 5))``
  super-class directions ``S`` (class k belongs to group k mod G), so some classes are closer than others
  (like CIFAR-10's animals vs vehicles).
* Image of class y: ``x = nz(a c_img + b (U_y + s * zeta @ U) + sigma * xi / sqrt(D))`` with
  ``zeta ~ N(0, I_K)`` (within-class variation along the class directions: what makes classes confusable)
  and ``xi ~ N(0, I_D)`` (isotropic noise).
* Text prototype of class k, template j:
  ``t_jk = nz(a_t c_txt + (m + bias_k) c_img + b_t nz(U_k + nu_k) + tnoise * b_t * eps_jk / sqrt(D))``,
  with a per-class misalignment ``nu_k ~ N(0, eta^2 I / D)`` (the prompt is not the class mean: why
  zero-shot is below a linear probe), a per-class offset ``bias_k ~ N(0, bias_sd^2)`` along the image
  axis (every image scores higher on some classes: CLIP's known class bias), and per-template noise.

The defaults were set to published statistics of real CLIP RN50 features on CIFAR-10, not to any
federated method's result: zero-shot (18 templates) about 71.6 % (open_clip's results table), a full
linear probe about 88 % (CLIP paper), cosine between an image and its own class prompt about 0.2-0.3,
a few hundredths above the other classes, and predictions skewed towards some classes. What the
default store measures is printed by ``fedfeat synth`` and kept in the store's ``synthetic_stats``.

Domain shift (``domains`` = N > 0; feature-shift federations, clients = domains, the stand-in of PACS,
OfficeHome, Office-Caltech10, DomainNet). Every domain has ``train_per_class`` / ``test_per_class`` images per
class (N x the rows), each row's domain recorded (``FeatureStore.domains``, names ``domain_names`` or
"domain 0", "domain 1", ...); the text prototypes are shared (a prompt does not know the domain). After all of
the above (so a store without domains is byte for byte the one of before), the generator draws:

* Per-domain offset directions ``o_d``: orthonormal, and orthogonal to ``c_img``, ``c_txt`` and the class
  directions' span as far as ``D`` allows (the style of a domain, which moves its whole cloud).
* Per-domain class directions ``U^d_k = nz(U_k + nu^d_k)``, ``nu^d_k ~ N(0, domain_eta^2 I / D)``: a class looks
  somewhat different in each domain, so a classifier fitted on one domain loses some accuracy on another.
* A class-signal factor ``f_d`` per domain: ``domain_signal`` (comma-separated) if given, else the ladder
  ``f_d = exp(-domain_signal_drop * d / (N - 1))`` (domain 0 is the easiest, domain N - 1 the hardest, like
  PACS's sketch or DomainNet's quickdraw, where CLIP zero-shot is far below photo / real).

Image of class y in domain d: ``x = nz(a c_img + domain_shift o_d + f_d b (U^d_y + s zeta @ U^d) + sigma xi /
sqrt(D))``. With ``train_min`` (a long tail) domain d's head class is class ``d K // N`` (the profile rotated),
so the domains also differ in class frequencies. Measured zero-shot per domain (18-template ensemble, 300 test
images per class and domain, seed 0): CIFAR-10 RN50 defaults with ``domains=4``: 67.8 / 59.1 / 49.7 / 41.6 %
(26 points from the best to the hardest domain). The presets (one template):
``pacs-vitb32`` art_painting 96.1, cartoon 96.0, photo 99.8, sketch 79.1 %; ``officehome-vitb32`` (40 per class)
Art 79.7, Clipart 61.0, Product 85.9, Real_World 88.5 %; ``office-caltech10-vitb32`` amazon 94.8, caltech 92.6,
dslr 96.1, webcam 94.3 %; ``domainnet-vitb32`` (10 per class) clipart 65.5, infograph 41.0, painting 60.9,
quickdraw 14.6, real 78.3, sketch 53.3 %. A domain store's ``synthetic_stats`` adds its own measure per domain
(``zeroshot_acc_ensemble/<name>``).

Rankings of methods on synthetic features are **not** evidence about real data: the generator only
mimics first- and second-order statistics of CLIP features.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from fedfeat.errors import FedfeatError
from fedfeat.store.featurestore import (
    FeatureStore,
    existing_store,
    half_created,
    path_arg,
    publish,
)
from fedfeat.store.format import longtail_counts

CIFAR10_CLASSES = [
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck",
]  # fmt: skip

# CLIP_benchmark's 18 CIFAR templates (the first one is fedfeat's single default template).
CIFAR_TEMPLATES = [
    "a photo of a {}.", "a blurry photo of a {}.", "a black and white photo of a {}.",
    "a low contrast photo of a {}.", "a high contrast photo of a {}.", "a bad photo of a {}.",
    "a good photo of a {}.", "a photo of a small {}.", "a photo of a big {}.", "a photo of the {}.",
    "a blurry photo of the {}.", "a black and white photo of the {}.", "a low contrast photo of the {}.",
    "a high contrast photo of the {}.", "a bad photo of the {}.", "a good photo of the {}.",
    "a photo of the small {}.", "a photo of the big {}.",
]  # fmt: skip


@dataclass(frozen=True)
class SynthParams:
    """Parameters of the generator (defaults: CIFAR-10 under RN50, see the module docstring)."""

    classes: int = 10  # K
    dim: int = 1024  # D (RN50's embedding size)
    train_per_class: int = 5000  # CIFAR-10: 50,000 training images
    # 0: every class has train_per_class training images; else a long-tailed train set (ImageNet-LT's stand-in):
    # class k has round(train_per_class * (train_min / train_per_class) ** (k / (K - 1))) images, the exponential
    # profile of Cui et al. 2019 (CIFAR-LT's), from train_per_class (class 0) down to train_min (class K - 1)
    train_min: int = 0
    test_per_class: int = 1000  # CIFAR-10: 10,000 test images
    templates: int = 18  # CLIP_benchmark's CIFAR template count
    seed: int = 0
    a: float = 0.7  # image-cone axis weight
    b: float = 0.35  # class-direction weight
    s: float = 0.32  # within-class spread along class directions (sets the probe accuracy)
    sigma: float = 0.5  # isotropic noise
    rho: float = 0.5  # super-class correlation of class directions
    a_t: float = 0.8  # text-cone axis weight
    m: float = 0.25  # shared image-axis component of text (sets image-text cosine level)
    b_t: float = 0.25  # class-direction weight of text
    eta: float = 1.05  # prompt misalignment (sets the zero-shot accuracy)
    bias_sd: float = 0.02  # per-class score offset (class bias of zero-shot predictions)
    tnoise: float = 0.25  # per-template noise
    # Domain shift (feature-shift federations: clients = domains; see the module docstring). 0: no domains, the
    # store of before; N: N domains, each with train_per_class / test_per_class images per class (N x the rows).
    domains: int = 0
    domain_names: str = ""  # comma-separated, one per domain; "": "domain 0", "domain 1", ...
    domain_shift: float = 0.3  # weight of each domain's own image-cone offset direction
    domain_eta: float = 0.4  # per-domain perturbation of the class directions (style changes appearance)
    domain_signal_drop: float = 0.7  # class-signal weight of domain d: b * exp(-drop * d / (N - 1))
    domain_signal: str = (
        ""  # comma-separated class-signal factors, one per domain (overrides the drop ladder)
    )


# Named parameter sets (``fedfeat synth --preset NAME``); flags given with the preset override its fields.
PRESETS = {
    # the default: CIFAR-10 under RN50, calibrated as the module docstring says
    "cifar10-rn50": SynthParams(),
    # Fed-MP's Caltech101 under ViT-L/14@336 (D = 768): 102 classes, 20 train + 30 test images each (5,100 in
    # all: 10 shots per client class, the rest for the query set), Fed-MP's one template. With 102 classes the
    # within-class spread (a sum over all K class directions) is scaled down to s = 0.1, and the prompt
    # misalignment set to eta = 0.7, so that zero-shot over all 102 classes measures ~93 % (our reading of the
    # level CLIP's large ViTs reach on Caltech101) and a 12-way novel split lands near the ~0.99 ceiling Fed-MP's
    # Table 1 reports for CLIP-based methods there. Which classes are novel is decided by the partition, not by
    # the generator: every class is drawn the same way, so novel prototypes are no closer to the clients'
    # classes than any other class's are. Not tuned to any method's result.
    "caltech101-vitl14": SynthParams(
        classes=102, dim=768, train_per_class=20, test_per_class=30, templates=1, s=0.1, eta=0.7
    ),
    # Domain-shift stand-ins under ViT-B/32 (D = 512, one template): clients = domains. The within-class spread
    # s follows ~0.32 * sqrt(10 / K) as above (lower for PACS / Office-Caltech10, whose zero-shot is near the
    # ceiling), eta sets the best domain's zero-shot, and ``domain_signal`` each domain's class-signal factor, set
    # so that zero-shot per domain lands near the levels reported for CLIP ViT-B/32 (our reading of the
    # domain-generalisation literature: PACS sketch ~20 points below photo, DomainNet quickdraw far below real).
    # Per-class counts are small (of the order of the datasets' per domain and class, DomainNet's much smaller).
    # What each measures is in the module docstring.
    "pacs-vitb32": SynthParams(
        classes=7, dim=512, train_per_class=200, test_per_class=50, templates=1, s=0.12, eta=0.3, domains=4,
        domain_names="art_painting,cartoon,photo,sketch", domain_signal="0.64,0.7,1,0.49",
    ),
    "officehome-vitb32": SynthParams(
        classes=65, dim=512, train_per_class=45, test_per_class=15, templates=1, s=0.125, eta=0.5, domains=4,
        domain_names="Art,Clipart,Product,Real_World", domain_signal="0.84,0.65,0.95,1",
    ),
    "office-caltech10-vitb32": SynthParams(
        classes=10, dim=512, train_per_class=45, test_per_class=15, templates=1, s=0.08, eta=0.1, rho=0.3,
        domains=4, domain_names="amazon,caltech,dslr,webcam", domain_signal="1,0.9,1,1",
    ),
    "domainnet-vitb32": SynthParams(
        classes=345, dim=512, train_per_class=20, test_per_class=5, templates=1, s=0.054, eta=0.85, domains=6,
        domain_names="clipart,infograph,painting,quickdraw,real,sketch", domain_signal="0.86,0.66,0.81,0.42,1,0.79",
    ),
}  # fmt: skip


def _nz(v: torch.Tensor) -> torch.Tensor:
    return v / v.norm(dim=-1, keepdim=True)


class SyntheticGenerator:
    """Draws images of given labels and the text prototypes for one parameter set."""

    def __init__(self, p: SynthParams):
        self.p = p
        g = torch.Generator().manual_seed(p.seed)
        self.g = g
        K, D = p.classes, p.dim
        Q, _ = torch.linalg.qr(torch.randn(D, 2, generator=g, dtype=torch.float64))
        self.c_img, self.c_txt = Q[:, 0].float(), Q[:, 1].float()  # [D], [D]
        G = max(2, math.ceil(K / 5))
        S = _nz(torch.randn(G, D, generator=g))  # [G, D]
        E = _nz(torch.randn(K, D, generator=g))  # [K, D]
        grp = torch.arange(K) % G
        self.U = _nz(p.rho * S[grp] + math.sqrt(1 - p.rho**2) * E)  # [K, D]
        nu = torch.randn(K, D, generator=g) * (p.eta / math.sqrt(D))
        bias = torch.randn(K, generator=g) * p.bias_sd
        base = p.a_t * self.c_txt + (p.m + bias[:, None]) * self.c_img + p.b_t * _nz(self.U + nu)  # [K, D]
        eps = torch.randn(p.templates, K, D, generator=g) * (p.tnoise * p.b_t / math.sqrt(D))
        self.text = _nz(base[None] + eps)  # [T, K, D]
        if p.domains:  # drawn after everything above, so that a store without domains is the one of before
            n = p.domains
            span = torch.cat([self.c_img[:, None], self.c_txt[:, None], self.U.T], 1).double()  # [D, K + 2]
            basis = torch.linalg.qr(span)[0][
                :, : max(0, min(K + 2, D - n))
            ]  # the axes first, then the classes
            R = torch.randn(D, n, generator=g, dtype=torch.float64)
            self.offsets = torch.linalg.qr(R - basis @ (basis.T @ R))[0].T.float()  # [n, D], orthonormal
            nud = torch.randn(n, K, D, generator=g) * (p.domain_eta / math.sqrt(D))
            self.U_dom = _nz(self.U[None] + nud)  # [n, K, D]
            self.signal = torch.tensor(domain_signal(p), dtype=torch.float32)  # [n]

    def images(self, labels: np.ndarray, domains: np.ndarray | None = None) -> torch.Tensor:
        """Unit-norm image features ``[N, D]`` for ``labels`` (draws from the generator's stream); ``domains``
        (``[N]`` ids, ``SynthParams.domains`` > 0 only): each row's domain."""
        p = self.p
        y = torch.as_tensor(labels, dtype=torch.long)
        n = len(y)
        zeta = torch.randn(n, p.classes, generator=self.g)
        xi = torch.randn(n, p.dim, generator=self.g)
        if domains is None:
            x = p.a * self.c_img + p.b * (self.U[y] + p.s * zeta @ self.U) + p.sigma * xi / math.sqrt(p.dim)
            return _nz(x)
        if not p.domains:
            raise FedfeatError("domains were given for a generator without domains (SynthParams.domains = 0)")
        dom = torch.as_tensor(domains, dtype=torch.long)
        x = torch.empty(n, p.dim)
        for d in range(p.domains):
            i = (dom == d).nonzero()[:, 0]
            Ud = self.U_dom[d]  # [K, D]
            x[i] = (
                p.a * self.c_img
                + p.domain_shift * self.offsets[d]
                + p.b * self.signal[d] * (Ud[y[i]] + p.s * zeta[i] @ Ud)
                + p.sigma * xi[i] / math.sqrt(p.dim)
            )
        return _nz(x)


def synthetic_stats(train_x, train_y, test_x, test_y, text, probe_steps: int = 100) -> dict:
    """Statistics to compare with real CLIP features: zero-shot (1 and all templates), probe, cosines.

    The linear probe is multinomial logistic regression on unit-norm features (L-BFGS, light L2),
    fitted on at most 10,000 training samples.
    """
    K = text.shape[1]
    t1 = text[0]
    tens = _nz(text.mean(0))
    cos = test_x @ t1.T  # [N, K]
    own = cos.gather(1, test_y[:, None])[:, 0]
    other = (cos.sum(1) - own) / (K - 1)
    pred = (test_x @ tens.T).argmax(1)
    share = torch.bincount(pred, minlength=K).float() / len(pred)
    sub = torch.randperm(len(train_y), generator=torch.Generator().manual_seed(0))[:10000]
    xs, ys = train_x[sub], train_y[sub]
    W = torch.zeros(K, xs.shape[1], requires_grad=True)
    bb = torch.zeros(K, requires_grad=True)
    opt = torch.optim.LBFGS([W, bb], max_iter=probe_steps, history_size=20, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(100 * xs @ W.T + bb, ys) + 1e-4 * (W**2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        probe = ((test_x @ W.T + bb).argmax(1) == test_y).float().mean().item()
    return {
        "zeroshot_acc_1_template": (cos.argmax(1) == test_y).float().mean().item(),
        "zeroshot_acc_ensemble": (pred == test_y).float().mean().item(),
        "linear_probe_acc": probe,
        "cos_image_own_prompt": own.mean().item(),
        "cos_image_other_prompts": other.mean().item(),
        "zeroshot_pred_share_min": share.min().item(),
        "zeroshot_pred_share_max": share.max().item(),
    }


def write_synthetic_store(
    out: str | Path,
    params: SynthParams = SynthParams(),
    *,
    force: bool = False,
    stats: bool = True,
    log=print,
) -> FeatureStore:
    """Write a synthetic store at ``out`` (deterministic from ``params.seed``).

    A complete store with the same parameters is kept as is; a different one needs ``force``; an
    incomplete one is simply rebuilt. The store is written in a temporary sibling directory
    (``.<name>.tmp-<pid>``) and renamed into place when complete, so a failure (a full disk, Ctrl-C)
    leaves nothing at ``out`` that looks like a store; a filesystem error is a one-line ``FedfeatError``.

    Example::

        >>> st = write_synthetic_store("cache/tiny.zarr", SynthParams(classes=3, dim=8, train_per_class=20,
        ...                            test_per_class=5, templates=2), stats=False, log=lambda *a: None)
        >>> st.features("train").shape
        (60, 8)
    """
    if not isinstance(params, SynthParams):
        raise FedfeatError(
            f"params must be a SynthParams, got {type(params).__name__}; e.g. SynthParams(classes=3, dim=8) or "
            "PRESETS['cifar10-rn50']"
        )
    p = params
    if p.classes < 2 or p.dim < 4 or p.train_per_class < 1 or p.test_per_class < 1 or p.templates < 1:
        raise FedfeatError(
            "synthetic store needs --classes >= 2, --dim >= 4, and >= 1 train/test sample per class and template"
        )
    out = Path(path_arg(out, "out"))
    if p.train_min < 0 or p.train_min > p.train_per_class:
        raise FedfeatError(
            f"train_min must be 0 (balanced) or 1..train_per_class ({p.train_per_class}), got {p.train_min}"
        )
    _check_domains(p)
    fingerprint = synth_fingerprint(p)
    st = existing_store(out, fingerprint, force, "--force", "--out", _replaceable)
    if st is not None:
        log(f"{out}: a complete synthetic store with these parameters exists; nothing to do")
        return st
    publish(
        out,
        lambda tmp: _write(tmp, p, fingerprint, stats, log),
        "writing the synthetic store",
        "free space or choose another --out",
    )
    return FeatureStore.open(out)


DOMAIN_FIELDS = (
    "domains",
    "domain_names",
    "domain_shift",
    "domain_eta",
    "domain_signal_drop",
    "domain_signal",
)


def _params_record(p: SynthParams) -> dict:
    """``p`` as recorded (fingerprint, attrs): ``train_min`` only where it is set, and the domain fields only where
    ``domains`` is (then all of them), so that the stores written before these fields existed keep their
    fingerprints."""
    d = asdict(p)
    if not d["train_min"]:
        del d["train_min"]
    if not d["domains"]:
        for k in DOMAIN_FIELDS:
            del d[k]
    return d


def synth_fingerprint(p: SynthParams) -> dict:
    """The fingerprint of the store ``p`` generates (``fingerprint_hash`` of it names the stand-in)."""
    return {"generator": "fedfeat.store.synth", **_params_record(p)}


def train_counts(p: SynthParams) -> np.ndarray:
    """Training images per class: ``train_per_class`` each, or the long tail ``train_min`` sets (``SynthParams``)."""
    return longtail_counts(p.classes, p.train_per_class, p.train_min)


def domain_train_counts(p: SynthParams, d: int) -> np.ndarray:
    """Training images per class of domain ``d``: ``train_counts`` with its head class moved to class
    ``d * K // domains`` (each domain has its own frequent classes when ``train_min`` sets a long tail)."""
    return np.roll(train_counts(p), d * p.classes // max(p.domains, 1))


def domain_name_list(p: SynthParams) -> list[str]:
    """The domains' names: ``domain_names`` split at commas, else "domain 0", "domain 1", ..."""
    if p.domain_names:
        return [n.strip() for n in p.domain_names.split(",")]
    return [f"domain {d}" for d in range(p.domains)]


def domain_signal(p: SynthParams) -> list[float]:
    """Each domain's class-signal factor: ``domain_signal`` split at commas, else ``exp(-drop * d / (N - 1))``."""
    if p.domain_signal:
        return [float(v) for v in p.domain_signal.split(",")]
    n = p.domains
    return [math.exp(-p.domain_signal_drop * d / max(n - 1, 1)) for d in range(n)]


def _check_domains(p: SynthParams) -> None:
    """One line for domain fields that make no sense together."""
    if not (isinstance(p.domains, int) and p.domains >= 0):
        raise FedfeatError(f"domains must be 0 (no domains) or a positive count, got {p.domains!r}")
    if not p.domains:
        dflt = SynthParams()
        given = [k for k in DOMAIN_FIELDS[1:] if getattr(p, k) != getattr(dflt, k)]
        if given:
            raise FedfeatError(f"{', '.join(given)} set without domains; set domains (--domains N) too")
        return
    if p.domains + 2 > p.dim:
        raise FedfeatError(f"{p.domains} domains need dim >= domains + 2, got dim {p.dim}")
    names = domain_name_list(p)
    if len(names) != p.domains or not all(names) or len(set(names)) != len(names):
        raise FedfeatError(
            f"domain_names must be {p.domains} distinct non-empty comma-separated names, got {p.domain_names!r}"
        )
    try:
        sig = domain_signal(p)
    except ValueError:
        sig = []
    if len(sig) != p.domains or not all(math.isfinite(v) and v > 0 for v in sig):
        raise FedfeatError(
            f"domain_signal must be {p.domains} positive comma-separated numbers, got {p.domain_signal!r}"
        )


def _replaceable(path: Path) -> bool:
    """An empty directory, or one left by a run killed inside ``FeatureStore.create`` (a zarr group without
    attributes holding only a store's own entries: ``half_created``): safe to replace. A folder of the user's
    files beside a ``zarr.json``, or a user's zarr group with attributes of its own, is not."""
    if not path.is_dir() or path.is_symlink():
        return False
    if not (path / "zarr.json").is_file():
        return not any(path.iterdir())
    return half_created(path, {"train", "test"})


def _write(tmp: Path, p: SynthParams, fingerprint: dict, stats: bool, log) -> None:
    """Write the complete synthetic store at ``tmp``."""
    gen = SyntheticGenerator(p)
    rng = np.random.RandomState(p.seed)  # dataset order is shuffled, as in real datasets
    domains = dom_kw = None
    if not p.domains:
        labels = {
            "train": rng.permutation(np.repeat(np.arange(p.classes), train_counts(p))),
            "test": rng.permutation(np.repeat(np.arange(p.classes), p.test_per_class)),
        }
    else:  # each domain its own rows, the domains mixed in the split's order
        labels, domains = {}, {}
        for split in ("train", "test"):
            counts = [domain_train_counts(p, d) if split == "train" else np.full(p.classes, p.test_per_class)
                      for d in range(p.domains)]  # fmt: skip
            y = np.concatenate([np.repeat(np.arange(p.classes), c) for c in counts])
            dom = np.concatenate([np.full(int(c.sum()), d) for d, c in enumerate(counts)])
            order = rng.permutation(len(y))
            labels[split], domains[split] = y[order], dom[order]
        dom_kw = {"domains": domains, "domain_names": domain_name_list(p)}
    names = CIFAR10_CLASSES if p.classes == 10 else [f"class {k}" for k in range(p.classes)]
    templates = [
        CIFAR_TEMPLATES[j] if j < len(CIFAR_TEMPLATES) else f"template {j} of a {{}}."
        for j in range(p.templates)
    ]
    st = FeatureStore.create(
        tmp,
        backbone="synthetic",
        pretrained="none",
        embed_dim=p.dim,
        logit_scale=100.0,
        class_names=names,
        templates=templates,
        preprocessing={"kind": "synthetic"},
        fingerprint=fingerprint,
        labels=labels,
        extra_attrs={"dataset": "synthetic", "synth_params": _params_record(p)},
        **(dom_kw or {}),
    )
    feats = {}
    for split in ("train", "test"):
        x = gen.images(labels[split], None if domains is None else domains[split])  # [N, D]
        feats[split] = x
        xh = x.numpy().astype(np.float16)
        for i in range(st.n_chunks(split)):
            st.write_chunk(split, i, xh[st.chunk_slice(split, i)])
    st.write_text(gen.text.numpy())
    if stats:
        f16 = {k: torch.from_numpy(v.numpy().astype(np.float16)).float() for k, v in feats.items()}
        s = synthetic_stats(
            f16["train"],
            torch.from_numpy(labels["train"]),
            f16["test"],
            torch.from_numpy(labels["test"]),
            torch.from_numpy(gen.text.numpy().astype(np.float16)).float(),
        )
        if domains is not None:  # zero-shot (all templates) per domain: how much harder each domain is
            tens = _nz(torch.from_numpy(gen.text.numpy().astype(np.float16)).float().mean(0))
            pred = (f16["test"] @ tens.T).argmax(1).numpy()
            for d, name in enumerate(domain_name_list(p)):
                i = domains["test"] == d
                s[f"zeroshot_acc_ensemble/{name}"] = float((pred[i] == labels["test"][i]).mean())
        st.update_attrs(synthetic_stats=s)
        log("synthetic store statistics: " + ", ".join(f"{k} {v:.3f}" for k, v in s.items()))
    st.mark_complete()
