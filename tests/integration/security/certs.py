"""Throwaway certificate authorities and certificates for TLS tests, made with the openssl command."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Pki:
    ca: Path
    cert: Path
    """For 127.0.0.1 and localhost, usable by servers and clients alike."""
    key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_pki(directory: Path, name: str = "flywheel-test") -> Pki:
    """A fresh CA and one certificate it signs (EC P-256, valid for a day)."""
    directory.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", f"/CN={name}-ca",
             cwd=directory)
    _openssl("req", *ec, "-keyout", "node.key", "-out", "node.csr", "-subj", f"/CN={name}-node", cwd=directory)
    (directory / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                       "extendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "node.pem", "-days", "1", "-extfile", "ext.cnf", cwd=directory)
    return Pki(ca=directory / "ca.pem", cert=directory / "node.pem", key=directory / "node.key")
