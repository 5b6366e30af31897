"""Who may talk to the dashboard: loopback by default, a token for anything else.

- :func:`check_bind` refuses a non-loopback address without a token (before any socket is
  opened), so a dashboard is never exposed to a network by accident.
- :class:`GuardMiddleware` checks the token on every request (``Authorization: Bearer``,
  the ``stepvault_token_<port>`` cookie, or ``?token=`` once, which sets the cookie),
  compared in constant time; cookies are not scoped by port, so each dashboard's cookie
  is named after its own port and two dashboards on one host do not overwrite each
  other's. On loopback it also refuses ``Host`` headers that are not a loopback name or
  address (DNS rebinding: a web page elsewhere that resolves its own name to 127.0.0.1).
  Every response carries headers that forbid framing, sniffing and any script or style
  not served by the dashboard; pages are never cached, the static files (whose URLs carry
  a digest of their content) are.
"""

from __future__ import annotations

import hmac
import ipaddress
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode

from ..errors import UnsafeBindError

COOKIE = "stepvault_token"
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
_BASE_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    ),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]
SECURITY_HEADERS = [*_BASE_HEADERS, (b"cache-control", b"no-store")]
#: The static files: their URLs carry a digest of the files, so a year is safe.
STATIC_HEADERS = [*_BASE_HEADERS, (b"cache-control", b"public, max-age=31536000, immutable")]


def cookie_name(port: int | None) -> str:
    """The token cookie of the dashboard on ``port`` (browsers share cookies across the
    ports of a host: one name per port keeps two dashboards apart)."""
    return f"{COOKIE}_{port}" if port else COOKIE


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (127.0.0.0/8, ::1)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def check_bind(host: str, token: str | None) -> None:
    """Refuse to serve on a non-loopback ``host`` without a token (or with a weak one)."""
    if is_loopback(host):
        return
    if not token:
        raise UnsafeBindError(
            f"refusing to listen on {host}: a dashboard reachable from other machines needs a "
            "token (--token SECRET or $STEPVAULT_UI_TOKEN); or keep the default --host 127.0.0.1"
        )
    if len(token) < 16:
        raise UnsafeBindError("the token must be at least 16 characters long")


def _host_name(value: str) -> str:
    if value.startswith("["):  # [::1]:8000
        return value[1:].partition("]")[0]
    return value.rpartition(":")[0] if value.count(":") == 1 else value


class GuardMiddleware:
    """ASGI middleware: token check, loopback Host check and security headers."""

    def __init__(self, app: Any, *, token: str | None, loopback_only: bool) -> None:
        self.app = app
        self.token = token.encode() if token else None
        self.loopback_only = loopback_only

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.loopback_only and not is_loopback(_host_name(headers.get("host", ""))):
            return await _plain(send, 400, "bad Host header: this dashboard serves loopback only")
        server = scope.get("server") or (None, None)
        cookie_key = cookie_name(server[1] if len(server) > 1 else None)
        if self.token is not None:
            query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
            given, from_query = self._given(headers, query, cookie_key)
            if given is None or not hmac.compare_digest(given.encode(), self.token):
                return await _plain(
                    send, 401, "a token is needed: open the URL printed by `stepvault ui`"
                )
            if from_query:  # trade the token in the URL for a cookie, and drop it from the URL
                rest = urlencode([(k, v) for k, v in query.items() if k != "token"])
                location = quote(scope["path"]) + (f"?{rest}" if rest else "")  # no CR/LF
                cookie = f"{cookie_key}={given}; HttpOnly; SameSite=Strict; Path=/"
                return await _send(
                    send,
                    303,
                    b"",
                    [(b"location", location.encode()), (b"set-cookie", cookie.encode())],
                )

        static = str(scope.get("path", "")).startswith("/static/")
        extra = STATIC_HEADERS if static else SECURITY_HEADERS

        async def with_headers(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                ok = message.get("status", 200) == 200
                added = extra if ok else SECURITY_HEADERS  # an error is never cached
                message = {**message, "headers": [*message.get("headers", []), *added]}
            await send(message)

        return await self.app(scope, receive, with_headers)

    def _given(
        self, headers: dict[str, str], query: dict[str, str], cookie_key: str
    ) -> tuple[str | None, bool]:
        auth = headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            return auth[7:].strip(), False
        cookie = SimpleCookie()
        try:
            cookie.load(headers.get("cookie", ""))
        except Exception:  # a malformed cookie header is simply no token
            cookie = SimpleCookie()
        if "token" in query:  # a URL's own token first: another dashboard's cookie is not it
            return query["token"], True
        if cookie_key in cookie:
            return cookie[cookie_key].value, False
        return None, False


async def _plain(send: Any, status: int, text: str) -> None:
    await _send(send, status, text.encode(), [(b"content-type", b"text/plain; charset=utf-8")])


async def _send(send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*headers, (b"content-length", str(len(body)).encode()), *SECURITY_HEADERS],
        }
    )
    await send({"type": "http.response.body", "body": body})
