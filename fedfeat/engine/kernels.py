"""Fused CPU kernels: one local epoch of every sampled client's linear head in one compiled call.

On a CPU the batched torch program of a round (gather the step's mini-batches into ``[n, B, D]``, ``bmm`` forward,
loss, ``bmm`` weight gradient, optimizer) moves each sample three times per step and runs its thin GEMMs
(K = 10 outputs per client) at a fraction of the machine's matmul rate. This kernel reads each sample's features
**once**, straight from the client-major matrix (no gather buffer): per client (the threads take clients from an
atomic work queue, so a thread the host slows down takes fewer) and per step, it shuffles and batches the client's
samples itself (the keys and stable order of ``engine.epoch_tables``, by a bucket sort), computes the logits of
four samples at a time against two rows of the client's head (while the next four samples' rows are prefetched, a
part per pass: the rows are random within the client, so the hardware prefetcher cannot guess them; a step's last
pair: two samples against four rows), their softmax (an inlined, vectorisable exp: numba's ``np.exp`` is a libm
call per element), the per-sample loss gradient, accumulates the weight gradient while the rows are still in
L1, and applies the SGD step (``torch.optim.SGD`` semantics: weight decay into the gradient, momentum buffer
``buf = m buf + d``, zero at the start of a round) before the client's next step.

It is the same mathematics as the torch path (``fedfeat.methods.linear``, ``fedfeat.methods.fst_cbdg``), rounded
differently: the tests run both against the loop engine (``test_engine.py``; ``test_kernel_exactness.py``: float64
to ~1e-15; float32 to ~1e-7, except where FST-CBDG's argmax of a soft label falls on a near-tie that rounding
decides, see there), and NaN / inf propagate as in torch (LLVM's fast-math flags without ``nnan`` / ``ninf``).
Compiled by numba on first use (cached on disk next to this file).
Used by the batched engine on CPU when ``--kernel auto`` (the default) or ``fused``; ``--kernel torch`` keeps the
tensor program (the path the GPU always takes: there one ``bmm`` over all clients is the right program).

Kernels: ``linear_epoch`` -- ``CE`` cross-entropy with hard labels (fedavg, fedavgm, centralized; + ``mu`` for
fedprox's proximal term) or ``NTD`` (+ FedNTD's not-true distillation from the round's global head);
``fst_epoch`` -- FST-CBDG: soft-label updates, self-training on them, and the epoch's class-balanced synthetic
samples ``T_c + sigma * sign * eps`` formed in the kernel (classes, order and signs from ``epoch_begin``'s keys).

Modules: this file has the per-client loops, the cached kernels and their Python entry points;
``fedfeat.engine.kernels_blocks`` the compiled building blocks both kernels share (the bucket-sort shuffle, the
blocked logits with prefetch, the inlined exp, the SGD step). numba's disk cache keys each cached kernel on this
file's source only, not on the blocks it calls: ``_BLOCKS_SHA256`` below is ``kernels_blocks.py``'s content hash,
so a change there must update it here (which changes this file, and the cache recompiles); a stale value compiles
without the disk cache (correct, and a warning names the new hash; ``tests/test_compile.py`` then fails).
"""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path

import numpy as np

from fedfeat.engine import kernels_blocks
from fedfeat.engine.kernels_blocks import (
    _FM,
    _IOTA,
    CE,
    NTD,
    _acc4,
    _acc_tail,
    _ce,
    _client_rows,
    _dots4,
    _dots_tail,
    _exp,  # noqa: F401  (re-exported: tests reach it as kernels._exp)
    _grads,
    _next,
    _next_rows,
    _prefetch,
    _scratch,
    _sgd,
    _softmax,
    _stable_argsort,
    _start,
    _step_size,
    _uniform_key,
    nb,
)

# sha256 of kernels_blocks.py (line ends as "\n"): update it with every change there (module docstring)
_BLOCKS_SHA256 = "03b928ee3ac6a204c5c521abe9260a3acb243adfab4115bc60592f7921daaf96"


def _blocks_current() -> bool:
    """Whether ``kernels_blocks.py`` is the source ``_BLOCKS_SHA256`` names, so that the disk cache (keyed on this
    file) may serve the kernels; else a warning, and they compile in every process (their caches disabled)."""
    try:
        data = Path(kernels_blocks.__file__).read_bytes().replace(b"\r\n", b"\n")
    except OSError:
        return False
    digest = hashlib.sha256(data).hexdigest()
    if digest != _BLOCKS_SHA256:
        warnings.warn(
            f"fedfeat.engine.kernels_blocks changed (sha256 {digest}): set kernels._BLOCKS_SHA256 to it; until then "
            "the fused kernels compile without numba's disk cache",
            stacklevel=2,
        )
        return False
    return True


_BLOCKS_CURRENT = _blocks_current()  # else the cached kernels neither load nor save machine code (below)


@nb.njit(fastmath=_FM)
def _linear_client(
    j, feats, labels, starts, sizes, B, key, W, b, mW, mb, Wg, bg, hp, mode, loss_out, init, one_epoch, scr
):
    """Client ``j``'s local epoch (``linear_epoch``)."""
    mWj, mbj = _start(W, b, mW, mb, Wg, bg, j, init, one_epoch, scr)
    K, D = W.shape[1], W.shape[2]
    lr, mom, wd, scale, mu, tau, beta, zero = hp[0], hp[1], hp[2], hp[3], hp[4], hp[5], hp[6], hp[7]
    gW, gb, Z, Zg, G, lse = scr[0], scr[1], scr[2], scr[3], scr[4], scr[6]
    Wj, bj = W[j], b[j]
    n_j = sizes[j]
    prow = _client_rows(key, starts[j], n_j)
    for s in range((n_j + B - 1) // B):
        c = _step_size(n_j, s, B)
        inv = 1.0 / c
        lsum = 0.0
        for r0 in range(0, c, 4):
            q = min(4, c - r0)
            i0 = s * B + r0  # the block's samples: rows prow[i0 .. i0 + q - 1]
            if q == 4:
                x0, x1, x2, x3 = prow[i0], prow[i0 + 1], prow[i0 + 2], prow[i0 + 3]
                nx = _next_rows(prow, i0 + 4)  # the next block's rows (into the next step's), prefetched
                _dots4(Wj, bj, feats, x0, x1, x2, x3, scale, zero, Z, feats, nx)
                if mode == NTD:
                    _dots4(Wg, bg, feats, x0, x1, x2, x3, scale, zero, Zg, None, None)  # (nx: fetched above)
                lsum += _grads(Z, Zg, G, gb, lse, labels, prow, i0, q, mode, scale, inv, tau, beta)
                _acc4(gW, G, feats, x0, x1, x2, x3, zero, feats, nx)
            else:
                _dots_tail(Wj, bj, feats, prow, i0, q, scale, zero, Z)
                if mode == NTD:
                    _dots_tail(Wg, bg, feats, prow, i0, q, scale, zero, Zg)
                lsum += _grads(Z, Zg, G, gb, lse, labels, prow, i0, q, mode, scale, inv, tau, beta)
                _acc_tail(gW, G, feats, prow, i0, q, zero)
        prox = 0.0
        if mu != 0:  # FedProx: + mu (p - p_global) (and its loss mu/2 ||p - p_global||^2 at this step)
            for k in range(K):
                for d in range(D):
                    diff = Wj[k, d] - Wg[k, d]
                    prox += diff * diff
                    gW[k, d] += mu * diff
                diff = bj[k] - bg[k]
                prox += diff * diff
                gb[k] += mu * diff
        _sgd(Wj, bj, mWj, mbj, gW, gb, lr, mom, wd)
        loss_out[s, j] = lsum * inv + 0.5 * mu * prox


@nb.njit(fastmath=_FM)
def _soft_grads(Z, G, lse, q, prow, i0, n, beta, st, coef):
    """FST-CBDG's real samples: ``f = softmax(z)``; the soft label is updated first, ``q <- beta q +
    (1 - beta) f`` (written back); with self-training (``st``) ``G = coef (f sum(q) - q)``, the gradient of
    ``-sum_k q_k log f_k``, else ``G = 0``. Returns the summed self-training loss."""
    K = Z.shape[1]
    lsum = 0.0
    _softmax(Z, G, n, lse)
    for t in range(n):
        r = prow[i0 + t]
        qs = 0.0
        for k in range(K):
            q[r, k] = beta * q[r, k] + (1 - beta) * G[t, k]
            qs += q[r, k]
        for k in range(K):
            if st:
                lsum += q[r, k] * (lse[t] - Z[t, k])
                G[t, k] = coef * (G[t, k] * qs - q[r, k])
            else:
                G[t, k] = 0
    return lsum


@nb.njit(fastmath=_FM)
def _synthetic(X, text, bank, cls, sign, s, p0, n, sig, renorm):
    """Rows ``X[:n]`` = synthetic samples ``p0 .. p0+n-1`` of step ``s``: ``T_c + sig * sign * eps_p``
    (divided by their norm when ``renorm``)."""
    D = X.shape[1]
    for t in range(n):
        c = cls[p0 + t]
        a = sig * sign[p0 + t]
        for d in range(D):
            X[t, d] = text[c, d] + a * bank[s, p0 + t, d]
        if renorm:
            sq = 0.0
            for d in range(D):
                sq += X[t, d] * X[t, d]
            inv = 1.0 / np.sqrt(max(sq, 1e-24))
            for d in range(D):
                X[t, d] *= inv


@nb.njit
def _synthetic_classes(n_k, cid, key):
    """The client's synthetic samples of this epoch in order: classes ``0..K-1`` repeated ``n_k`` times, sorted
    (stably) by the counter-based key of (client id, item) -- ``FSTCBDG.epoch_begin``'s order."""
    J = n_k.sum()
    cls = np.empty(J, np.int64)
    keys = np.empty(J, np.int64)
    r = 0
    for k in range(n_k.shape[0]):
        for _ in range(n_k[k]):
            cls[r] = k
            keys[r] = _uniform_key(key, cid * (1 << 30) + r)
            r += 1
    return cls[_stable_argsort(keys)]


@nb.njit
def _synthetic_step(cls_all, S, s, cid, key, cls, sign, every):
    """Step ``s`` of ``S`` gets the ranks ``ceil(s J / S) .. ceil((s+1) J / S) - 1`` of the epoch's ``J``
    synthetic samples (spread evenly), or all ``J`` of them when ``every`` (``synthetic_draw=iteration``: a
    fresh set each step, its noise from the step's bank); writes their classes and random signs (keyed by client
    id, step, slot) and returns how many there are."""
    J = cls_all.shape[0]
    if every:
        r0, n = 0, J
    else:
        r0 = (s * J + S - 1) // S
        n = (((s + 1) * J + S - 1) // S) - r0
    for t in range(n):
        cls[t] = cls_all[r0 + t]
        sign[t] = 1.0 if _uniform_key(key, (cid * (1 << 16) + s) * (1 << 20) + t) & 1 else -1.0
    return n


@nb.njit(fastmath=_FM)
def _fst_client(
    j, feats, starts, sizes, B, key, q, W, b, mW, mb, Wg, bg, text, n_k, cids, key_order, key_sign, bank, hp,
    loss_out, init, one_epoch, scr,
):  # fmt: skip
    """Client ``j``'s local epoch (``fst_epoch``; ``scr``: the thread's ``_scratch``)."""
    mWj, mbj = _start(W, b, mW, mb, Wg, bg, j, init, one_epoch, scr)
    K = W.shape[1]
    lr, mom, wd, scale, beta, lam, sig, zero = hp[0], hp[1], hp[2], hp[3], hp[4], hp[5], hp[6], hp[9]
    st = hp[7] != 0
    renorm = hp[8] != 0
    syn_sum = hp[10] != 0  # synthetic_loss=sum: lam * the sum of the step's synthetic CE, not their mean
    every = hp[11] != 0  # synthetic_draw=iteration
    gW, gb, Z, G, X, lse, cls, sign = scr[0], scr[1], scr[2], scr[4], scr[5], scr[6], scr[7], scr[8]
    Wj, bj = W[j], b[j]
    n_j = sizes[j]
    prow = _client_rows(key, starts[j], n_j)
    S_j = (n_j + B - 1) // B
    syn_all = _synthetic_classes(n_k[j], cids[j], key_order)
    for s in range(S_j):
        c = _step_size(n_j, s, B)
        coef = scale / c
        lsum = 0.0
        for r0 in range(0, c, 4):  # real samples: soft-label update, self-training gradient
            n = min(4, c - r0)
            i0 = s * B + r0  # the block's samples: rows prow[i0 .. i0 + n - 1]
            if n == 4:
                x0, x1, x2, x3 = prow[i0], prow[i0 + 1], prow[i0 + 2], prow[i0 + 3]
                nx = _next_rows(prow, i0 + 4)  # the next block's rows (into the next step's), prefetched
                for t in range(4):  # and their soft labels
                    _prefetch(q, nx[t], 0)
                _dots4(Wj, bj, feats, x0, x1, x2, x3, scale, zero, Z, feats, nx)
                lsum += _soft_grads(Z, G, lse, q, prow, i0, n, beta, st, coef)
                if st:
                    _acc4(gW, G, feats, x0, x1, x2, x3, zero, feats, nx)
            else:
                _dots_tail(Wj, bj, feats, prow, i0, n, scale, zero, Z)
                lsum += _soft_grads(Z, G, lse, q, prow, i0, n, beta, st, coef)
                if st:
                    _acc_tail(gW, G, feats, prow, i0, n, zero)
            if st:
                for t in range(n):
                    for k in range(K):
                        gb[k] += G[t, k]
        loss = lsum / c
        cs = _synthetic_step(syn_all, S_j, s, cids[j], key_sign, cls, sign, every)
        if cs > 0:  # this step's synthetic samples: lam * mean (or sum) CE with their class labels
            div = 1 if syn_sum else cs
            scoef = lam * scale / div
            ssum = 0.0
            for p0 in range(0, cs, 4):
                n = min(4, cs - p0)
                _synthetic(X, text, bank, cls, sign, s, p0, n, sig, renorm)
                if n == 4:
                    _dots4(Wj, bj, X, 0, 1, 2, 3, scale, zero, Z, None, None)
                else:
                    _dots_tail(Wj, bj, X, _IOTA, 0, n, scale, zero, Z)
                _softmax(Z, G, n, lse)
                for t in range(n):
                    ssum += _ce(Z, G, t, cls[p0 + t], lse)
                    for k in range(K):
                        G[t, k] *= scoef
                        gb[k] += G[t, k]
                if n == 4:
                    _acc4(gW, G, X, 0, 1, 2, 3, zero, None, None)
                else:
                    _acc_tail(gW, G, X, _IOTA, 0, n, zero)
            loss += lam * ssum / div
        _sgd(Wj, bj, mWj, mbj, gW, gb, lr, mom, wd)
        loss_out[s, j] = loss


@nb.njit(parallel=True, fastmath=_FM, cache=True)
def _linear_epoch(
    feats, labels, starts, sizes, B, keys, runs, W, b, mW, mb, Wgs, bgs, hps, mode, loss_out, init, one_epoch,
    workers,
):  # fmt: skip
    """Client ``j`` (threads take clients as they finish) of run ``runs[j]`` with its shuffle key ``keys[j]`` and
    that run's global head and hyperparameters: one run (``runs`` all 0) or the virtual clients of stacked runs
    (``fedfeat.runs.stack``), the same compiled code either way."""
    nxt = np.zeros(1, np.int64)
    for _th in nb.prange(workers):
        scr = _scratch(W, 1)
        j = _next(nxt)
        while j < sizes.shape[0]:
            r = runs[j]
            _linear_client(
                j, feats, labels, starts, sizes, B, keys[j], W, b, mW, mb, Wgs[r], bgs[r], hps[r], mode, loss_out,
                init, one_epoch, scr,
            )  # fmt: skip
            j = _next(nxt)


@nb.njit(parallel=True, fastmath=_FM, cache=True)
def _fst_epoch(
    feats, starts, sizes, B, keys, runs, qs, W, b, mW, mb, Wgs, bgs, text, n_k, cids, key_orders, key_signs, banks,
    bank_of, hps, loss_out, init, one_epoch, workers,
):  # fmt: skip
    """As ``_linear_epoch``, with run ``r = runs[j]``'s soft labels ``qs[r]``, synthetic keys, noise bank
    ``banks[bank_of[r]]`` and hyperparameters."""
    nxt = np.zeros(1, np.int64)
    for _th in nb.prange(workers):
        scr = _scratch(W, banks.shape[2])
        j = _next(nxt)
        while j < sizes.shape[0]:
            r = runs[j]
            _fst_client(
                j, feats, starts, sizes, B, keys[j], qs[r], W, b, mW, mb, Wgs[r], bgs[r], text, n_k, cids,
                key_orders[r], key_signs[r], banks[bank_of[r]], hps[r], loss_out, init, one_epoch, scr,
            )  # fmt: skip
            j = _next(nxt)


if not _BLOCKS_CURRENT:  # never machine code that numba cached from other building blocks
    _linear_epoch._cache.disable()
    _fst_epoch._cache.disable()


def stacked_epoch(kind: str, threads: int, **kw) -> None:
    """One local epoch of stacked runs' virtual clients (``fedfeat.runs.stack``): ``kind`` ``linear`` or ``fst``, the
    per-run arrays (``hps [R, H]``, ``Wgs [R, K, D]``, ``bgs``, fst: ``qs [R, N, K]``, ``key_orders``,
    ``key_signs [R]`` uint64, ``banks [U, S, P, D]``, ``bank_of [R]``) indexed by ``runs [V]``; per virtual
    client ``starts``, ``sizes``, ``keys`` (uint64) and, fst, ``n_k [V, K]``, ``cids [V]``."""
    W = kw["W"]
    floats = [kw[k] for k in ("feats", "b", "mW", "mb", "Wgs", "bgs", "hps")]
    if kind == "fst":
        floats += [kw[k] for k in ("qs", "text", "banks")]
    for a in (W, *floats):
        if a.dtype != W.dtype or not a.flags.c_contiguous:
            raise TypeError(f"stacked_epoch: arrays must be C-contiguous {W.dtype}")
    workers = max(1, min(threads, nb.config.NUMBA_NUM_THREADS))
    nb.set_num_threads(workers)
    if kind == "linear":
        _linear_epoch(
            kw["feats"], kw["labels"], kw["starts"], kw["sizes"], kw["B"], kw["keys"], kw["runs"], W, kw["b"],
            kw["mW"], kw["mb"], kw["Wgs"], kw["bgs"], kw["hps"], kw["mode"], kw["loss_out"], kw["init"],
            kw["one_epoch"], workers,
        )  # fmt: skip
    else:
        _fst_epoch(
            kw["feats"], kw["starts"], kw["sizes"], kw["B"], kw["keys"], kw["runs"], kw["qs"], W, kw["b"], kw["mW"],
            kw["mb"], kw["Wgs"], kw["bgs"], kw["text"], kw["n_k"], kw["cids"], kw["key_orders"], kw["key_signs"],
            kw["banks"], kw["bank_of"], kw["hps"], kw["loss_out"], kw["init"], kw["one_epoch"], workers,
        )  # fmt: skip


@nb.njit(cache=True)
def _argmax_counts(q, starts, sizes, out):
    for j in range(sizes.shape[0]):
        for r in range(starts[j], starts[j] + sizes[j]):
            best = 0
            top = q[r, 0]
            for k in range(1, q.shape[1]):
                v = q[r, k]
                best = k if v > top else best  # the first maximum, as torch.argmax
                top = max(v, top)
            out[j, best] += 1


def argmax_counts(q, starts, sizes) -> np.ndarray:
    """``out[j, k]`` = how many of rows ``starts[j] .. starts[j] + sizes[j] - 1`` of ``q [N, K]`` have their
    (first) maximum at ``k`` (int64 ``[m, K]``): a client's hard pseudo-label counts. One thread: the scan
    takes ~0.5 ms for 50,000 x 10, and waking numba's thread pool for it cost more (1.5 ms measured in a round)."""
    out = np.zeros((sizes.shape[0], q.shape[1]), np.int64)
    _argmax_counts(q, starts, sizes, out)
    return out


def _prepare(name: str, W, arrays, hyper: list, threads: int) -> tuple[np.ndarray, int]:
    """Check that the float arrays are C-contiguous in ``W``'s dtype, set the thread count, and return the
    hyperparameters as an array of that dtype (scalars in the kernels' arithmetic keep the arrays' precision)
    and the number of worker threads (each draws clients from the kernel's queue until none is left)."""
    for a in (W, *arrays):
        if a.dtype != W.dtype or not a.flags.c_contiguous:
            raise TypeError(f"{name}: arrays must be C-contiguous {W.dtype}")
    workers = max(1, min(threads, nb.config.NUMBA_NUM_THREADS))
    nb.set_num_threads(workers)
    return np.array(hyper, dtype=W.dtype), workers


def linear_epoch(
    feats, labels, starts, sizes, B, key, W, b, mW, mb, Wg, bg, *, lr, momentum, weight_decay, logit_scale,
    mode=CE, mu=0.0, tau=1.0, beta=0.0, loss_out, threads: int, init: bool = False, one_epoch: bool = False,
) -> None:  # fmt: skip
    """One local epoch of the linear heads of clients ``0..m-1``, in place (numpy arrays; the float ones all of
    one dtype, float32 or float64).

    ``feats [N, D]`` client-major features, ``labels [N]`` int64; client j holds rows ``starts[j] ..
    starts[j] + sizes[j] - 1``, shuffled in the kernel by ``key`` (``engine.shuffle_key``: the
    order of ``engine.epoch_tables``) into mini-batches of ``B`` (the last one smaller);
    ``W [m, K, D]``, ``b [m, K]`` and their SGD momentum buffers ``mW``, ``mb``; ``Wg [K, D]``, ``bg [K]`` the
    round's global head (proximal term, distillation). ``init`` (a round's first epoch): each client starts from
    the global head with zero momentum (``W``, ``b``, ``mW``, ``mb`` may then hold anything); ``one_epoch`` (the
    round has no other epoch): the momentum is kept per thread, ``mW``, ``mb`` are not used. Loss: ``mode`` ``CE`` (+
    ``mu / 2 ||p - p_global||^2`` when ``mu``) or ``NTD`` (``tau``, ``beta``). Each step's loss (the client's
    mean over its samples, + the proximal term) goes to ``loss_out [S, m]`` (float64). Runs on ``threads``
    threads over clients.
    """
    hp, workers = _prepare(
        "linear_epoch", W, (feats, b, mW, mb, Wg, bg),
        [lr, momentum, weight_decay, logit_scale, mu, tau, beta, 0.0], threads,
    )  # fmt: skip
    m = sizes.shape[0]
    _linear_epoch(
        feats, labels, starts, sizes, B, np.full(m, key, np.uint64), np.zeros(m, np.int64), W, b, mW, mb, Wg[None],
        bg[None], hp[None], mode, loss_out, bool(init), bool(one_epoch), workers,
    )  # fmt: skip


def fst_epoch(
    feats, starts, sizes, B, key, q, W, b, mW, mb, Wg, bg, text, n_k, cids, key_order, key_sign, bank, *, lr,
    momentum, weight_decay, logit_scale, beta, lam, sigma, self_training, renormalize, loss_out, threads: int,
    init: bool = False, one_epoch: bool = False, syn_sum: bool = False, syn_every_step: bool = False,
) -> None:  # fmt: skip
    """One local epoch of FST-CBDG for clients ``0..m-1``, in place (``fedfeat.methods.fst_cbdg``).

    As ``linear_epoch`` for ``feats, starts, sizes, B, key, W, b, mW, mb, Wg, bg, loss_out, init,
    one_epoch``; ``q [N, K]`` the soft pseudo-labels (updated in place for each step's samples before the step's gradient); ``text [K, D]`` the
    class prototypes; synthetic samples: ``n_k [m, K]`` per class and client for the epoch, ordered with
    ``key_order`` and spread over the client's steps, random signs from ``key_sign`` (``cids [m]`` client ids:
    the draws are keyed by client, not by slot), noise rows ``bank [S, P, D]`` (row p for a step's p-th
    sample; P >= the most samples of any step); ``sigma`` in feature units (already divided by sqrt(D)).
    ``syn_sum``: the synthetic term is ``lam`` * the step's summed CE (Eq. 6) instead of its mean;
    ``syn_every_step``: every step uses all of the client's ``sum(n_k)`` samples (noise from its own bank rows)
    instead of its share of the epoch's (``synthetic_draw=iteration``).
    """
    hp, workers = _prepare(
        "fst_epoch", W, (feats, q, b, mW, mb, Wg, bg, text, bank),
        [lr, momentum, weight_decay, logit_scale, beta, lam, sigma, float(self_training), float(renormalize), 0.0,
         float(syn_sum), float(syn_every_step)],
        threads,
    )  # fmt: skip
    m = sizes.shape[0]
    one = np.zeros(1, np.int64)
    _fst_epoch(
        feats, starts, sizes, B, np.full(m, key, np.uint64), np.zeros(m, np.int64), q[None], W, b, mW, mb, Wg[None],
        bg[None], text, n_k, cids, np.full(1, key_order, np.uint64), np.full(1, key_sign, np.uint64), bank[None],
        one, hp[None], loss_out, bool(init), bool(one_epoch), workers,
    )  # fmt: skip
