"""Metrics and logging of the backend."""
