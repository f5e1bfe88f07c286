"""Certificates made for a test with the ``openssl`` command: a CA, a server certificate, a client certificate."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Certificates:
    """PEM files: the CA, the server's certificate and key (for 127.0.0.1 and localhost), a client's."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_certificates(folder: Path) -> Certificates:
    """A fresh CA in ``folder`` and a server and a client certificate it signed (one day, EC P-256)."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, ca = folder / "ca.key", folder / "ca.pem"
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "1",
             "-subj", "/CN=coalesce test CA", "-keyout", str(ca_key), "-out", str(ca))
    made: dict[str, tuple[Path, Path]] = {}
    for name, extension in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
                            ("client", "extendedKeyUsage=clientAuth")):
        key, csr, cert = folder / f"{name}.key", folder / f"{name}.csr", folder / f"{name}.pem"
        _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj",
                 f"/CN=coalesce test {name}", "-keyout", str(key), "-out", str(csr))
        ext = folder / f"{name}.ext"
        ext.write_text(extension + "\n")
        _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
                 "-days", "1", "-extfile", str(ext), "-out", str(cert))
        made[name] = (cert, key)
    return Certificates(ca=ca, server_cert=made["server"][0], server_key=made["server"][1],
                        client_cert=made["client"][0], client_key=made["client"][1])
