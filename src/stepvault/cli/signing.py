"""Key and signature commands: ``keygen`` (an Ed25519 pair) and ``sign`` (existing
manifests of a run, on every tier). ``verify --signatures`` lives with ``verify``."""

from __future__ import annotations

from typing import Annotated

import typer

from ..errors import StepvaultError
from ..store import Store
from ..store.signing import Signer
from .common import JsonOpt, RootOpt, _emit_json, _fail, _ops, _root, app, console
from .registry import KeyOpt, _signer


@app.command("keygen")
def keygen_cmd(
    out: Annotated[str, typer.Argument(help="Writes OUT.key (private, 0600) and OUT.pub.")],
    as_json: JsonOpt = False,
) -> None:
    """Create an Ed25519 key pair for signing manifests and registry records."""
    try:
        signer = Signer.generate()
        signer.write_key_files(out + ".key", out + ".pub")
    except (StepvaultError, OSError) as exc:
        return _fail(exc)
    if as_json:
        return _emit_json(
            {"key": f"{out}.key", "public_key": f"{out}.pub", "key_id": signer.key_id}
        )
    console.print(
        f"wrote {out}.key (keep it secret) and {out}.pub (key id {signer.key_id}); sign with "
        f"STEPVAULT_SIGNING_KEY={out}.key, verify with --key {out}.pub",
        highlight=False,
    )
    return None


@app.command("sign")
def sign_cmd(
    run: Annotated[str, typer.Argument(help="Run whose unsigned manifests to sign.")],
    key: KeyOpt = None,
    root: RootOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Sign the committed manifests of RUN that have no signature yet."""
    try:
        signer = _signer(key)
        if signer is None:
            raise StepvaultError("no key: pass --key FILE.key (or hmac:SECRET)")
        n = _ops().sign_existing(Store.open(_root(root)), signer, run)
    except (StepvaultError, ValueError, OSError) as exc:
        return _fail(exc)
    if as_json:
        return _emit_json({"run": run, "signed": n, "key_id": signer.key_id})
    console.print(f"signed {n} manifest(s) of {run} with key {signer.key_id}", highlight=False)
    return None
