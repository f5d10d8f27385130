"""The frozen vision-language encoders: everything that turns pixels or words into CLIP embeddings.

Owns open_clip loading (architecture names, pretrained tags, local checkpoints, ``hf-hub:`` and ``local-dir:``
models, the weights' sha256), the torchvision remedy that must run before open_clip's first import, the live text
encoder of a store, and the trainable prompt modules that run inside it (CoOp text contexts, VPT-deep visual
prompts).

May import: ``fedfeat.data`` (prompt templates) and ``fedfeat.errors``. Never a store, a partition or a method: a
store records what an encoder did, the encoder does not read stores' layouts.
"""
