"""Baselines measured beside Coalesce; never part of the product's model repository."""
