"""Differential privacy on the batched path: client-level DP-FedAvg and sample-level DP-SGD.

**Client level** (``mode="client"``; McMahan et al. 2018, "Learning Differentially Private Recurrent Language
Models", Algorithm 1 with every client weight 1): each sampled client's update ``Delta_i = theta_i - theta`` (every
parameter the server aggregates, flattened together) is clipped to L2 norm ``C``, the server averages the clipped
updates **uniformly** over the round's ``m`` sampled clients (not by sample count: a count would be a second,
unbounded release) and adds ``N(0, (z C / m)^2)`` to every coordinate; the method's server step (a server optimiser,
FST-CBDG's nothing, CReFF's re-training) then runs on that noisy average, which is post-processing. This is what
Flower's ``DifferentialPrivacyServerSideFixedClipping`` computes (``flwr.common.differential_privacy``: FlatClip,
``compute_stdv = z C / m``) with a uniform strategy; ``tests/test_privacy.py`` checks a transcription of it.

``clip="adaptive"`` is Andrew et al. 2021 ("Differentially Private Learning with Adaptive Clipping"): with
``b_i = 1[||Delta_i|| <= C]``, ``b~ = (sum_i b_i + N(0, sigma_b^2)) / m`` and ``C <- C exp(-eta (b~ - gamma))``
after the round (this round's updates are clipped and noised at this round's ``C``); the updates' noise multiplier is
``z_Delta = (z^-2 - (2 sigma_b)^-2)^-1/2`` so that the round, update and count query together, is one Gaussian
mechanism of multiplier ``z`` (what the accountant is told). Defaults: ``gamma = 0.5``, ``eta = 0.2``,
``sigma_b = m / 20`` (the paper's and Flower's). A reading named here: Flower @ fdef7af's server-side adaptive
clipping counts the *clipped* updates as ``norm_bit`` and moves ``C`` the way the paper moves it for the
*unclipped* ones, and noises the round with the *updated* ``C``; fedfeat follows the paper (a clipped majority raises
``C``), and the transcription test shows Flower's rule drives ``C`` the other way.

**Sample level** (``mode="sample"``; Abadi et al. 2016, DP-SGD in every local step): each sample's gradient is
clipped to ``C``, the clipped gradients of a client's batch are summed, ``N(0, z^2 C^2)`` is added per coordinate and
the sum is divided by the batch size ``B`` (the expected batch, as Opacus); a data-independent regulariser (FedProx's
proximal term) is differentiated exactly. Per-sample gradients cost little where the model is small:

* a linear head (``dp_sample = "head"``): the gradient of sample ``i`` is ``s * g_i (x) [x_i, 1]`` with ``g_i`` its
  loss's gradient w.r.t. its logits, so its norm is ``s ||g_i|| sqrt(||x_i||^2 + 1)`` and the clipped sum is one
  ``bmm`` -- the cost of the plain step;
* text prompts (``dp_sample = "text"``): the loss reaches the context only through the class text features ``t``
  (``[K, D]`` per client), so sample ``i``'s gradient is ``J^T (s g_i (x) x_i)`` with ``J = dt/dctx``; the norms take
  one batched vector-Jacobian product over the batch (``autograd.grad(..., is_grads_batched=True)``, in chunks of
  ``vjp_chunk`` samples) and the clipped sum one ordinary backward pass.

Methods declare which level they support (capabilities ``dp_client``, ``dp_sample``); a run asks for the other and
is refused in one line.

**Noise** is counter-based like the rest of the engine (``fedfeat.engine.rng``): a standard normal per coordinate
from splitmix64 hashes of (run seed, round, epoch, step, client id, coordinate) and Box-Muller in float64, so a DP
run is bit-reproducible, the batched engine equals the loop, and a resumed run equals the uninterrupted one. It is a
research generator, not a cryptographic one (floating-point noise is not hardened against Mironov's 2012 attack).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from fedfeat.engine import rng
from fedfeat.errors import FedfeatError

TAG_DP_CLIENT = 61  # the server's noise on the aggregate, per round
TAG_DP_COUNT = 62  # adaptive clipping's noise on the unclipped count, per round
TAG_DP_SAMPLE = 63  # DP-SGD's noise per (round, epoch, step, client)
TAG_DP_UPLOAD = 64  # noise on a method's extra uploads (CReFF / CLIP2FL's class gradients), per round

MODES = ("client", "sample")


@dataclass(frozen=True)
class DPConfig:
    """A run's differential privacy: what ``--dp`` and its flags ask for, the noise multiplier resolved (from
    ``--epsilon`` by the accountant, ``fedfeat.engine.accountant``)."""

    mode: str  # "client" or "sample"
    noise_multiplier: (
        float | None
    )  # z: the Gaussian mechanism's std over the sensitivity (adaptive: the round's
    # total); None: calibrated to ``epsilon`` over the run (``prepare``)
    clip_norm: float  # C (adaptive clipping: the initial C)
    delta: float = 1e-5
    clip: str = "fixed"  # "fixed" or "adaptive" (client level)
    target_quantile: float = 0.5  # gamma
    clip_lr: float = 0.2  # eta
    count_std: float | None = None  # sigma_b (default m / 20)
    accountant: str = "rdp"
    epsilon: float | None = None  # the target the noise multiplier was calibrated to, when one was given
    vjp_chunk: int = (
        8  # text prompts: samples per batched vector-Jacobian product (8 ran 1.4x faster than 32)
    )
    calibrated: bool = False  # the noise multiplier was calibrated to ``epsilon`` (``prepare``)

    def __post_init__(self):
        if self.mode not in MODES:
            raise FedfeatError(f"--dp must be client or sample, got {self.mode!r}")
        if self.clip not in ("fixed", "adaptive"):
            raise FedfeatError(f"--dp-clip must be fixed or adaptive, got {self.clip!r}")
        if self.clip == "adaptive" and self.mode != "client":
            raise FedfeatError("--dp-clip adaptive clips client updates; use it with --dp client")
        if self.noise_multiplier is None and self.epsilon is None:
            raise FedfeatError("--dp needs --epsilon E (the target) or --noise-multiplier Z")
        if self.noise_multiplier is not None and self.epsilon is not None and not self.calibrated:
            raise FedfeatError("give --epsilon (calibrates the noise) or --noise-multiplier, not both")
        z = self.noise_multiplier
        if z is not None and not (z >= 0 and math.isfinite(z)):
            raise FedfeatError(f"--noise-multiplier must be >= 0, got {z}")
        if self.epsilon is not None and not (self.epsilon > 0 and math.isfinite(self.epsilon)):
            raise FedfeatError(f"--epsilon must be > 0, got {self.epsilon}")
        if not self.clip_norm > 0:
            raise FedfeatError(f"--clip-norm must be > 0, got {self.clip_norm}")

    def update_multiplier(self, m: int) -> tuple[float, float]:
        """``(z_Delta, sigma_b)``: the updates' noise multiplier and the count's noise std of a round of ``m``
        clients (adaptive clipping); ``(z, 0)`` for fixed clipping."""
        if self.clip != "adaptive":
            return self.noise_multiplier, 0.0
        sb = self.count_std if self.count_std is not None else m / 20
        z = self.noise_multiplier
        if z == 0:
            return 0.0, sb
        if z >= 2 * sb:
            raise FedfeatError(
                f"adaptive clipping: the noise multiplier {z:g} must be below 2 x the count's noise std "
                f"({2 * sb:g}; default m / 20 with m = {m} clients a round); raise --dp-count-std or the clients per "
                "round, or use --dp-clip fixed"
            )
        return (z**-2 - (2 * sb) ** -2) ** -0.5, sb


def gaussian(key: int, ids: torch.Tensor, numel: int, device=None, threads: int = 1) -> torch.Tensor:
    """``[len(ids), numel]`` float64 standard normals, a pure function of ``(key, id, coordinate)``: pair ``j`` of
    client ``id`` from the uniforms of ``rng.uniform_keys`` at positions ``id * 2h + 2j`` and ``+ 1`` (53 bits each,
    in (0, 1]; ``h = ceil(numel / 2)``) by Box-Muller, its cosine at ``j`` and its sine at ``h + j``. On a CPU one
    compiled pass (``kernels.dp_normals``); on another device (``device``) the same arithmetic as a torch program
    there (its transcendental functions may round differently from the CPU's in the last bit)."""
    ids = ids.to(torch.int64).view(-1).cpu()
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cpu":
        from fedfeat.engine import kernels

        return torch.from_numpy(kernels.dp_normals(key, ids.numpy(), numel, threads))
    half = (numel + 1) // 2
    items = ids.to(dev).view(-1, 1) * (2 * half) + torch.arange(2 * half, dtype=torch.int64, device=dev).view(
        1, -1
    )
    u = ((rng.uniform_keys(key, items) >> 9) + 1).to(torch.float64) * 2.0**-53  # (0, 1]
    rad, t = torch.sqrt(-2.0 * torch.log(u[:, 0::2])), 2.0 * math.pi * u[:, 1::2]
    return torch.cat([rad * torch.cos(t), rad * torch.sin(t)], 1)[:, :numel]


def flat_norms(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[m]`` L2 norms of each client's tensors flattened together (``{name: [m, ...]}``), in float64."""
    return torch.sqrt(sum(v.detach().double().flatten(1).pow(2).sum(1) for v in tensors.values()))


def clip_factors(norms: torch.Tensor, C: float) -> torch.Tensor:
    """``min(1, C / norm)`` (1 for a zero norm)."""
    return torch.where(norms > C, C / norms.clamp_min(1e-300), torch.ones_like(norms))


def add_noise(
    tensors: dict[str, torch.Tensor], std, key: int, ids: torch.Tensor, threads: int = 1
) -> dict[str, torch.Tensor]:
    """``tensors  # {name: [m, ...]}`` plus ``std * N(0, 1)`` per coordinate (``std`` a number or ``[m]``), drawn
    for client ``ids  # [m]`` in the tensors' sorted name order, on the tensors' device."""
    names = sorted(tensors)
    m = len(ids)
    sizes = [tensors[k][0].numel() if tensors[k].shape[0] else 0 for k in names]
    dev = tensors[names[0]].device
    noise = gaussian(key, ids, sum(sizes), device=dev, threads=threads)  # [m, total]
    std = torch.as_tensor(std, dtype=torch.float64).reshape(-1, 1) if not isinstance(std, float) else std
    noise = noise * std
    out, at = {}, 0
    for k, n in zip(names, sizes):
        v = tensors[k]
        out[k] = v + noise[:, at : at + n].reshape(m, *v.shape[1:]).to(device=v.device, dtype=v.dtype)
        at += n
    return out


def client_aggregate(ctx, plan, glob: dict, cparams: dict, parts: int = 1) -> dict:
    """DP-FedAvg's server step: the round's clipped client updates averaged uniformly over the ``m`` sampled
    clients, plus Gaussian noise (``DPConfig``); adaptive clipping's ``C`` moves after the round. Records the
    round's figures in ``ctx.state["dp"]["round"]``."""
    dp: DPConfig = ctx.dp
    st = ctx.state["dp"]
    m = plan.m
    C = float(st["clip"])
    z_upd, sb = dp.update_multiplier(max(m, 1))
    if m == 0:
        st["round"] = {"dp_clip": C}
        return glob
    deltas = {k: cparams[k] - glob[k].unsqueeze(0) for k in glob}
    norms = flat_norms(deltas)
    f = clip_factors(norms, C)
    mean = {k: torch.tensordot(f.to(d.device, d.dtype), d, dims=1) / m for k, d in deltas.items()}
    key = rng.stream_key(ctx.seed, plan.rnd, TAG_DP_CLIENT)
    std = z_upd * math.sqrt(parts) * C / m  # parts: the clipped parts a client uploads (Method.dp_parts)
    noisy = add_noise({k: v.unsqueeze(0) for k, v in mean.items()}, std, key, torch.zeros(1))
    new = {k: glob[k] + noisy[k][0] for k in glob}
    row = {"dp_clip": C, "dp_update_norm": float(norms.median())}
    if dp.clip == "adaptive":
        unclipped = float((norms <= C).sum())
        noise = float(gaussian(rng.stream_key(ctx.seed, plan.rnd, TAG_DP_COUNT), torch.zeros(1), 1)[0, 0])
        frac = (unclipped + sb * noise) / m
        st["clip"] = C * math.exp(-dp.clip_lr * (frac - dp.target_quantile))
        row["dp_unclipped_noisy"] = frac
    st["round"] = row
    return new


def sample_noise(ctx, plan, sums: dict, ids: torch.Tensor, epoch: int, step: int, batch_size: int) -> dict:
    """DP-SGD's noisy mean gradient of each active client: ``(clipped sum + z C N(0, 1)) / B``."""
    dp: DPConfig = ctx.dp
    key = rng.stream_key(ctx.seed, plan.rnd, epoch, step, TAG_DP_SAMPLE)
    noisy = add_noise(sums, dp.noise_multiplier * dp.clip_norm, key, ids, threads=getattr(ctx, "threads", 1))
    return {k: v / batch_size for k, v in noisy.items()}


def tasks(
    dp: DPConfig, sizes: list[int], method, participation: float, rounds: int
) -> list[tuple[float, int]]:
    """The accountant's ``(sampling rate, steps)`` of ``rounds`` rounds (``fedfeat.engine.accountant``);
    ``sizes``: every client's training samples."""
    from fedfeat.engine import accountant

    if dp.mode == "client":
        n = len(sizes)
        return accountant.client_tasks(n, max(1, int(participation * n)), rounds)
    return accountant.sample_tasks(sizes, int(method.p.batch_size), int(method.p.local_epochs), rounds)


def check_delta(dp: DPConfig, n: int) -> None:
    """delta below 1/n (n: the clients at client level, the training samples at sample level), in one line."""
    if not 0 < dp.delta < 1 / max(n, 1):
        what = "clients" if dp.mode == "client" else "training samples"
        raise FedfeatError(
            f"--delta {dp.delta:g} must be in (0, 1/{n}) ({n} {what}: a larger delta allows publishing one of them "
            f"outright); e.g. --delta {10 ** math.floor(math.log10(0.1 / max(n, 1))):g}"
        )


def prepare(dp: DPConfig, sizes: list[int], method, participation: float, rounds: int):
    """``(dp with its noise multiplier, epsilon_after(rnd))`` of a federation whose clients hold ``sizes`` training
    samples: delta checked, the multiplier calibrated to ``dp.epsilon`` over the run's ``rounds`` when none was given,
    adaptive clipping's room checked (each a one-line error); ``epsilon_after(r)``: what ``r`` rounds spend at
    ``dp.delta``. ``fedfeat.runs.train`` calls it before anything is written, the engine again (its accountant's
    curves are cached: the second call costs nothing)."""
    from fedfeat.engine import accountant

    sizes = [int(n) for n in sizes]
    check_delta(dp, len(sizes) if dp.mode == "client" else sum(sizes))
    if dp.noise_multiplier is None:
        z = accountant.calibrate(
            tasks(dp, sizes, method, participation, rounds), dp.epsilon, dp.delta, dp.accountant
        )
        dp = dataclasses.replace(dp, noise_multiplier=z, calibrated=True)
    if dp.clip == "adaptive":  # the count's noise must leave room for the updates'
        dp.update_multiplier(max(1, int(participation * len(sizes))))
    cache: dict[int, float] = {}

    def epsilon_after(r: int) -> float:
        if r not in cache:
            cache[r] = accountant.worst_epsilon(
                tasks(dp, sizes, method, participation, r), dp.noise_multiplier, dp.delta, dp.accountant
            )
        return cache[r]

    return dp, epsilon_after


def client_sizes(ctx) -> list[int]:
    """Every client's training samples (``ctx.offsets``)."""
    return (ctx.offsets[1:] - ctx.offsets[:-1]).tolist()


def aggregate(method, ctx, plan, glob: dict, cparams: dict) -> dict:
    """The server's aggregate of a client-level DP round, in place of ``method.aggregate``: the method keeps what
    never leaves its clients (``keep_local``), then ``client_aggregate`` over its uploaded parts (``dp_parts``)."""
    method.keep_local(ctx, plan, cparams)
    return client_aggregate(ctx, plan, glob, cparams, parts=method.dp_parts())


def round_row(ctx, epsilon_after, rnd: int) -> dict:
    """A DP round's metrics-row figures: epsilon spent after ``rnd`` rounds, the noise multiplier, the clipping norm
    and the round's own figures (``client_aggregate``'s: the clip this round used, the median update norm, ...)."""
    return {
        "epsilon": epsilon_after(rnd),
        "dp_noise_multiplier": ctx.dp.noise_multiplier,
        "dp_clip": float(ctx.state["dp"]["clip"]),
        **ctx.state["dp"]["round"],
    }


def from_config(cfg) -> DPConfig | None:
    """A run's ``DPConfig`` from its settings (``fedfeat.spec.PrivacySpec``: ``cfg.dp``, ``cfg.epsilon``, ...), the
    documented defaults filled in; None without ``dp``."""
    if getattr(cfg, "dp", None) is None:
        return None

    def get(k, default):
        v = getattr(cfg, k, None)
        return default if v is None else v

    return DPConfig(
        mode=cfg.dp,
        noise_multiplier=cfg.noise_multiplier,
        epsilon=cfg.epsilon,
        clip_norm=get("clip_norm", 0.1 if cfg.dp == "client" else 1.0),
        delta=get("delta", 1e-5),
        clip=get("dp_clip", "fixed"),
        target_quantile=get("dp_quantile", 0.5),
        clip_lr=get("dp_clip_lr", 0.2),
        count_std=cfg.dp_count_std,
        accountant=get("dp_accountant", "rdp"),
    )


def check_method(method, dp: DPConfig | None) -> None:
    """Refuse, in one line, a DP level the method does not support."""
    if dp is None:
        return
    if dp.mode == "client" and not method.dp_client:
        raise FedfeatError(
            f"method {method.name} has no client-level DP: its server step is not an average of client updates "
            "(or its clients upload more than it can clip); `fedfeat methods` lists each method's --dp levels"
        )
    if dp.mode == "sample" and not method.dp_sample:
        raise FedfeatError(
            f"method {method.name} has no sample-level DP (no per-sample gradients of its local loss, or it "
            "releases per-sample statistics besides its update); try --dp client (`fedfeat methods` lists the levels)"
        )


__all__ = [
    "DPConfig",
    "MODES",
    "add_noise",
    "check_method",
    "client_aggregate",
    "clip_factors",
    "flat_norms",
    "gaussian",
    "sample_noise",
]
