"""Certificates for the TLS tests, made with the `openssl` command: a CA and a leaf it signed."""

from __future__ import annotations

import subprocess
from pathlib import Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def ca_and_leaf(folder: Path, name: str, alt_names: str | None = None) -> None:
    """folder/ca.pem and a leaf (leaf.pem, leaf.key) it signed, for client and server use,
    carrying `name` as its DNS subjectAltName (or `alt_names`, e.g. "DNS:a,IP:127.0.0.1")."""
    folder.mkdir(parents=True)
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", f"/CN={folder.name}-ca", cwd=folder)
    _openssl("req", *ec, "-keyout", "leaf.key", "-out", "leaf.csr", "-subj", f"/CN={name}",
             cwd=folder)
    (folder / "ext").write_text(f"subjectAltName={alt_names or 'DNS:' + name}\n"
                                "extendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("x509", "-req", "-in", "leaf.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "leaf.pem", "-days", "2", "-extfile", "ext", cwd=folder)
