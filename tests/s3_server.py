"""A real S3-compatible HTTP server for tests: moto's server mode on 127.0.0.1, plus an
HTTP proxy that injects faults (5xx, throttling, connections reset before or after the
request reached the server) into a fraction of requests.

Clients talk HTTP to it through s3fs/boto3 exactly as they would to AWS; nothing in the
client is mocked. Tests get the server from the ``s3`` fixture (tests/conftest.py), which
skips them where moto or s3fs is not installed; moto is imported only when a server starts,
so ``ENV`` and ``FaultProxy`` import everywhere and tests that need neither still run.
"""

from __future__ import annotations

import http.client
import logging
import os
import random
import socket
import struct
import threading
import uuid
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CREDENTIALS = {"key": "testing", "secret": "testing"}
ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class MotoS3:
    """moto's S3 server on an ephemeral port of 127.0.0.1."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer  # optional: only a started server needs it

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)

    def start(self) -> MotoS3:
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
        for k, v in ENV.items():
            os.environ.setdefault(k, v)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        return self

    def stop(self) -> None:
        self.server.stop()

    def client(self, endpoint: str | None = None):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=endpoint or self.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )

    def new_bucket(self) -> str:
        name = f"sv-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name


_SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
_INTERNAL = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code>'
    b"<Message>We encountered an internal error. Please try again.</Message></Error>"
)
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade"}


class FaultProxy:
    """Forwards HTTP to ``upstream``; fails a fraction ``rate`` of requests.

    Which requests fail is random (seeded); the kind of fault cycles through ``503``
    SlowDown (throttling), ``500`` InternalError, ``reset`` (connection dropped before the
    server saw the request) and ``lost`` (the server applied the request, then the
    connection dropped before the response: the client cannot know it succeeded).
    ``counts`` records what happened.
    """

    FAULTS = ("503", "500", "reset", "lost")

    def __init__(self, upstream: str, rate: float = 0.1, seed: int = 0) -> None:
        self.upstream = upstream.removeprefix("http://")
        self.rate = rate
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        #: every request as (method, path, is a server-side copy), for request-count tests
        self.requests: list[tuple[str, str, bool]] = []
        #: ``cut(method, path)`` true: that request's connection is reset before it reaches
        #: the server, every time (a link cut during an upload); None: no cut
        self.cut: Callable[[str, str], bool] | None = None
        self._next = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _body(self) -> bytes:
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    out = bytearray()
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return bytes(out)
                        out += self.rfile.read(size)
                        self.rfile.readline()
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else b""

            def _reset(self) -> None:
                # RST instead of FIN: the client sees "connection reset by peer".
                self.connection.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
                self.close_connection = True
                try:
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

            def _error(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _handle(self) -> None:
                body = self._body()
                copy = "x-amz-copy-source" in {k.lower() for k in self.headers}
                with proxy.lock:
                    proxy.requests.append((self.command, self.path, copy))
                if proxy.cut is not None and proxy.cut(self.command, self.path):
                    with proxy.lock:
                        proxy.counts["cut"] += 1
                    return self._reset()
                fault = proxy._pick()
                if fault == "503":
                    return self._error(503, _SLOW_DOWN)
                if fault == "500":
                    return self._error(500, _INTERNAL)
                if fault == "reset":
                    return self._reset()
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                headers["Content-Length"] = str(len(body))
                conn = http.client.HTTPConnection(proxy.upstream, timeout=60)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    status, rheaders = resp.status, resp.getheaders()
                finally:
                    conn.close()
                if fault == "lost":
                    return self._reset()
                self.send_response(status)
                has_length = False
                for k, v in rheaders:
                    if k.lower() in _HOP_BY_HOP:
                        continue
                    if k.lower() == "content-length":
                        has_length = True
                        if self.command != "HEAD":
                            v = str(len(data))
                    self.send_header(k, v)
                if not has_length:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD" and data:
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        host, port = self.httpd.server_address[:2]
        self.endpoint = f"http://{host}:{port}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def _pick(self) -> str | None:
        with self.lock:
            self.counts["requests"] += 1
            if self.rng.random() >= self.rate:
                return None
            fault = self.FAULTS[self._next % len(self.FAULTS)]  # every kind, in turn
            self._next += 1
            self.counts[fault] += 1
            return fault

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
