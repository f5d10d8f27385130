"""Bridges to other FL frameworks: a fedfeat partition and its cached features as Flower pieces.

May import: anything below it (``fedfeat.runs`` and down); nothing of fedfeat imports this package.
"""
