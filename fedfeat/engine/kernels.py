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
Compiled by numba on first use (cached on disk next to this file; an unreadable cache entry is deleted and
compiled again, ``fedfeat.engine.numba_cache``).

(Over ~600 lines on purpose: the kernels share their compiled building blocks -- the bucket-sort shuffle, the blocked
logits with prefetch, the inlined exp, the SGD step -- and numba's on-disk cache watches only the file that defines
a cached function, so blocks in another file could be served stale after an edit.)
Used by the batched engine on CPU when ``--kernel auto`` (the default) or ``fused``; ``--kernel torch`` keeps the
tensor program (the path the GPU always takes: there one ``bmm`` over all clients is the right program).

Kernels: ``linear_epoch`` -- ``CE`` cross-entropy with hard labels (fedavg, fedavgm, centralized; + ``mu`` for
fedprox's proximal term) or ``NTD`` (+ FedNTD's not-true distillation from the round's global head);
``fst_epoch`` -- FST-CBDG: soft-label updates, self-training on them, and the epoch's class-balanced synthetic
samples ``T_c + sigma * sign * eps`` formed in the kernel (classes, order and signs from ``epoch_begin``'s keys).

Why one module over 600 lines: the two kernels share their compiled building blocks (the bucket-sort shuffle, the
four-by-two logit blocks with prefetch, the inlined exp, the SGD update) and numba compiles and caches them per
module; split, each piece would be a separately cached dispatcher and a kernel change would touch several files.
"""

from __future__ import annotations

import os

import numpy as np

os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")  # numba's own pool: no second OpenMP runtime
import numba as nb  # noqa: E402

from fedfeat.engine import rng  # noqa: E402
from fedfeat.engine.numba_cache import cached  # noqa: E402

nb.config.THREADING_LAYER = "workqueue"  # (also when numba was imported before us)

from llvmlite import ir  # noqa: E402
from numba.core import cgutils, types  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

CE = 0
NTD = 1

# LLVM's fast-math flags for the kernels: reassociation (vectorised sums), contraction (FMA), reciprocals,
# approximate functions and signless zeros -- not ``fastmath=True``, whose ``nnan`` / ``ninf`` let LLVM assume
# that no value is NaN or infinite and drop their propagation (a NaN feature row then trained a finite head,
# where the torch program gives NaN weights).
_FM = {"nsz", "arcp", "contract", "afn", "reassoc"}


@intrinsic
def _prefetch(typingctx, arr, i, j):
    """Prefetch the cache line that holds ``arr[i, j]`` (a 2-d array): ``llvm.prefetch`` (read, keep in all
    cache levels). A hint: it never faults, whatever the address."""
    if isinstance(arr, types.Array) and arr.ndim == 2:

        def codegen(context, builder, signature, args):
            aryty = signature.args[0]
            ary = context.make_array(aryty)(context, builder, args[0])
            idx = [context.cast(builder, a, t, types.intp) for a, t in zip(args[1:], signature.args[1:])]
            ptr = cgutils.get_item_pointer(context, builder, aryty, ary, idx, wraparound=False)
            i32 = ir.IntType(32)
            fnty = ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
            builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
            return context.get_dummy_value()

        return types.none(arr, i, j), codegen
    return None


@nb.njit(inline="always")
def _prefetch_part(F, nx, part, parts):
    """Part ``part`` of ``parts`` of the 64-byte lines of rows ``nx = (n0, n1, n2, n3)`` of ``F``: the next
    block's samples, fetched a part per pass of this block's ``_dots4`` and ``_acc4`` (``parts`` = their passes:
    10 for K = 10), so that the next rows arrive while this block computes. Measured: all the lines at once at the
    start of a block gain nothing (what overflows the core's miss buffers is dropped), and the hardware
    prefetcher does not cross from one randomly chosen row to the next. ``F`` None: nothing (a block of formed
    samples, already in L1; prefetching the next noise rows there gains nothing either)."""
    if F is None:
        return
    per = 64 // F.itemsize  # elements per line
    L = F.shape[1] // per
    for line in range(part * L // parts, (part + 1) * L // parts):
        _prefetch(F, nx[0], line * per)
        _prefetch(F, nx[1], line * per)
        _prefetch(F, nx[2], line * per)
        _prefetch(F, nx[3], line * per)


@nb.njit(inline="always")
def _next_rows(prow, i):
    """``(prow[i], .., prow[i + 3])``, indices clipped to the last: the rows of the block after this one."""
    n = prow.shape[0] - 1
    return (prow[min(i, n)], prow[min(i + 1, n)], prow[min(i + 2, n)], prow[min(i + 3, n)])


@nb.njit(fastmath=_FM, inline="always")
def _dot24(P, p0, p1, Q, q0, q1, q2, q3, D, zero):
    """The eight dot products ``P[p_i, :D] . Q[q_j, :D]``, ``i < 2``, ``j < 4`` (8 accumulators, each loaded
    vector feeding 2 or 4 FMAs), in the order ``(p0 q0, p0 q1, p0 q2, p0 q3, p1 q0, .., p1 q3)``."""
    a0 = zero  # of the arrays' dtype (a literal 0 would make the accumulators float64)
    a1 = zero
    a2 = zero
    a3 = zero
    c0 = zero
    c1 = zero
    c2 = zero
    c3 = zero
    for d in range(D):
        w = P[p0, d]
        v = P[p1, d]
        y0 = Q[q0, d]
        y1 = Q[q1, d]
        y2 = Q[q2, d]
        y3 = Q[q3, d]
        a0 += w * y0
        a1 += w * y1
        a2 += w * y2
        a3 += w * y3
        c0 += v * y0
        c1 += v * y1
        c2 += v * y2
        c3 += v * y3
    return a0, a1, a2, a3, c0, c1, c2, c3


@nb.njit(fastmath=_FM)
def _dots4(Wj, bj, A, r0, r1, r2, r3, scale, zero, Z, F, nx):
    """``Z[0:4, k] = scale * (W_k . x_t + b_k)`` for the samples ``x_t = A[r_t]``: two weight rows x four samples
    per pass (8 accumulators; each loaded vector feeds 2 or 4 FMAs). An odd last row is paired with itself.
    Samples are rows of a shared array, not views of it: a view costs an atomic reference count on the
    array, and two threads doing that per sample fight over its cache line. Each pass prefetches a part of the
    next block's rows ``nx`` of ``F`` (``_prefetch_part``: the first half of the parts; ``_acc4`` fetches the
    second)."""
    K, D = Wj.shape
    for k in range(0, K, 2):
        _prefetch_part(F, nx, k // 2, 2 * ((K + 1) // 2))
        k1 = min(k + 1, K - 1)
        a0, a1, a2, a3, c0, c1, c2, c3 = _dot24(Wj, k, k1, A, r0, r1, r2, r3, D, zero)
        Z[0, k] = scale * (a0 + bj[k])
        Z[1, k] = scale * (a1 + bj[k])
        Z[2, k] = scale * (a2 + bj[k])
        Z[3, k] = scale * (a3 + bj[k])
        Z[0, k1] = scale * (c0 + bj[k1])
        Z[1, k1] = scale * (c1 + bj[k1])
        Z[2, k1] = scale * (c2 + bj[k1])
        Z[3, k1] = scale * (c3 + bj[k1])


@nb.njit(fastmath=_FM)
def _dots1(Wj, bj, A, r0, scale, zero, Z, t):
    K, D = Wj.shape
    for k in range(K):
        a0 = zero  # of the arrays' dtype (a literal 0 would make the accumulators float64)
        for d in range(D):
            a0 += Wj[k, d] * A[r0, d]
        Z[t, k] = scale * (a0 + bj[k])


@nb.njit(fastmath=_FM)
def _dots2(Wj, bj, A, r0, r1, scale, zero, Z, t):
    """``Z[t + i, k] = scale * (W_k . x_i + b_k)`` for the two samples ``x_i = A[r_i]`` (a step's last two: a batch
    of 50 leaves two after its blocks of four): two samples x four weight rows per pass (``_dot24``; rows past
    the last are the last again)."""
    K, D = Wj.shape
    for k in range(0, K, 4):
        k1, k2, k3 = min(k + 1, K - 1), min(k + 2, K - 1), min(k + 3, K - 1)
        a0, a1, a2, a3, c0, c1, c2, c3 = _dot24(A, r0, r1, Wj, k, k1, k2, k3, D, zero)
        Z[t, k] = scale * (a0 + bj[k])
        Z[t, k1] = scale * (a1 + bj[k1])
        Z[t, k2] = scale * (a2 + bj[k2])
        Z[t, k3] = scale * (a3 + bj[k3])
        Z[t + 1, k] = scale * (c0 + bj[k])
        Z[t + 1, k1] = scale * (c1 + bj[k1])
        Z[t + 1, k2] = scale * (c2 + bj[k2])
        Z[t + 1, k3] = scale * (c3 + bj[k3])


@nb.njit(fastmath=_FM)
def _acc4(gW, G, A, r0, r1, r2, r3, zero, F, nx):
    """``gW += G[0:4]^T A[[r0, r1, r2, r3]]``: two gradient rows per pass over the four samples (an odd last row
    is paired with itself, with zero weights for the copy); prefetches the second half of ``nx``'s parts
    (``_dots4``)."""
    K, D = gW.shape
    for k in range(0, K, 2):
        _prefetch_part(F, nx, (K + 1) // 2 + k // 2, 2 * ((K + 1) // 2))
        k1 = min(k + 1, K - 1)
        g0, g1, g2, g3 = G[0, k], G[1, k], G[2, k], G[3, k]
        h0, h1, h2, h3 = G[0, k1], G[1, k1], G[2, k1], G[3, k1]
        if k1 == k:
            h0, h1, h2, h3 = zero, zero, zero, zero
        for d in range(D):
            y0 = A[r0, d]
            y1 = A[r1, d]
            y2 = A[r2, d]
            y3 = A[r3, d]
            gW[k, d] += g0 * y0 + g1 * y1 + g2 * y2 + g3 * y3
            gW[k1, d] += h0 * y0 + h1 * y1 + h2 * y2 + h3 * y3


@nb.njit(fastmath=_FM)
def _acc1(gW, G, A, r0, t):
    K, D = gW.shape
    for k in range(K):
        g0 = G[t, k]
        for d in range(D):
            gW[k, d] += g0 * A[r0, d]


@nb.njit(fastmath=_FM)
def _acc2(gW, G, A, r0, r1, t, zero):
    """``gW += G[t:t + 2]^T A[[r0, r1]]`` (``_dots2``'s samples): two gradient rows per pass over the two samples
    (an odd last row is paired with itself, with zero weights for the copy)."""
    K, D = gW.shape
    for k in range(0, K, 2):
        k1 = min(k + 1, K - 1)
        g0, g1 = G[t, k], G[t + 1, k]
        h0, h1 = G[t, k1], G[t + 1, k1]
        if k1 == k:
            h0, h1 = zero, zero
        for d in range(D):
            y0 = A[r0, d]
            y1 = A[r1, d]
            gW[k, d] += g0 * y0 + g1 * y1
            gW[k1, d] += h0 * y0 + h1 * y1


_IOTA = np.arange(4)  # the rows of a block of formed samples (``X[0:4]``)


@nb.njit(fastmath=_FM)
def _dots_tail(Wj, bj, A, rows, i0, q, scale, zero, Z):
    """``Z[0:q]`` for a block of ``q < 4`` samples ``A[rows[i0 + t]]``: pairs by ``_dots2``, an odd last one by
    ``_dots1``."""
    t = 0
    while t + 1 < q:
        _dots2(Wj, bj, A, rows[i0 + t], rows[i0 + t + 1], scale, zero, Z, t)
        t += 2
    if t < q:
        _dots1(Wj, bj, A, rows[i0 + t], scale, zero, Z, t)


@nb.njit(fastmath=_FM)
def _acc_tail(gW, G, A, rows, i0, q, zero):
    """``gW += G[0:q]^T A[rows[i0 : i0 + q]]`` for ``_dots_tail``'s block."""
    t = 0
    while t + 1 < q:
        _acc2(gW, G, A, rows[i0 + t], rows[i0 + t + 1], t, zero)
        t += 2
    if t < q:
        _acc1(gW, G, A, rows[i0 + t], t)


@intrinsic
def _f64_from_bits(typingctx, bits):
    """The float64 whose IEEE bits are the int64 ``bits`` (an LLVM bitcast: vectorisable, no memory)."""
    if isinstance(bits, types.Integer) and bits.bitwidth == 64:

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.DoubleType())

        return types.float64(bits), codegen
    return None


@intrinsic
def _next(typingctx, counter):
    """``counter[0] += 1`` atomically (an int64 array); returns the value before: a work queue that two
    threads can draw from, so a thread that finishes its client early (or was slowed by the host) takes the
    next one instead of waiting at the end of a fixed half of the clients."""
    if isinstance(counter, types.Array) and counter.dtype == types.int64:

        def codegen(context, builder, signature, args):
            ary = context.make_array(signature.args[0])(context, builder, args[0])
            return builder.atomic_rmw("add", ary.data, ir.Constant(ir.IntType(64), 1), "monotonic")

        return types.int64(counter), codegen
    return None


_LOG2E = 1.4426950408889634
_LN2_HI = 6.93147180369123816490e-01  # ln 2 split in two (fdlibm): n * _LN2_HI is exact for |n| < 2^11
_LN2_LO = 1.90821492927058770002e-10
_C0, _C1, _C2, _C3, _C4, _C5, _C6, _C7, _C8, _C9, _C10, _C11, _C12, _C13 = (
    1.0 / float(np.prod(np.arange(1, k + 1))) for k in range(14)
)  # 1/k!


@nb.njit(fastmath=_FM, inline="always")
def _exp(x):
    """``exp(x)`` in float64 for ``x`` of any float type, within ~2 ulp of float64 (so float32 callers get
    the correctly rounded float32 in practice), inlined and vectorisable: no libm call (numba's ``np.exp``
    calls libm once per element, ~10 ns; a round of FST-CBDG takes ~10^6 of them). Cody-Waite reduction
    ``x = n ln2 + r``, ``|r| <= ln2 / 2``, degree-13 Taylor polynomial of ``e^r`` (remainder < 1e-18; Estrin's
    scheme: 4 dependent multiply-adds instead of Horner's 13), times ``2^n`` built from its exponent bits.
    ``x`` is clamped to [-708, 708] (``e^-708`` ~ 3e-308: the softmax terms this is used for are far below any
    float32 or float64 sum there); a NaN gives NaN."""
    xf = np.float64(x)
    xc = xf if xf > -708.0 else -708.0  # (a NaN becomes -708 here: n stays finite, its int64 defined)
    xc = xc if xc < 708.0 else 708.0
    n = np.floor(xc * _LOG2E + 0.5)
    r = ((xc if xf == xf else xf) - n * _LN2_HI) - n * _LN2_LO  # a NaN x gives NaN, as np.exp
    r2 = r * r
    r4 = r2 * r2
    q0 = (_C0 + _C1 * r) + (_C2 + _C3 * r) * r2
    q1 = (_C4 + _C5 * r) + (_C6 + _C7 * r) * r2
    q2 = (_C8 + _C9 * r) + (_C10 + _C11 * r) * r2
    q3 = _C12 + _C13 * r
    p = (q0 + q1 * r4) + (q2 + q3 * r4) * (r4 * r4)
    return p * _f64_from_bits((np.int64(n) + 1023) << 52)


@nb.njit(fastmath=_FM)
def _softmax(Z, G, n, lse):
    """``G[t] = softmax(Z[t])`` and ``lse[t] = log sum_k exp Z[t, k]`` for the ``n <= 4`` rows of a block: the
    row maxima first, then all ``n K`` exponentials in one pass (independent, so they overlap), then the sums."""
    K = Z.shape[1]
    for t in range(n):
        mx = Z[t, 0]
        for k in range(1, K):
            mx = max(mx, Z[t, k])
        lse[t] = mx
    for t in range(n):
        for k in range(K):
            G[t, k] = _exp(Z[t, k] - lse[t])
    for t in range(n):
        se = 0.0
        for k in range(K):
            se += G[t, k]
        inv = 1.0 / se
        for k in range(K):
            G[t, k] *= inv
        lse[t] += np.log(se)


@nb.njit(fastmath=_FM)
def _ce(Z, G, t, y, lse):
    """Row ``t`` of a block after ``_softmax``: ``G[t] -= onehot(y)`` (the cross-entropy's logit gradient);
    returns the cross-entropy ``lse - z_y``."""
    G[t, y] -= 1
    return lse[t] - Z[t, y]


@nb.njit(fastmath=_FM)
def _ntd_grad(z, zg, y, tau, beta, g):
    """FedNTD's ``beta tau^2 KL(p_g || p_l)`` over the not-true classes of ``z / tau``: adds its gradient
    ``beta tau (p_l - p_g)`` to ``g`` (not-true classes) and returns ``KL``."""
    K = z.shape[0]
    ml = -np.inf
    mg = -np.inf
    for k in range(K):
        if k != y:
            ml = max(ml, z[k] / tau)
            mg = max(mg, zg[k] / tau)
    sl = 0.0
    sg = 0.0
    for k in range(K):
        if k != y:
            sl += np.exp(z[k] / tau - ml)
            sg += np.exp(zg[k] / tau - mg)
    kl = 0.0
    for k in range(K):
        if k != y:
            lpl = z[k] / tau - ml - np.log(sl)
            lpg = zg[k] / tau - mg - np.log(sg)
            pg = np.exp(lpg)
            kl += pg * (lpg - lpl)
            g[k] += beta * tau * (np.exp(lpl) - pg)
    return kl


@nb.njit(fastmath=_FM)
def _grads(Z, Zg, G, gb, lse, labels, prow, i0, q, mode, scale, inv, tau, beta):
    """Per-sample logit gradients ``G[:q]`` (already times ``scale / count``), bias gradient; returns the
    summed loss of the ``q`` samples."""
    K = Z.shape[1]
    lsum = 0.0
    _softmax(Z, G, q, lse)
    for t in range(q):
        y = labels[prow[i0 + t]]
        lsum += _ce(Z, G, t, y, lse)
        if mode == NTD:
            lsum += beta * tau * tau * _ntd_grad(Z[t], Zg[t], y, tau, beta, G[t])
        for k in range(K):
            G[t, k] *= scale * inv
            gb[k] += G[t, k]
    return lsum


_GOLDEN = np.uint64(rng.GOLDEN)
_MIX1 = np.uint64(rng.MIX1)
_MIX2 = np.uint64(rng.MIX2)
_MASK62 = np.uint64((1 << 62) - 1)


@nb.njit
def _uniform_key(key, pos):
    """``fedfeat.engine.rng.uniform_keys(key, pos)`` for one position (the same splitmix64 bits, on uint64)."""
    u = np.uint64(pos) * _GOLDEN + key
    u ^= u >> np.uint64(30)
    u *= _MIX1
    u ^= u >> np.uint64(27)
    u *= _MIX2
    u ^= u >> np.uint64(31)
    return np.int64(u & _MASK62)


@nb.njit
def _stable_argsort(k):
    """``np.argsort(k, kind="stable")`` for int64 keys, in expected linear time for the uniformly random 62-bit
    keys sorted here: a stable counting sort on the top bits of ``k - min(k)`` (about one key per bucket), then
    an insertion sort, which only has to move keys within their bucket and keeps equal keys in index order.
    Measured on a client's 500 fresh random keys: ~4 us against ~25 us for numba's quicksort, whose branches
    mispredict on random keys (any key distribution is sorted exactly; a heavily clustered one just costs more
    insertion steps)."""
    n = k.shape[0]
    o = np.empty(n, np.int64)
    if n == 0:
        return o
    lo = k.min()
    span = np.uint64(k.max()) - np.uint64(lo)  # in uint64: exact even across the whole int64 range
    bits = 0
    while (np.uint64(1) << np.uint64(bits)) < np.uint64(n):
        bits += 1
    top = 0
    while top < 64 and (span >> np.uint64(top)) > np.uint64(0):
        top += 1
    shift = np.uint64(max(0, top - bits))
    bucket = np.empty(n, np.int64)
    count = np.zeros((1 << bits) + 2, np.int64)
    for i in range(n):
        bucket[i] = np.int64((np.uint64(k[i]) - np.uint64(lo)) >> shift)
        count[bucket[i] + 1] += 1
    for b in range(1, count.shape[0]):
        count[b] += count[b - 1]
    for i in range(n):  # stable: equal buckets keep index order
        o[count[bucket[i]]] = i
        count[bucket[i]] += 1
    for i in range(1, n):  # strict comparison: equal keys keep index order
        v = o[i]
        kv = k[v]
        j = i - 1
        while j >= 0 and k[o[j]] > kv:
            o[j + 1] = o[j]
            j -= 1
        o[j + 1] = v
    return o


@nb.njit
def _client_rows(key, start, n):
    """Client-major rows ``start .. start+n-1`` in this epoch's shuffled order: sorted by their counter-based
    keys, stably, as ``engine.epoch_tables`` sorts them (step ``s`` takes ranks ``s*B .. s*B+B-1``)."""
    k = np.empty(n, np.int64)
    for r in range(n):
        k[r] = _uniform_key(key, start + r)
    return _stable_argsort(k) + start


@nb.njit
def _step_size(n, s, B):
    """The number of samples of a client's step ``s`` (the last batch is smaller). The step's gradients are
    already zero: ``_sgd`` clears them as it applies them (and ``_scratch`` makes them zero)."""
    return min(B, n - s * B)


@nb.njit
def _scratch(W, P):
    """A thread's scratch, made once and used for all the clients it takes: weight / bias gradients, two
    ``[4, K]`` logit blocks, the logit gradients ``[4, K]``, four ``[D]`` rows for formed (synthetic) samples,
    the block's four log-sum-exps (float64), a step's synthetic classes and signs (``P`` at most), and momentum
    buffers for one-epoch rounds (``_start``)."""
    K, D = W.shape[1], W.shape[2]
    z = np.zeros((4, K), W.dtype)
    return (
        np.zeros((K, D), W.dtype),
        np.zeros(K, W.dtype),
        z,
        z.copy(),
        z.copy(),
        np.zeros((4, D), W.dtype),
        np.zeros(4, np.float64),
        np.zeros(P, np.int64),
        np.zeros(P, W.dtype),
        np.zeros((K, D), W.dtype),
        np.zeros(K, W.dtype),
    )


@nb.njit
def _start(W, b, mW, mb, Wg, bg, j, init, one_epoch, scr):
    """Client ``j``'s momentum buffers, and in a round's first epoch (``init``) its start from the global head
    with zero momentum (written here, in the client's thread, rather than by copies of the whole ``[m, K, D]``
    before the kernel). In a one-epoch round the momentum lives and dies with the client: in the thread's
    scratch, not in ``mW``, ``mb`` (which are then not touched)."""
    if init:
        W[j] = Wg
        b[j] = bg
    if one_epoch:
        mWj, mbj = scr[9], scr[10]
    else:
        mWj, mbj = mW[j], mb[j]
    if init:
        mWj[:] = 0
        mbj[:] = 0
    return mWj, mbj


@nb.njit(fastmath=_FM)
def _sgd(Wj, bj, mWj, mbj, gW, gb, lr, mom, wd):
    """``torch.optim.SGD`` (dampening 0, no Nesterov): ``d = grad + wd p``; ``buf = mom buf + d`` (``buf``
    starts at 0, so a client's first step has ``buf = d``); ``p -= lr buf``. Then zeroes the gradients for the
    next step, in the same pass (a separate pass over ``gW`` costs more than the store)."""
    K, D = Wj.shape
    for k in range(K):
        for d in range(D):
            mWj[k, d] = mom * mWj[k, d] + (gW[k, d] + wd * Wj[k, d])
            Wj[k, d] -= lr * mWj[k, d]
            gW[k, d] = 0
        mbj[k] = mom * mbj[k] + (gb[k] + wd * bj[k])
        bj[k] -= lr * mbj[k]
        gb[k] = 0


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


@cached(parallel=True, fastmath=_FM)
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


@cached(parallel=True, fastmath=_FM)
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


@cached()
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


# ---------------------------------------------------------------------------------------- DP noise (engine.privacy)
@cached(parallel=True)
def _dp_normals(key, ids, half, out, workers):
    """Rows ``out[r] = `` the standard normals of client ``ids[r]``: pair ``j`` from the uniforms of positions
    ``ids[r] * 2 half + 2j`` and ``+ 2j + 1`` (53 bits each, in (0, 1]) by Box-Muller, ``r cos`` at ``j`` and ``r sin``
    at ``half + j`` (where ``out`` is that wide)."""
    m, numel = out.shape
    per = (m + workers - 1) // workers
    for th in nb.prange(workers):
        for r in range(th * per, min(m, (th + 1) * per)):
            base = ids[r] * 2 * half
            for j in range(half):
                u1 = ((_uniform_key(key, base + 2 * j) >> 9) + 1) * 1.1102230246251565e-16
                u2 = ((_uniform_key(key, base + 2 * j + 1) >> 9) + 1) * 1.1102230246251565e-16
                rad = np.sqrt(-2.0 * np.log(u1))
                t = 6.283185307179586 * u2
                out[r, j] = rad * np.cos(t)
                if half + j < numel:
                    out[r, half + j] = rad * np.sin(t)


def dp_normals(key: int, ids: np.ndarray, numel: int, threads: int = 1) -> np.ndarray:
    """``[len(ids), numel]`` float64 standard normals, a pure function of ``(key, id, coordinate)``
    (``fedfeat.engine.privacy.gaussian``'s CPU path: one compiled pass, no temporaries)."""
    out = np.empty((len(ids), numel), np.float64)
    if out.size:
        workers = max(1, min(int(threads), nb.config.NUMBA_NUM_THREADS, len(ids)))
        nb.set_num_threads(workers)
        _dp_normals(np.uint64(key), np.ascontiguousarray(ids, np.int64), (numel + 1) // 2, out, workers)
    return out
