"""The feature store: one zarr v3 directory per dataset x backbone x weights, and the synthetic stand-in.

Owns the on-disk format (float16 feature chunks, labels, text embeddings per template, client-major partitions,
attributes and fingerprints), its integrity (per-chunk crc32, ``verify``), stores at fsspec URLs, and
``synth``, which writes a CLIP-like store with the real layout and no model.

May import: ``fedfeat.encoders`` (pixel normalisation constants), ``fedfeat.data`` and ``fedfeat.errors``.
Partitions are stored here but computed in ``fedfeat.partition``, which sits above: the store keeps their arrays.
"""
