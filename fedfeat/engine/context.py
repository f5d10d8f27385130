"""What a method's hooks see and the plan of a round: ``Context`` (the run's tensors on the device, client-major),
``Batch`` (one local step of the active clients, ``[n, B, D]`` with a mask), ``RoundPlan`` (sampled clients in
descending order of local steps) and the helpers that cut a client's epoch into mini-batches from counter-based
keys, the same in the batched engine, the loop engine and the fused kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from fedfeat.engine import rng


class LabelAccessError(RuntimeError):
    """An unlabelled method tried to read training labels."""


@dataclass
class Batch:
    """One local step's mini-batches of the ``n`` active clients."""

    x: torch.Tensor  # [n, B, D] features (rows past a client's batch are padding)
    mask: torch.Tensor  # [n, B] bool, True for real samples
    pos: torch.Tensor  # [n, B] int64 client-major positions of the samples (padding: 0)
    n: int  # active clients: the first n of the round's client axis
    epoch: int
    step: int
    _y: torch.Tensor | None = None  # [n, B] labels, only for methods that use labels

    @property
    def y(self) -> torch.Tensor:
        if self._y is None:
            raise LabelAccessError("this method is declared label-free and may not read training labels")
        return self._y

    @property
    def count(self) -> torch.Tensor:
        """``[n]`` real samples per client in this batch (as float)."""
        return self.mask.sum(1).to(self.x.dtype)


def masked_mean(v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-client mean of ``v  # [n, B]`` over real samples -> ``[n]`` (0 where a client has none)."""
    m = mask.to(v.dtype)
    return (v * m).sum(1) / m.sum(1).clamp_min(1)


# the state the engine itself keeps in ``ctx.state`` (declared once here; a method declares its own in ``state_keys``)
ENGINE_STATE_KEYS: dict[str, str] = {
    "round_buffers": "engine scratch: {name: [m, ...] tensor} reused from round to round by round_buffer (the fused "
    "kernels' per-client buffers); not checkpointed (checkpoint.TRANSIENT)",
    "carried_optimizer": "engine, server: {'state': the one optimiser's state} carried from client to client and "
    "round to round by rounds.run_carried (methods whose optimizer_state is 'carried')",
    "dp": "engine, server: {'clip': the clipping norm C (adaptive clipping moves it), 'round': the last round's DP "
    "figures} (fedfeat.engine.privacy; DP runs only)",
}


class UndeclaredStateError(KeyError):
    """A write of a ``ctx.state`` key that neither the method (``state_keys``) nor the engine declares."""

    def __str__(self) -> str:  # one plain line (KeyError's own str() quotes its message)
        return str(self.args[0]) if self.args else ""


class MethodState(dict):
    """``ctx.state``: a run's persistent method state (checkpointed), a dict whose keys are declared. Writing a key
    (``[]=``, ``setdefault``, ``update``, ``|=``) that is not among ``declared`` raises ``UndeclaredStateError`` (a
    ``KeyError``) naming the method, the key and where to declare it; reads are a plain dict's. ``declared=None``: no
    check (a ``Context`` made by hand, as unit tests do). ``state_for(method)`` makes a method's.

    Example::

        >>> st = MethodState({"q": "per-sample soft labels [N, K]"}, owner="fst-cbdg", where="FSTCBDG")
        >>> st["q"] = 1
        >>> try:
        ...     st["qq"] = 2
        ... except KeyError as e:
        ...     print(str(e)[:56])
        method fst-cbdg wrote ctx.state['qq'], which it does not
    """

    __slots__ = ("declared", "owner", "where")

    def __init__(self, declared: dict[str, str] | None = None, owner: str = "", where: str = "", *args, **kw):
        self.declared, self.owner, self.where = declared, owner, where
        super().__init__()
        if args or kw:
            self.update(*args, **kw)

    def _check(self, key) -> None:
        if self.declared is not None and key not in self.declared:
            raise UndeclaredStateError(
                f"method {self.owner or '?'} wrote ctx.state[{key!r}], which it does not declare; add it to "
                f"{self.where or 'its class'}.state_keys ({{name: one line of doc}}); declared: "
                f"{', '.join(k for k in self.declared if k not in ENGINE_STATE_KEYS) or 'nothing'}"
            )

    def __setitem__(self, key, value) -> None:
        self._check(key)
        super().__setitem__(key, value)

    def setdefault(self, key, default=None):
        if key not in self:
            self._check(key)
        return super().setdefault(key, default)

    def update(self, *args, **kw) -> None:
        new = dict(*args, **kw)
        for k in new:
            self._check(k)
        super().update(new)

    def __ior__(self, other):
        self.update(other)
        return self

    def __reduce__(self):  # copy / pickle: rebuilt with its declaration, then its items
        return (type(self), (self.declared, self.owner, self.where), None, None, iter(self.items()))


def state_for(method) -> MethodState:
    """An empty ``ctx.state`` for ``method``: its declared keys (``type(method).declared_state()``: every
    ``state_keys`` of its classes) and the engine's (``ENGINE_STATE_KEYS``)."""
    cls = type(method)
    own = (
        cls.declared_state() if hasattr(cls, "declared_state") else dict(getattr(cls, "state_keys", {}) or {})
    )
    return MethodState(
        {**ENGINE_STATE_KEYS, **own},
        owner=getattr(method, "name", "") or cls.__qualname__,
        where=f"{cls.__module__}.{cls.__qualname__}",
    )


@dataclass
class Context:
    """What a method sees of the data. ``labels`` is None for label-free methods."""

    device: torch.device
    feats: torch.Tensor  # [N, D] training features, client-major, normalised as the method asked
    offsets: torch.Tensor  # [clients + 1] int64 (cpu)
    text: torch.Tensor  # [K, D] class text embeddings (normalised, template choice applied)
    text_all: torch.Tensor  # [T, K, D] every template's embeddings (normalised)
    test_x: torch.Tensor  # [N_test, D]
    clip_logit_scale: float  # the encoder's own logit scale (CLIP: 100)
    seed: int
    n_clients: int
    labels: torch.Tensor | None = None  # [N] client-major training labels, None for label-free methods
    train_counts: torch.Tensor | None = None  # [K] training samples per class (labelled methods only)
    # persistent method state (per-sample / per-client tensors, checkpointed): keys declared by the method
    # (``Method.state_keys``) or the engine (``ENGINE_STATE_KEYS``); ``build_context`` makes it (``state_for``)
    state: MethodState = field(default_factory=MethodState)
    threads: int = 1  # CPU threads of a fused kernel (torch's thread count when the run began)
    open_vocab: object | None = (
        None  # fedfeat.partition.openvocab.OpenVocab (normalised like feats) in that setting
    )
    text_raw: torch.Tensor | None = None  # [K, D] ``text`` before L2 normalisation (Fed-MP's residuals)
    live: object | None = (
        None  # fedfeat.encoders.live.LiveText: the store's frozen text encoder (prompt methods only)
    )
    class_names: list[str] = field(default_factory=list)
    rounds: int = 0  # the run's number of rounds (learning-rate schedules over the run)
    local_test: list | None = None  # per client: int64 rows of test_x (FedCoPL's local test splits), or None
    val_mask: torch.Tensor | None = (
        None  # [N_test] bool: test_x rows held out for validation (--val-split), or None
    )
    cache: dict = field(default_factory=dict)  # derived read-only tensors (never checkpointed: not ``state``)
    store: object | None = None  # the FeatureStore (live image methods read its pixels)
    train_rows: np.ndarray | None = None  # [N] store rows of the client-major training samples
    test_rows: np.ndarray | None = None  # [N_test] store rows of test_x
    # a store that records domains: each test row's domain id, the domains' names, and (a combined store, one domain
    # per dataset: ``fedfeat combine``) each domain's class ids, the vocabulary its test rows are predicted over
    test_domains: torch.Tensor | None = None  # [N_test] int64
    domain_names: list | None = None
    domain_classes: list | None = None
    # the learning rate of this round's optimiser as the engine made it (``method.make_optimizer(rnd).lr``: a decay
    # schedule applied), set before ``local_begin``; None before the first round's local update
    lr_round: float | None = None
    dp: object | None = None  # fedfeat.engine.privacy.DPConfig of a differentially private run, else None

    def test_xT(self) -> torch.Tensor:
        """``test_x`` transposed to ``[D, N_test]``, contiguous, made once: a linear head's test logits as
        ``W @ X^T`` (class-major) ran 1.6x faster than ``X @ W^T`` on a CPU thread (10,000 x 1024, K = 10)."""
        if "test_xT" not in self.cache:
            self.cache["test_xT"] = self.test_x.T.contiguous()
        return self.cache["test_xT"]

    @property
    def K(self) -> int:
        return self.text.shape[0]

    @property
    def D(self) -> int:
        return self.text.shape[1]

    def sizes(self, clients: torch.Tensor) -> torch.Tensor:
        """``[m]`` sample counts of the given clients."""
        o = self.offsets
        return o[clients + 1] - o[clients]


@dataclass
class RoundPlan:
    """The clients of one round in engine order and their step counts."""

    rnd: int
    clients: torch.Tensor  # [m] client ids, ordered by descending steps per epoch
    sizes: torch.Tensor  # [m] samples per client
    steps: torch.Tensor  # [m] local steps per epoch
    batch_size: int
    epochs: int

    @property
    def m(self) -> int:
        return len(self.clients)

    @property
    def local_steps(self) -> torch.Tensor:
        """``[m]`` local steps of each client in the round (all its epochs): the optimizer steps the engine makes."""
        return self.steps * self.epochs

    def active(self, step: int) -> int:
        """Clients still training at ``step`` of an epoch (a prefix of the client axis)."""
        return int((self.steps > step).sum())

    @property
    def images(self) -> int:
        """Training images the round's clients process: each client's samples x local epochs (summary.json's
        ``seconds_per_image`` divides the rounds' training time by their sum)."""
        return int(self.sizes.sum()) * int(self.epochs)


def trainable_params(cparams: dict[str, torch.Tensor], m: int) -> int:
    """Parameters one client trains: the elements of its slice of the round's client parameters ``{name: [m, ...]}``
    (the global parameters it starts from and its own, e.g. Fed-MP's residuals); 0 in a round without clients."""
    return int(sum(v.numel() for v in cparams.values()) // m) if m else 0


COMPILED_SAMPLING_FROM = (
    4096  # clients from which sample_clients runs numpy's choice compiled (the same draws)
)


def sample_clients(seed: int, rnd: int, n_clients: int, participation: float) -> np.ndarray:
    """``max(1, int(participation * n_clients))`` distinct clients, from a stream keyed by (seed, round): numpy's
    ``RandomState(key).choice(n_clients, m, replace=False)``, sorted. From ``COMPILED_SAMPLING_FROM`` clients the
    same draws run compiled (``fedfeat.engine.sampling``: bit for bit, ~2x faster at 100,000 clients)."""
    m = max(1, int(participation * n_clients))
    if m >= n_clients:
        return np.arange(n_clients)
    if n_clients >= COMPILED_SAMPLING_FROM:
        from fedfeat.engine.sampling import legacy_choice

        return np.sort(
            legacy_choice(rng.stream_key(seed, rnd, rng.TAG_SAMPLE_CLIENTS) % (2**32), n_clients, m)
        )
    return np.sort(rng.numpy_rng(seed, rnd, rng.TAG_SAMPLE_CLIENTS).choice(n_clients, m, replace=False))


def make_plan(ctx: Context, rnd: int, clients: np.ndarray, batch_size: int, epochs: int) -> RoundPlan:
    c = torch.as_tensor(np.asarray(clients), dtype=torch.int64)
    sizes = ctx.sizes(c)
    steps = (sizes + batch_size - 1) // batch_size
    order = torch.argsort(-steps, stable=True)
    return RoundPlan(rnd, c[order], sizes[order], steps[order], batch_size, epochs)


def plan_rows(ctx: Context, plan: RoundPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plan's samples, client after client: ``seg  # [M]`` client slot, ``local  # [M]`` index within
    the client, ``pos  # [M]`` client-major position (all int64, cpu)."""
    sizes = plan.sizes
    seg = torch.repeat_interleave(torch.arange(plan.m), sizes)
    local = torch.arange(int(sizes.sum())) - torch.repeat_interleave(torch.cumsum(sizes, 0) - sizes, sizes)
    return seg, local, ctx.offsets[plan.clients][seg] + local


def shuffle_key(ctx: Context, plan: RoundPlan, epoch: int) -> int:
    """The stream key of this round's epoch's shuffles (a sample's key: ``rng.uniform_keys(key, position)``)."""
    return rng.stream_key(ctx.seed, plan.rnd, epoch, rng.TAG_SHUFFLE)


def fused_batches(ctx: Context, plan: RoundPlan, epoch: int) -> dict:
    """What a fused kernel needs to cut the epoch into ``epoch_tables``' mini-batches itself: each client's
    first client-major row and size (numpy int64), the batch size and the shuffle key."""
    return {
        "starts": ctx.offsets[plan.clients].numpy(),
        "sizes": plan.sizes.numpy(),
        "B": plan.batch_size,
        "key": shuffle_key(ctx, plan, epoch),
    }


def epoch_tables(ctx: Context, plan: RoundPlan, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Shuffled mini-batch positions for one epoch: ``idx  # [S, m, B]`` (int64) and ``mask  # [S, m, B]``.

    Client j's samples are sorted by a counter-based key of (seed, round, epoch, position); its r-th sample
    in that order goes to step ``r // B``, slot ``r % B`` (the last batch is smaller: ``drop_last=False``).
    """
    B = plan.batch_size
    seg, local, pos = plan_rows(ctx, plan)  # [M] client slot, index within client, client-major position
    key = rng.uniform_keys(shuffle_key(ctx, plan, epoch), pos)
    # sort by (segment, key): segment-major composite sort, keys are < 2^62 so sort keys then stable by seg
    o1 = torch.argsort(key, stable=True)
    o2 = torch.argsort(seg[o1], stable=True)
    perm = o1[o2]  # items grouped by client, shuffled within client
    pos_sorted = pos[perm]
    rank = local  # after grouping, the r-th item of segment j sits at offset start_j + r
    S = int(plan.steps.max()) if plan.m else 0
    idx = torch.zeros(S, plan.m, B, dtype=torch.int64)
    mask = torch.zeros(S, plan.m, B, dtype=torch.bool)
    idx[rank // B, seg, rank % B] = pos_sorted
    mask[rank // B, seg, rank % B] = True
    return idx, mask


def round_buffer(ctx: Context, name: str, m: int, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised ``[m, *like.shape]`` tensor for the fused kernels' per-client state (and FST-CBDG's noise
    bank), the same memory from round to round (a fresh one would be new pages, which the OS zeroes on first
    touch: at 10,000 clients ~1 GB a round and most of its time). Valid until the next round's local update."""
    pool = ctx.state.setdefault("round_buffers", {})
    t = pool.get(name)
    if t is None or t.shape[0] < m or t.shape[1:] != like.shape or t.dtype != like.dtype:
        t = pool[name] = torch.empty((m, *like.shape), dtype=like.dtype, device=like.device)
    return t[:m]


def fedavg(params: dict[str, torch.Tensor], weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """Weighted average over the client axis (``weights  # [m]``, normalised here)."""
    w = weights.to(next(iter(params.values())).dtype)
    w = w / w.sum()
    return {k: torch.tensordot(w, v, dims=1) for k, v in params.items()}


def param_bytes(params: dict[str, torch.Tensor]) -> int:
    return int(sum(v.numel() * v.element_size() for v in params.values()))
