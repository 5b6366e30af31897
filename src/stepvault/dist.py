"""Deprecated alias of :mod:`stepvault.distributed` (the package was renamed so that it no
longer shadows ``torch.distributed as dist`` and is not skipped by tools that exclude
``dist/`` folders). ``stepvault.dist.save_sharded`` keeps working."""

from .distributed import *  # noqa: F403
from .distributed import __all__  # noqa: F401
