"""The control plane's certificates, generated at test time and never stored: a CA, leaf
certificates for servers and clients (kubelets as ``system:node:<node>``), the ServiceAccount
signing keys (tests/controlplane.py)."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass


@dataclass
class Pki:
    dir: str
    ca_cert: str = ""
    ca_key: object = None
    ca_obj: object = None

    def __post_init__(self):
        from cryptography import x509
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        self.ca_key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sysdra-test-ca")])
        now = datetime.datetime.now(datetime.timezone.utc)
        self.ca_obj = (
            x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(self.ca_key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(self.ca_key, _sha256())
        )  # fmt: skip
        self.ca_cert = self._write("ca.crt", _pem_cert(self.ca_obj))

    def _write(self, name: str, data: bytes) -> str:
        path = os.path.join(self.dir, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return path

    def issue(self, name: str, common_name: str, *, orgs: tuple[str, ...] = (), server: bool = False) -> tuple[str, str]:
        """A leaf certificate signed by the CA: (cert path, key path)."""
        from cryptography import x509
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
        attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
        now = datetime.datetime.now(datetime.timezone.utc)
        builder = (
            x509.CertificateBuilder().subject_name(x509.Name(attrs)).issuer_name(self.ca_obj.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
        )  # fmt: skip
        if server:
            import ipaddress

            builder = builder.add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.DNSName("kubernetes"), x509.DNSName("kubernetes.default.svc"),
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
            ]), critical=False)  # fmt: skip
        cert = builder.sign(self.ca_key, _sha256())
        return self._write(f"{name}.crt", _pem_cert(cert)), self._write(f"{name}.key", _pem_key(key))

    def service_account_keys(self) -> tuple[str, str]:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa

        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        pub = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        return self._write("sa.pub", pub), self._write("sa.key", _pem_key(key))


def _sha256():
    from cryptography.hazmat.primitives import hashes

    return hashes.SHA256()


def _pem_cert(cert) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
