"""Adaptive scheduling: the pure policy and the thread that drives it."""
