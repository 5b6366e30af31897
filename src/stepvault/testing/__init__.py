"""Tools to test training setups with stepvault: :func:`check_exact_resume`.

``python -m stepvault.testing module:make_and_train --steps 24 --interrupt-at 8`` runs the
same check from the command line.
"""

from .resume_check import (
    Difference,
    Interrupted,
    ResumeContext,
    ResumeReport,
    assert_exact_resume,
    batch_digest,
    check_exact_resume,
)

__all__ = [
    "Difference",
    "Interrupted",
    "ResumeContext",
    "ResumeReport",
    "assert_exact_resume",
    "batch_digest",
    "check_exact_resume",
]
