"""The shared tier's secrets: the Redis password, the CA that verifies a ``rediss://`` server, the MAC key.

None of them comes from ``config.pbtxt``: Triton serves a model's config back
(``GET /v2/models/<m>/config``), the load log prints its parameters, and a model-load
request may carry a config (so a parameter naming a file would let that request send
any readable file to a Redis of its choosing as a password). The server's environment,
which the Python backend's stub inherits, carries each secret or the path of a file
holding it. Read once at load; the values are kept out of every repr and log line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from coalesce.core.errors import ConfigError

#: The Redis password itself.
PASSWORD_ENV: Final = "COALESCE_REDIS_PASSWORD"
#: A file holding the Redis password (wins over ``COALESCE_REDIS_PASSWORD``).
PASSWORD_FILE_ENV: Final = "COALESCE_REDIS_PASSWORD_FILE"
#: CA certificates (PEM) that verify a ``rediss://`` server; without it, the system's.
CA_FILE_ENV: Final = "COALESCE_REDIS_CA_FILE"
#: The secret that signs shared-tier values.
CACHE_KEY_ENV: Final = "COALESCE_CACHE_KEY"
#: A file holding that secret (wins over ``COALESCE_CACHE_KEY``).
CACHE_KEY_FILE_ENV: Final = "COALESCE_CACHE_KEY_FILE"


@dataclasses.dataclass(frozen=True)
class TierSecrets:
    """What the shared tier needs besides its URL.

    Attributes:
        password: The Redis password, or None (no ``AUTH``).
        ca_file: CA certificates for a ``rediss://`` server, or None (the system's).
        mac_secret: The bytes the MAC key is derived from.
        mac_source: Where ``mac_secret`` came from, for the load log (never the secret).
    """

    password: str | None = dataclasses.field(repr=False)
    ca_file: str | None
    mac_secret: bytes = dataclasses.field(repr=False)
    mac_source: str


def read_secrets(fingerprint: bytes, environ: Mapping[str, str]) -> TierSecrets:
    """The tier's secrets from ``environ`` (a file named there wins); the MAC falls back to ``fingerprint``.

    Without a configured secret the values are still bound to their keys and to the
    model's outputs, so stale, truncated or copied values are refused; only a secret
    keeps out someone who can write to Redis and knows the model's files.

    Raises:
        ConfigError: If a named file cannot be read or is empty (the message names the file, never its content).
    """
    password = _secret_file(environ, PASSWORD_FILE_ENV) or environ.get(PASSWORD_ENV) or None
    ca_file = environ.get(CA_FILE_ENV) or None
    if ca_file is not None and not Path(ca_file).is_file():
        raise ConfigError(f"environment variable {CA_FILE_ENV} names '{ca_file}', which is not a readable file")
    secret = _secret_file(environ, CACHE_KEY_FILE_ENV)
    if secret is not None:
        return TierSecrets(password=password, ca_file=ca_file, mac_secret=secret.encode("utf-8"),
                           mac_source=f"the file named by {CACHE_KEY_FILE_ENV}")
    if environ.get(CACHE_KEY_ENV):
        return TierSecrets(password=password, ca_file=ca_file, mac_secret=environ[CACHE_KEY_ENV].encode("utf-8"),
                           mac_source=CACHE_KEY_ENV)
    return TierSecrets(password=password, ca_file=ca_file, mac_secret=fingerprint,
                       mac_source=f"the output fingerprint (neither {CACHE_KEY_ENV} nor {CACHE_KEY_FILE_ENV} is set)")


def _secret_file(environ: Mapping[str, str], variable: str) -> str | None:
    """The content of the file ``environ[variable]`` names, without its trailing line break; None if unset.

    Raises:
        ConfigError: If the file cannot be read or is empty.
    """
    path = environ.get(variable, "")
    if not path:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8").rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"environment variable {variable} names '{path}', which cannot be read "
                          f"({type(exc).__name__})") from None
    if not text:
        raise ConfigError(f"environment variable {variable} names '{path}', which is empty")
    return text
