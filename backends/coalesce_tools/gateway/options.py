"""How the gateway runs: its address, the Triton server behind it, keys and limits (one options object)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Final

#: Environment variables the gateway reads (``from_env``).
PORT_ENV: Final = "OPENAI_PORT"
API_KEY_ENV: Final = "COALESCE_API_KEY"
API_KEY_FILE_ENV: Final = "COALESCE_API_KEY_FILE"
MAX_BODY_ENV: Final = "OPENAI_MAX_BODY_BYTES"
DEFAULT_PORT: Final = 9000
#: 8 MiB: a 2048-text embeddings call of 4 KiB texts fits; past it a client gets 413.
DEFAULT_MAX_BODY_BYTES: Final = 8 * 1024 * 1024


class GatewayOptionsError(ValueError):
    """An option (or the environment variable behind it) that is not valid, named."""


@dataclasses.dataclass(frozen=True)
class GatewayOptions:
    """Where the gateway listens, which Triton it fronts, and what it accepts.

    ``model_repository`` is the folder Triton serves: the gateway reads each model's
    tokenizer there (usage counts, chat templates). ``api_keys`` empty: no key needed.
    """

    model_repository: Path
    triton_grpc_url: str = "127.0.0.1:8001"
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    api_keys: tuple[str, ...] = dataclasses.field(default=(), repr=False)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    #: Seconds one Triton call may take before the client gets 504.
    request_timeout_s: float = 600.0
    #: Least seconds between two reads of the repository index when a request names an unknown model.
    catalog_refresh_s: float = 1.0
    #: Triton's admin key (``coalesce serve`` restricts the repository index to it): the gateway only reads the index.
    triton_admin_key: str | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        """Check bounds.

        Raises:
            GatewayOptionsError: On a port, limit or timeout out of range.
        """
        if not 0 <= self.port < 65536:
            raise GatewayOptionsError(f"port {self.port} is outside 0..65535")
        if self.max_body_bytes < 1024:
            raise GatewayOptionsError(f"max_body_bytes {self.max_body_bytes} is below 1024")
        if self.request_timeout_s <= 0:
            raise GatewayOptionsError(f"request_timeout_s {self.request_timeout_s} must be positive")

    @classmethod
    def from_env(cls, model_repository: Path, *, triton_grpc_url: str, host: str | None = None,
                 port: int | None = None) -> GatewayOptions:
        """Options from the environment, as ``coalesce serve`` passes them.

        ``OPENAI_PORT``, ``HOST``, ``COALESCE_API_KEY[_FILE]``, ``OPENAI_MAX_BODY_BYTES``, and
        Triton's admin key (``COALESCE_ADMIN_KEY[_FILE]``) for its repository index.

        Raises:
            GatewayOptionsError: Naming the variable that is not valid.
        """
        if port is None:
            raw = os.environ.get(PORT_ENV, str(DEFAULT_PORT))
            if not raw.isdigit():
                raise GatewayOptionsError(f"{PORT_ENV}={raw!r} is not a port number")
            port = int(raw)
        raw_body = os.environ.get(MAX_BODY_ENV, str(DEFAULT_MAX_BODY_BYTES))
        if not raw_body.isdigit():
            raise GatewayOptionsError(f"{MAX_BODY_ENV}={raw_body!r}: expected a number of bytes")
        from coalesce_tools.launcher import LaunchError, admin_key_from_env

        try:
            admin_key = admin_key_from_env()
        except LaunchError as exc:
            raise GatewayOptionsError(str(exc)) from None
        return cls(model_repository=model_repository, triton_grpc_url=triton_grpc_url,
                   host=host or os.environ.get("HOST", "127.0.0.1"), port=port, api_keys=api_keys_from_env(),
                   max_body_bytes=int(raw_body), triton_admin_key=admin_key)


def api_keys_from_env() -> tuple[str, ...]:
    """Bearer keys: ``$COALESCE_API_KEY`` (one key), and every non-empty line of ``$COALESCE_API_KEY_FILE``.

    Raises:
        GatewayOptionsError: If the file cannot be read or holds no key.
    """
    keys = [os.environ.get(API_KEY_ENV, "").strip()]
    path = os.environ.get(API_KEY_FILE_ENV, "")
    if path:
        try:
            lines = [line.strip() for line in Path(path).read_text().splitlines()]
        except OSError as exc:
            raise GatewayOptionsError(f"{API_KEY_FILE_ENV}={path!r}: cannot read it ({exc.strerror})") from None
        if not any(lines):
            raise GatewayOptionsError(f"{API_KEY_FILE_ENV}={path!r}: the file holds no key")
        keys += lines
    return tuple(dict.fromkeys(k for k in keys if k))
