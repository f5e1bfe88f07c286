"""The ``classify`` task: texts or text pairs to scores (classifiers, cross-encoder rerankers)."""
