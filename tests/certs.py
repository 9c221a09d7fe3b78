"""Test PKI: a CA, a server certificate for 127.0.0.1/localhost, and client certificates
(with and without a role in their OU, with hostile subjects, expired, or from a CA the server
does not trust), written as PEM files into a directory."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

ONE_DAY = datetime.timedelta(days=1)


@dataclass(frozen=True)
class Pem:
    cert: Path
    key: Path


def _name(cn: str, ou: str | None = None, *more: x509.NameAttribute) -> x509.Name:
    parts = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if ou:
        parts.append(x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, ou))
    return x509.Name([*parts, *more])


def _write(directory: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Pem:
    cert_path, key_path = directory / f"{stem}.crt", directory / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return Pem(cert_path, key_path)


class CertificateAuthority:
    def __init__(self, directory: Path, name: str) -> None:
        self.directory = directory
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(_name(name))
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - ONE_DAY)
            .not_valid_after(now + ONE_DAY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.pem = _write(directory, name, self.cert, self.key)

    def issue(
        self,
        stem: str,
        cn: str,
        ou: str | None = None,
        *more: x509.NameAttribute,
        server: bool = False,
        expired: bool = False,
    ) -> Pem:
        """`more`: further subject attributes (a second OU or CN, an O), in this order."""
        import ipaddress

        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        start, end = (now - 3 * ONE_DAY, now - 2 * ONE_DAY) if expired else (now - ONE_DAY, now + ONE_DAY)
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(cn, ou, *more))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
        )
        if server:
            san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return _write(self.directory, stem, builder.sign(self.key, hashes.SHA256()), key)
