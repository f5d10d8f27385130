"""Jobs: what a command asks for, turned into stores and run directories.

Owns run configuration (resolution, names, provenance), run directories (locks, atomic publication), the
orchestration of ``train``, ``sweep`` (stacked runs), ``reproduce`` (paper tables, kept as data) and the
``encode`` pipeline (data -> encoders -> store, on one device or many).

May import: ``fedfeat.report`` (a run writes its plot; a sweep ends with its table), ``fedfeat.methods`` and
everything below. Never ``fedfeat.cli`` or ``fedfeat.integrations``.
"""
