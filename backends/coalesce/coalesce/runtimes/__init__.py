"""Inference runtimes behind one small interface (named tensors in and out), and the choice between them."""

from coalesce.runtimes.base import Runtime, RuntimeChoice, create_runtime

__all__ = ["Runtime", "RuntimeChoice", "create_runtime"]
