"""Serving the dashboard with uvicorn (what ``stepvault ui`` runs)."""

from __future__ import annotations

import socket
from collections.abc import Callable

from ..errors import StepvaultError
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
    # Bound before the banner: a port in use is an error naming it, never a banner for a
    # URL another server answers; --port 0 announces the port the system chose.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise StepvaultError(
            f"cannot serve on {host}:{port}: {exc.strerror} (another dashboard? pick another "
            "--port, or --port 0 for a free one)"
        ) from None
    port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}/" + (f"?token={token}" if token else "")
    mode = "actions allowed" if allow_actions else "read-only"
    announce(f"stepvault ui ({mode}) on {url}  (Ctrl-C to stop)")
    config = uvicorn.Config(app, log_level="warning", access_log=False)
    uvicorn.Server(config).run(sockets=[sock])
