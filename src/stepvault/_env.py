"""Environment facts recorded in every manifest (library and framework versions)."""

from __future__ import annotations

import platform
import socket
from functools import lru_cache
from typing import Any


@lru_cache(maxsize=1)
def environment() -> dict[str, Any]:
    import numpy
    import torch

    from ._version import __version__

    return {
        "stepvault": __version__,
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "platform": platform.platform(terse=True),
    }
