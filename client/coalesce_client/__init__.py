"""Client library for Coalesce embedding models served by Triton (HTTP and gRPC)."""

from coalesce_client.client import AsyncEmbeddingClient, EmbeddingClient, TlsOptions
from coalesce_client.errors import (
    AccessDeniedError,
    BatchJobError,
    ClientError,
    InvalidInputError,
    ModelNotFoundError,
    RequestRejectedError,
    RequestTimeoutError,
    ServerError,
    ServerUnavailableError,
)
from coalesce_client.retry import RetryPolicy

__all__ = [
    "AccessDeniedError",
    "AsyncEmbeddingClient",
    "BatchJobError",
    "ClientError",
    "EmbeddingClient",
    "InvalidInputError",
    "ModelNotFoundError",
    "RequestRejectedError",
    "RequestTimeoutError",
    "RetryPolicy",
    "ServerError",
    "ServerUnavailableError",
    "TlsOptions",
]
