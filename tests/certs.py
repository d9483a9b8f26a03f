"""Test certificates made with ``openssl`` at test time (nothing checked in, nothing reused).

EC P-256 keys: quicker to make than RSA, which matters on a 2-core machine."""

from __future__ import annotations

import subprocess
from pathlib import Path

#: Names a loopback server certificate is valid for.
LOOPBACK_SAN = "subjectAltName=DNS:localhost,IP:127.0.0.1"
_EC_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def self_signed(
    folder: Path, name: str = "server", common_name: str = "localhost"
) -> tuple[str, str]:
    """A self-signed certificate valid for localhost and 127.0.0.1: (cert path, key path)."""
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    _openssl(
        "req", "-x509", *_EC_KEY, "-days", "1", "-subj", f"/CN={common_name}",
        "-addext", LOOPBACK_SAN, "-keyout", str(key), "-out", str(cert),
    )  # fmt: skip
    return str(cert), str(key)


def ca_signed(folder: Path, subjects: dict[str, tuple[str, str]]) -> dict[str, Path]:
    """A CA (``ca.pem``/``ca.key``) and, per ``name: (common name, extension line)``, a
    certificate it signed (``name.pem``/``name.key``)."""
    files = {"ca.pem": folder / "ca.pem", "ca.key": folder / "ca.key"}
    _openssl(
        "req", "-x509", *_EC_KEY, "-days", "1", "-subj", "/CN=test-ca",
        "-keyout", str(files["ca.key"]), "-out", str(files["ca.pem"]),
    )  # fmt: skip
    for name, (common_name, extension) in subjects.items():
        key, request, cert = folder / f"{name}.key", folder / f"{name}.csr", folder / f"{name}.pem"
        ext = folder / f"{name}.ext"
        ext.write_text(extension + "\n")
        _openssl("req", *_EC_KEY, "-subj", f"/CN={common_name}", "-keyout", str(key),
                 "-out", str(request))  # fmt: skip
        _openssl(
            "x509", "-req", "-in", str(request), "-CA", str(files["ca.pem"]),
            "-CAkey", str(files["ca.key"]), "-CAcreateserial", "-days", "1",
            "-extfile", str(ext), "-out", str(cert),
        )  # fmt: skip
        files[f"{name}.pem"], files[f"{name}.key"] = cert, key
    return files
