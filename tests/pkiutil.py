"""A throw-away PKI made with the openssl CLI: a CA, server and client certificates (EC P-256,
valid two days, with the extensions strict verifiers such as Python 3.13's require)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(d: Path, name: str) -> None:
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.crt",
        "-days",
        "2",
        "-subj",
        f"/CN={name}",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
        cwd=d,
    )


def make_leaf(d: Path, ca: str, name: str, ext: str) -> None:
    (d / f"{name}.ext").write_text(
        ext + "\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n"
        "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
    )
    _openssl(
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.csr",
        "-subj",
        f"/CN={name}",
        cwd=d,
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        f"{ca}.crt",
        "-CAkey",
        f"{ca}.key",
        "-CAcreateserial",
        "-out",
        f"{name}.crt",
        "-days",
        "2",
        "-extfile",
        f"{name}.ext",
        cwd=d,
    )


def make_pki(d: Path) -> Path:
    """ca, server (localhost, 127.0.0.1, ::1), client (prometheus.example), other-client, and a
    rogue-ca with its own rogue-client."""
    make_ca(d, "ca")
    make_leaf(d, "ca", "server", "subjectAltName=DNS:localhost,IP:127.0.0.1,IP:::1\nextendedKeyUsage=serverAuth")
    make_leaf(d, "ca", "client", "subjectAltName=DNS:prometheus.example\nextendedKeyUsage=clientAuth")
    make_leaf(d, "ca", "other-client", "subjectAltName=DNS:intruder.example\nextendedKeyUsage=clientAuth")
    make_ca(d, "rogue-ca")
    make_leaf(d, "rogue-ca", "rogue-client", "subjectAltName=DNS:prometheus.example\nextendedKeyUsage=clientAuth")
    return d
