"""Certificates for a TLS redis-server in tests, made with the ``openssl`` command: a CA and a loopback server."""

from __future__ import annotations

import subprocess
from pathlib import Path

from coalesce_tools.launcher import RedisTls


def make_tls_files(folder: Path) -> RedisTls:
    """A fresh CA and a server certificate it signs, valid for ``localhost`` and ``127.0.0.1`` (PEM files)."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = folder / "ca.key", folder / "ca.pem"
    key, csr, cert = folder / "server.key", folder / "server.csr", folder / "server.pem"
    extensions = folder / "server.ext"
    extensions.write_text("subjectAltName = DNS:localhost, IP:127.0.0.1\n")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca_cert),
            "-days", "2", "-subj", "/CN=coalesce test CA")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", "/CN=localhost")
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca_cert), "-CAkey", str(ca_key), "-CAcreateserial",
            "-out", str(cert), "-days", "2", "-extfile", str(extensions))
    return RedisTls(cert_file=cert, key_file=key, ca_file=ca_cert)
