"""Certificates the operator issues: a CA and a serving certificate signed by it (pure, apart from
the randomness of the keys). The conversion webhook serves one; with ``--data-plane-tls`` each job's
token Secret carries one for its trainer's servers.

The CA's private key signs the serving certificate once, at issue, and is dropped: a rotation
issues a new CA, and a stored key would let whoever reads the Secret mint certificates that are
trusted.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

ROTATE_AT_FRACTION = 1 / 3
"""A certificate is re-issued when less than this fraction of its lifetime is left."""


@dataclass(frozen=True)
class Certificates:
    """PEM text of the CA, the serving certificate and key, and the published bundle. The CA's
    private key signs the serving certificate once, at issue, and is dropped: a rotation issues
    a new CA, so nothing needs it later, and a stored key would let whoever reads the Secret
    mint certificates the API server trusts."""

    ca: str
    cert: str
    key: str
    bundle: str

    def to_secret_data(self) -> dict[str, str]:
        return {
            k: base64.b64encode(v.encode()).decode()
            for k, v in {
                "ca.crt": self.ca,
                "tls.crt": self.cert,
                "tls.key": self.key,
                "bundle.crt": self.bundle,
            }.items()
        }

    @classmethod
    def from_secret(cls, secret: dict[str, Any]) -> Certificates | None:
        data = secret.get("data") or {}
        try:
            text = {k: base64.b64decode(data[k]).decode() for k in SECRET_KEYS}
        except (KeyError, ValueError):
            return None
        return cls(text["ca.crt"], text["tls.crt"], text["tls.key"], text["bundle.crt"])

    def not_after(self) -> datetime.datetime:
        return x509.load_pem_x509_certificate(self.cert.encode()).not_valid_after_utc

    def lifetime(self) -> datetime.timedelta:
        cert = x509.load_pem_x509_certificate(self.cert.encode())
        return cert.not_valid_after_utc - cert.not_valid_before_utc

    def names(self) -> set[str]:
        cert = x509.load_pem_x509_certificate(self.cert.encode())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        return {str(n) for n in san.get_values_for_type(x509.DNSName)} | {
            str(ip) for ip in san.get_values_for_type(x509.IPAddress)
        }

    def due(self, now: datetime.datetime, hosts: list[str], validity: datetime.timedelta) -> bool:
        """Whether a new certificate is needed: little lifetime left, longer left than
        ``validity`` now allows, or a host not covered."""
        left = self.not_after() - now
        too_long = left > validity + datetime.timedelta(minutes=2)
        short = left < self.lifetime() * ROTATE_AT_FRACTION
        return short or too_long or not set(hosts) <= self.names()


SECRET_KEYS = ("ca.crt", "tls.crt", "tls.key", "bundle.crt")
DROPPED_KEYS = ("ca.key",)
"""Keys an earlier release stored that are removed at the next start (the CA's private key)."""


def issue_certificates(
    hosts: list[str], validity: datetime.timedelta, now: datetime.datetime, previous_ca: str = ""
) -> Certificates:
    """A fresh CA and a serving certificate for ``hosts`` (DNS names or IPs), valid from a minute
    before ``now`` for ``validity``; the bundle trusts the new CA and ``previous_ca``."""
    start, end = now - datetime.timedelta(minutes=1), now + validity
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"rljob-operator-ca-{now:%s}")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_usage(cert_sign=True), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_usage(cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    ca_pem = ca.public_bytes(serialization.Encoding.PEM).decode()
    return Certificates(
        ca=ca_pem,
        cert=cert.public_bytes(serialization.Encoding.PEM).decode(),
        key=_key_pem(key),
        bundle=ca_pem + previous_ca,
    )


def _usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=not cert_sign,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _key_pem(key: ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
