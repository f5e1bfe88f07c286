"""Text generation: continuous batching over a paged KV cache, with prefix reuse and token streaming."""
