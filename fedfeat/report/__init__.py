"""Reading results: run directories, stores and partitions, as tables and figures.

Owns the run-directory format (names, locks, atomic publication, ``metrics.jsonl`` / ``summary.json``: ``rundir``,
which ``fedfeat.runs`` writes through), loading finished and unfinished runs, seed aggregation, markdown / CSV /
JSON tables, figures (curves, seed bands, partitions), store and partition summaries, and CLIP_benchmark's result
JSON.

May import: ``fedfeat.methods`` only for the registry (a method's default hyperparameters, to name a run's
non-default settings), ``fedfeat.engine.checkpoint`` only for a checkpoint's header (the round an interrupted run
reached), and ``fedfeat.partition``, ``fedfeat.store`` and below. It reads what runs wrote and never trains: no
``fedfeat.runs``.
"""
