"""Image data as published: readers and class prompts. The bottom of the data flow.

Owns the ``ImageDataset`` interface and its readers (CIFAR "python version" pickles through a restricted unpickler,
ImageFolder trees, ``path label`` list files, ``hf:`` Hugging Face datasets and ``wds:`` webdataset shards), class
names as the datasets spell them, content fingerprints of the files read, and the prompt templates.

May import: ``fedfeat.errors`` only. Nothing here knows of CLIP, stores or training.
"""
