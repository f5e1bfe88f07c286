"""Client-side exceptions, mirroring the backend's error codes.

Every failure of a call surfaces as one of these, with a message saying what
went wrong and, where the server answered, the server's own message.
"""

from __future__ import annotations


class ClientError(Exception):
    """Base class of every error the client raises."""


class InvalidInputError(ClientError):
    """The server rejected the request's input (Triton ``INVALID_ARG``, HTTP 400)."""


class AccessDeniedError(ClientError):
    """The server refused the request for want of a credential; retrying will not help.

    A header Triton's restricted APIs expect is missing or wrong (``--http-restricted-api``,
    ``--grpc-restricted-protocol``), or a proxy in front answered 401/403.
    """


class ModelNotFoundError(ClientError):
    """The model is unknown to the server or not loaded."""


class ServerUnavailableError(ClientError):
    """The server could not be reached or cannot serve right now (``UNAVAILABLE``)."""


class RequestRejectedError(ServerUnavailableError):
    """The model refused the request under load (adaptive scheduling: deadline, queue bound, rate limit).

    Nothing was computed; retrying later, or with a longer deadline, may succeed.
    """


class RequestTimeoutError(ClientError):
    """No answer within the call's timeout."""


class ServerError(ClientError):
    """The server failed while handling the request (``INTERNAL`` or another code)."""


class BatchJobError(ClientError):
    """A bulk job cannot start or go on: its input, its output, its saved state or the servers say why.

    Rows already written stay in the job's part files: running the same job again resumes it.
    """
