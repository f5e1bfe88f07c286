"""Coalesce's developer tools: serve, prepare and export models, tune, build engines, drive perf_analyzer.

Installed by the ``serve`` and ``dev`` extras; never copied into Triton's backend folder
(only ``backends/coalesce`` runs inside the server).
"""
