"""A throwaway CA with a server and a client certificate, for the TLS and mTLS tests."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _issue(subject: str, issuer_key, issuer_name: x509.Name | None, *, ca: bool, usage=None, sans=()):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name or _name(subject))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    cert = builder.sign(issuer_key or key, hashes.SHA256())
    return key, cert


def _write(path: Path, key, cert) -> tuple[Path, Path]:
    cert_path, key_path = path.with_suffix(".crt"), path.with_suffix(".key")
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


def make_tls_files(directory: Path) -> TlsFiles:
    ca_key, ca_cert = _issue("specdec test CA", None, None, ca=True)
    server_sans = (x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
    server_key, server_cert = _issue(
        "localhost", ca_key, ca_cert.subject, ca=False, usage=ExtendedKeyUsageOID.SERVER_AUTH, sans=server_sans
    )
    client_key, client_cert = _issue(
        "specdec client", ca_key, ca_cert.subject, ca=False, usage=ExtendedKeyUsageOID.CLIENT_AUTH
    )
    ca_path, _ = _write(directory / "ca", ca_key, ca_cert)
    server_cert_path, server_key_path = _write(directory / "server", server_key, server_cert)
    client_cert_path, client_key_path = _write(directory / "client", client_key, client_cert)
    return TlsFiles(ca_path, server_cert_path, server_key_path, client_cert_path, client_key_path)
