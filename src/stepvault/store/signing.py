"""Signatures over stored records: Ed25519 (``cryptography``) or HMAC-SHA256 with a shared key.

A signature makes tampering *evident*: the envelope checksum of a manifest catches damage,
but anyone who edits a manifest can recompute it; only the holder of the signing key can
produce a signature that verifies. What is signed is the exact byte string of the record
(a manifest file, or the canonical JSON of a registry/annotation record).

A signature record (JSON)::

    {"alg": "ed25519" | "hmac-sha256", "key_id": "<16 hex>", "signed_blake3": "<hex>",
     "signature": "<base64>"}

``key_id`` is the first 16 hex digits of the BLAKE3 of the public key (Ed25519) or of the
shared key (HMAC), so a verifier can tell "signed with another key" from "altered".

Keys come from the API (:meth:`Signer.from_key_file`, :meth:`Signer.hmac`) or from the
environment: ``STEPVAULT_SIGNING_KEY`` names a PEM private key file (Ed25519) or holds
``hmac:<hex or text>``; ``STEPVAULT_VERIFY_KEY`` names a PEM public key file, or is the same
``hmac:`` value.
"""

from __future__ import annotations

import base64
import hashlib
import hmac as _hmac
import json
import os
from dataclasses import dataclass
from typing import Any

from blake3 import blake3

from ..errors import SigningError

SIGNING_KEY_ENV = "STEPVAULT_SIGNING_KEY"
VERIFY_KEY_ENV = "STEPVAULT_VERIFY_KEY"
_ALGS = ("ed25519", "hmac-sha256")


def _crypto():
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise SigningError(
            "Ed25519 signatures need the 'cryptography' package: pip install "
            "'stepvault[signing]' (or use an HMAC key: STEPVAULT_SIGNING_KEY=hmac:<secret>)"
        ) from exc
    return serialization, ed25519


def _key_id(material: bytes) -> str:
    return blake3(material).hexdigest()[:16]


def canonical_json(record: dict[str, Any]) -> bytes:
    """The byte string a JSON record is signed as: sorted keys, no spaces, no ``signature``."""
    body = {k: v for k, v in record.items() if k != "signature"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _hmac_key(text: str) -> bytes:
    secret = text[len("hmac:") :]
    if not secret:
        raise SigningError("empty HMAC key: use hmac:<hex or passphrase>")
    try:
        return bytes.fromhex(secret)
    except ValueError:
        return secret.encode()


class Signer:
    """Signs byte strings; build one with :meth:`generate`, :meth:`from_key_file`, :meth:`hmac`."""

    def __init__(self, alg: str, key: Any, key_id: str) -> None:
        self.alg = alg
        self._key = key
        self.key_id = key_id

    @classmethod
    def hmac(cls, key: bytes | str) -> Signer:
        """HMAC-SHA256 with a shared secret (the same key signs and verifies)."""
        raw = _hmac_key("hmac:" + key) if isinstance(key, str) else bytes(key)
        if len(raw) < 16:
            raise SigningError("HMAC keys must be at least 16 bytes")
        return cls("hmac-sha256", raw, _key_id(raw))

    @classmethod
    def generate(cls) -> Signer:
        """A fresh Ed25519 key pair (save it with :meth:`write_key_files`)."""
        _, ed25519 = _crypto()
        key = ed25519.Ed25519PrivateKey.generate()
        return cls("ed25519", key, _key_id(_raw_public(key.public_key())))

    @classmethod
    def from_key_file(cls, path: str | os.PathLike[str]) -> Signer:
        """An Ed25519 private key from a PEM file (unencrypted PKCS#8)."""
        serialization, ed25519 = _crypto()
        try:
            with open(path, "rb") as f:
                key = serialization.load_pem_private_key(f.read(), password=None)
        except (OSError, ValueError, TypeError) as exc:
            where = os.fspath(path)
            raise SigningError(f"cannot load a private key from {where!r}: {exc}") from exc
        if not isinstance(key, ed25519.Ed25519PrivateKey):
            raise SigningError(f"{os.fspath(path)!r} is not an Ed25519 private key")
        return cls("ed25519", key, _key_id(_raw_public(key.public_key())))

    @classmethod
    def from_spec(cls, spec: str) -> Signer:
        """``hmac:<secret>`` or the path of a PEM private key file."""
        if spec.startswith("hmac:"):
            return cls.hmac(_hmac_key(spec))
        return cls.from_key_file(spec)

    def write_key_files(self, private_path: str, public_path: str) -> None:
        """Write the Ed25519 private key (mode 0600) and its public key as PEM files."""
        if self.alg != "ed25519":
            raise SigningError("only Ed25519 keys have key files; keep HMAC secrets elsewhere")
        serialization, _ = _crypto()
        priv = self._key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(priv)
        with open(public_path, "wb") as f:
            f.write(self.verifier().public_pem())

    def verifier(self) -> Verifier:
        """The verifier matching this signer."""
        if self.alg == "hmac-sha256":
            return Verifier(self.alg, self._key, self.key_id)
        return Verifier(self.alg, self._key.public_key(), self.key_id)

    def sign(self, data: bytes) -> dict[str, Any]:
        """The signature record of ``data``."""
        if self.alg == "hmac-sha256":
            sig = _hmac.new(self._key, data, hashlib.sha256).digest()
        else:
            sig = self._key.sign(data)
        return {
            "alg": self.alg,
            "key_id": self.key_id,
            "signed_blake3": blake3(data).hexdigest(),
            "signature": base64.b64encode(sig).decode(),
        }

    def sign_record(self, record: dict[str, Any]) -> dict[str, Any]:
        """``record`` with a ``signature`` field over its canonical JSON."""
        return {**record, "signature": self.sign(canonical_json(record))}

    def __repr__(self) -> str:
        return f"Signer({self.alg}, key_id={self.key_id})"


def _raw_public(public_key: Any) -> bytes:
    serialization, _ = _crypto()
    return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


@dataclass
class Verdict:
    """Outcome of checking one signature: ``status`` is valid / invalid / unsigned / other-key."""

    status: str
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "valid"


class Verifier:
    """Checks signature records made by the matching :class:`Signer`."""

    def __init__(self, alg: str, key: Any, key_id: str) -> None:
        self.alg = alg
        self._key = key
        self.key_id = key_id

    @classmethod
    def from_spec(cls, spec: str) -> Verifier:
        """``hmac:<secret>``, or a PEM file holding an Ed25519 public (or private) key."""
        if spec.startswith("hmac:"):
            return Signer.hmac(_hmac_key(spec)).verifier()
        serialization, ed25519 = _crypto()
        try:
            with open(spec, "rb") as f:
                pem = f.read()
        except OSError as exc:
            raise SigningError(f"cannot read the key file {spec!r}: {exc}") from exc
        try:
            key = serialization.load_pem_public_key(pem)
        except ValueError:
            try:
                key = serialization.load_pem_private_key(pem, password=None).public_key()
            except (ValueError, TypeError) as exc:
                raise SigningError(f"{spec!r} holds no Ed25519 key: {exc}") from exc
        if not isinstance(key, ed25519.Ed25519PublicKey):
            raise SigningError(f"{spec!r} is not an Ed25519 key")
        return cls("ed25519", key, _key_id(_raw_public(key)))

    def public_pem(self) -> bytes:
        serialization, _ = _crypto()
        return self._key.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )

    def check(self, data: bytes, signature: Any) -> Verdict:
        """Whether ``signature`` (a signature record or None) is a valid one of ``data``."""
        if signature is None:
            return Verdict("unsigned")
        if not isinstance(signature, dict) or signature.get("alg") not in _ALGS:
            return Verdict("invalid", "malformed signature record")
        if signature.get("key_id") != self.key_id or signature["alg"] != self.alg:
            return Verdict(
                "other-key",
                f"signed with {signature.get('alg')} key {signature.get('key_id')}, "
                f"not with the given key {self.key_id}",
            )
        try:
            sig = base64.b64decode(str(signature.get("signature", "")), validate=True)
        except ValueError:
            return Verdict("invalid", "signature is not base64")
        if self.alg == "hmac-sha256":
            good = _hmac.compare_digest(_hmac.new(self._key, data, hashlib.sha256).digest(), sig)
        else:
            from cryptography.exceptions import InvalidSignature

            try:
                self._key.verify(sig, data)
                good = True
            except InvalidSignature:
                good = False
        if good:
            return Verdict("valid")
        return Verdict("invalid", "signature does not match the content (altered)")

    def check_record(self, record: dict[str, Any]) -> Verdict:
        """Check a record carrying its own ``signature`` field (see :meth:`Signer.sign_record`)."""
        return self.check(canonical_json(record), record.get("signature"))

    def __repr__(self) -> str:
        return f"Verifier({self.alg}, key_id={self.key_id})"


def signer_from_env() -> Signer | None:
    """The signer named by ``$STEPVAULT_SIGNING_KEY``, or None when unset."""
    spec = os.environ.get(SIGNING_KEY_ENV)
    return Signer.from_spec(spec) if spec else None


def verifier_from_env() -> Verifier | None:
    """The verifier named by ``$STEPVAULT_VERIFY_KEY`` (or derived from the signing key)."""
    spec = os.environ.get(VERIFY_KEY_ENV)
    if spec:
        return Verifier.from_spec(spec)
    signer = signer_from_env()
    return signer.verifier() if signer else None
