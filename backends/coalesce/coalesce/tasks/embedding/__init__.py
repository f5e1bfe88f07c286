"""The ``embedding`` task: texts to pooled, optionally normalised vectors."""
