"""The ``tensor`` task: any graph, named tensors in and out, rows on dim 0."""
