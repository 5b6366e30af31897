"""Signed checkpoints: keys, signing and checking (``stepvault.signing``).

A :class:`Signer` (Ed25519 private key, or an HMAC secret) given to the manager or to
``stepvault.save`` signs each manifest as it is committed; a :class:`Verifier` checks
them (``stepvault verify --signatures``). ``signer_from_env`` / ``verifier_from_env``
read ``$STEPVAULT_SIGNING_KEY`` / ``$STEPVAULT_VERIFY_KEY``. Checkpoints committed
before a key existed are signed with :func:`sign_existing`. Failures raise
:class:`~stepvault.errors.SigningError`.

This module is the public face: the work lives in :mod:`stepvault.store.signing` and
:mod:`stepvault.ops.signatures`. Importing it does not import torch.
"""

from __future__ import annotations

from .errors import SigningError
from .ops.signatures import SignatureReport, sign_existing, verify_signatures
from .store.signing import Signer, Verdict, Verifier, signer_from_env, verifier_from_env

__all__ = [
    "SignatureReport",
    "Signer",
    "SigningError",
    "Verdict",
    "Verifier",
    "sign_existing",
    "signer_from_env",
    "verifier_from_env",
    "verify_signatures",
]
