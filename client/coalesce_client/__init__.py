"""Client library for Coalesce embedding models served by Triton (HTTP and gRPC)."""

from coalesce_client.client import AsyncEmbeddingClient, EmbeddingClient
from coalesce_client.errors import (
    ClientError,
    InvalidInputError,
    ModelNotFoundError,
    RequestRejectedError,
    RequestTimeoutError,
    ServerError,
    ServerUnavailableError,
)

__all__ = [
    "AsyncEmbeddingClient",
    "ClientError",
    "EmbeddingClient",
    "InvalidInputError",
    "ModelNotFoundError",
    "RequestRejectedError",
    "RequestTimeoutError",
    "ServerError",
    "ServerUnavailableError",
]
