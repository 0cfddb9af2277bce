"""A run's certificates for mutual TLS (``diloco certs``, ``diloco local --tls``): one CA
per run and one certificate that every process of the run presents, as server and as
client. It names ``rpc.TLS_SERVER_NAME`` (which every channel verifies) and any extra
hosts given; the CA's private key is written beside it (0600) only to sign more.

For a cluster, a cert-manager ``Certificate`` issued by a per-run CA gives the same three
files (``ca.crt``, ``tls.crt``, ``tls.key``) with ``rpc.TLS_SERVER_NAME`` among its DNS
names.
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from diloco.errors import AlreadyExists, InvalidArgument
from diloco.files import atomic_write
from diloco.rpc import TLS_SERVER_NAME

CA_KEY = "ca.key"


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "diloco"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in [TLS_SERVER_NAME, *hosts]:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            if not host or any(c.isspace() or c == "/" for c in host):
                raise InvalidArgument(f"not a host name or IP address: {host!r}") from None
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def make_certs(out: Path, hosts: list[str] = (), days: int = 365, overwrite: bool = False) -> list[Path]:
    """Write ``ca.crt``, ``ca.key``, ``tls.crt`` and ``tls.key`` into ``out``. Keys are
    0600; an existing set is kept unless ``overwrite`` (a new CA locks out every process
    that holds the old one)."""
    if days < 1:
        raise InvalidArgument(f"--days must be >= 1, got {days}")
    out = Path(out)
    files = [out / n for n in ("ca.crt", CA_KEY, "tls.crt", "tls.key")]
    if not overwrite and any(f.exists() for f in files):
        raise AlreadyExists(f"{out} already holds certificates; pass --overwrite to replace them (every process "
                            "of the run then needs the new ones)")
    san = _san(list(hosts))
    now = datetime.datetime.now(datetime.timezone.utc)
    valid_from, valid_to = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("diloco run CA")
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(valid_from).not_valid_after(valid_to)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                                     encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder().subject_name(_name(TLS_SERVER_NAME)).issuer_name(ca_name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(valid_from).not_valid_after(valid_to)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(san, critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    out.mkdir(parents=True, exist_ok=True)
    contents = [ca.public_bytes(serialization.Encoding.PEM), _pem_key(ca_key),
                cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)]
    for path, data in zip(files, contents):
        atomic_write(path, data, mode=0o600 if path.name.endswith(".key") else 0o644)
    return files
