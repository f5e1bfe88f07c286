"""Coalesce: a Python-based Triton backend that turns dynamic batches into few, well-shaped forward passes."""

__version__ = "0.1.0"
