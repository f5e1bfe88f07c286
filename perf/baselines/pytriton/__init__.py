"""Baseline ``pytriton``: the same ONNX model bound with PyTriton's ``@batch``."""
