"""The gateway: OpenAI- and Cohere-style HTTP routes in front of a Triton server's gRPC API.

``coalesce gateway`` (and ``coalesce serve``, beside Triton) runs it. It has no model-specific
code: it learns each model's task from the server's repository index and the model's config,
and translates ``/v1/embeddings``, ``/v1/rerank`` (and ``/v2/rerank``, ``/v1/score``),
``/v1/completions`` and ``/v1/chat/completions`` into Triton requests. Design notes: README.md
beside this file.
"""
