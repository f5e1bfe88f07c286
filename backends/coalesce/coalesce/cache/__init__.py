"""The row cache: keys, the in-process tier and the shared Redis tier."""
