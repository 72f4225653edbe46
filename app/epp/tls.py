"""The Endpoint Picker's TLS: the configured certificate, or a self-signed one.

Gateways connect to an Endpoint Picker over TLS and usually do not verify its certificate
(the reference pickers serve a self-signed one), so when no certificate is configured a
fresh one is made at every start: an ECDSA P-256 key that never leaves memory, valid for a
year, naming `localhost`, the loopback addresses and the address kvroute binds. Mutual TLS
is available: with a client CA, a client must present a certificate that CA signed.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvroute.app.pem import check_pem_files, read_pem

__all__ = ["ServerIdentity", "load_identity", "self_signed"]

VALIDITY = datetime.timedelta(days=365)


@dataclass(frozen=True)
class ServerIdentity:
    """What the EPP presents: its certificate chain and key (PEM), the clients' CA when
    clients must present certificates, and whether the certificate was made here."""

    certificate: bytes
    key: bytes
    client_ca: bytes | None
    self_signed: bool

    @property
    def fingerprint(self) -> str:
        """SHA-256 of the leaf certificate (DER), as `openssl x509 -fingerprint` shows it."""
        leaf = x509.load_pem_x509_certificates(self.certificate)[0]
        digest = hashlib.sha256(leaf.public_bytes(serialization.Encoding.DER)).hexdigest()
        return ":".join(digest[i:i + 2] for i in range(0, len(digest), 2)).upper()


def self_signed(host: str) -> tuple[bytes, bytes]:
    """(certificate, key) in PEM: a self-signed certificate for `host` and loopback."""
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName("localhost"),
                                     x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                     x509.IPAddress(ipaddress.ip_address("::1"))]
    bare = host.strip("[]")
    try:
        address = ipaddress.ip_address(bare)
        if not address.is_unspecified and x509.IPAddress(address) not in names:
            names.append(x509.IPAddress(address))
    except ValueError:
        if bare.lower() != "localhost":
            names.append(x509.DNSName(bare))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvroute endpoint picker")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # clocks differ a little
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        # Its own trust anchor: a client that does verify can pin this certificate.
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    return (certificate.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


def load_identity(host: str, certfile: str | None, keyfile: str | None,
                  client_ca: str | None) -> ServerIdentity:
    """The configured certificate and key, or a self-signed pair for `host`; files are
    checked as `check_pem_files` does (ValueError)."""
    check_pem_files(certfile, keyfile, client_ca)
    ca = read_pem(client_ca, "CA bundle", "epp_client_ca") if client_ca else None
    if certfile is not None and keyfile is not None:
        return ServerIdentity(read_pem(certfile, "certificate", "epp_tls_certfile"),
                              read_pem(keyfile, "key", "epp_tls_keyfile"), ca, self_signed=False)
    certificate, key = self_signed(host)
    return ServerIdentity(certificate, key, ca, self_signed=True)
