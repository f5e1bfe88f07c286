"""The ``similarity`` task: text pairs to the cosine of their two embeddings (a bi-encoder scorer)."""
