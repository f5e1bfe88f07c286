"""Inference runtimes behind one small interface, and the choice between them."""

from coalesce.runtime.base import Runtime, RuntimeChoice, create_runtime

__all__ = ["Runtime", "RuntimeChoice", "create_runtime"]
