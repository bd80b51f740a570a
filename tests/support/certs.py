"""Test certificates: a CA made on the spot, and the server and client certificates it signs."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from elasticrun.store.wire import TlsKeyPair


class TestCa:
    """A fresh CA; `issue` signs certificates for 127.0.0.1 / localhost with it."""

    __test__ = False  # not a test class, whatever its name

    def __init__(self, name: str = "test CA") -> None:
        now = datetime.datetime.now(datetime.UTC)
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        cert = (
            x509.CertificateBuilder()
            .subject_name(self._name)
            .issuer_name(self._name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        #: the CA's certificate, PEM
        self.pem = cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, name: str = "localhost", *, expired: bool = False, uris: Sequence[str] = ()) -> TlsKeyPair:
        """A certificate and key for `name` (valid for a day; `expired`: ended yesterday),
        with 127.0.0.1 and localhost as its addresses: a server's or a client's; `uris`
        are more subject alternative names (a store role: `elasticrun:reader`)."""
        now = datetime.datetime.now(datetime.UTC)
        start = now - datetime.timedelta(days=2 if expired else 0, minutes=5)
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self._name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(now - datetime.timedelta(days=1) if expired else now + datetime.timedelta(days=1))
            .add_extension(
                x509.SubjectAlternativeName(
                    [
                        x509.DNSName("localhost"),
                        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                        *(x509.UniformResourceIdentifier(uri) for uri in uris),
                    ]
                ),
                critical=False,
            )
            .sign(self._key, hashes.SHA256())
        )
        return TlsKeyPair(
            cert=cert.public_bytes(serialization.Encoding.PEM),
            key=key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
        )


def write_pair(pair: TlsKeyPair, directory: Path, name: str) -> tuple[Path, Path]:
    """Write `pair` as <name>.crt and <name>.key in `directory`; their paths."""
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    cert.write_bytes(pair.cert)
    key.write_bytes(pair.key)
    return cert, key
