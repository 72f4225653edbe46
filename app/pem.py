"""The PEM files a setting names (the Endpoint Picker's certificate, key and client CA):
read, and checked to hold what they should.

Config checks them when it loads (a wrong file is one clear line before anything
starts); the Endpoint Picker reads them when it starts. cryptography is imported here
only: config imports this module only when the Endpoint Picker is on.
"""

from __future__ import annotations

from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

__all__ = ["check_pem_files", "read_pem"]


def read_pem(path: str, what: str, setting: str) -> bytes:
    """The bytes of the file `setting` names; ValueError (starting with the setting) if it
    cannot be read."""
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{setting}: the {what} {path} cannot be read: "
                         f"{exc.strerror or exc}") from None


def check_pem_files(certfile: str | None, keyfile: str | None,
                    client_ca: str | None) -> None:
    """Raise ValueError (starting with the setting's name) unless each given file holds
    what it should: certificates, and a private key matching the first certificate."""
    if certfile is not None and keyfile is not None:
        certificates = _certificates(read_pem(certfile, "certificate", "epp_tls_certfile"),
                                     certfile, "epp_tls_certfile")
        try:
            key = serialization.load_pem_private_key(
                read_pem(keyfile, "key", "epp_tls_keyfile"), password=None)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"epp_tls_keyfile: {keyfile} is not an unencrypted PEM private "
                             f"key: {exc}") from None
        if (key.public_key().public_bytes(serialization.Encoding.DER,
                                          serialization.PublicFormat.SubjectPublicKeyInfo)
                != certificates[0].public_key().public_bytes(
                    serialization.Encoding.DER,
                    serialization.PublicFormat.SubjectPublicKeyInfo)):
            raise ValueError(f"epp_tls_keyfile: {keyfile} is not the key of the first "
                             f"certificate in {certfile}")
    if client_ca is not None:
        _certificates(read_pem(client_ca, "CA bundle", "epp_client_ca"), client_ca,
                      "epp_client_ca")


def _certificates(pem: bytes, path: str, setting: str) -> list[x509.Certificate]:
    try:
        certificates = x509.load_pem_x509_certificates(pem)
    except ValueError as exc:
        raise ValueError(f"{setting}: {path} holds no PEM certificate: {exc}") from None
    return certificates
