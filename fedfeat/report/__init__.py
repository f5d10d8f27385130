"""Reading results: run directories, stores and partitions, as tables and figures.

Owns loading finished (and unfinished) runs, seed aggregation, markdown / CSV / JSON tables, figures (curves,
seed bands, partitions), store and partition summaries, and CLIP_benchmark's result JSON.

May import: ``fedfeat.partition``, ``fedfeat.store`` and below, and ``fedfeat.errors``. It reads what runs wrote
and never reaches back into training (no ``fedfeat.runs``, ``fedfeat.methods`` or ``fedfeat.engine``).
"""
