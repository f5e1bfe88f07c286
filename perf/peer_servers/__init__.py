"""The peers of ``perf.peers``: how each one is started, asked and checked, and their own server code."""
