"""``stepvault ui``: a local web dashboard over a store (``pip install 'stepvault[ui]'``).

Read-only unless started with ``--allow-actions``; bound to 127.0.0.1 unless given a token.
The core never imports this package (it needs Starlette, uvicorn and Jinja2).
"""

from __future__ import annotations

from .app import create_app
from .security import UnsafeBindError, check_bind, is_loopback
from .server import serve

__all__ = ["UnsafeBindError", "check_bind", "create_app", "is_loopback", "serve"]
