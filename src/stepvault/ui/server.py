"""Serving the dashboard with uvicorn (what ``stepvault ui`` runs)."""

from __future__ import annotations

from collections.abc import Callable

from .app import DEFAULT_REFRESH, create_app
from .security import check_bind, is_loopback


def serve(
    root: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8765,
    token: str | None = None,
    allow_actions: bool = False,
    refresh_seconds: float = DEFAULT_REFRESH,
    announce: Callable[[str], None] = print,
) -> None:
    """Serve the dashboard over ``root`` until interrupted.

    Refuses (:class:`~stepvault.ui.security.UnsafeBindError`) a non-loopback ``host``
    without a ``token``; with one, every request must carry it.
    """
    import uvicorn

    check_bind(host, token)
    app = create_app(
        root,
        token=token,
        loopback_only=is_loopback(host) and token is None,
        allow_actions=allow_actions,
        refresh_seconds=refresh_seconds,
    )
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}/" + (f"?token={token}" if token else "")
    mode = "actions allowed" if allow_actions else "read-only"
    announce(f"stepvault ui ({mode}) on {url}  (Ctrl-C to stop)")
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
