"""The federated engine: one batched tensor program per round over all sampled clients.

Owns the round (sampling, client-major gathers into ``[clients, batch, D]`` with masks, the method's loss for
all active clients at once, aggregation, evaluation), the sequential reference engine, the fused CPU kernels,
counter-based RNG streams, batched optimizers and checkpoints of a run's state.

May import: ``fedfeat.partition``, ``fedfeat.store`` and below, and ``fedfeat.errors``. It calls a method only
through the hooks of ``fedfeat.methods.base.Method`` (duck-typed): it never imports ``fedfeat.methods``.
"""
