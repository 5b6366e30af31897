"""``python -m stepvault.testing``: check that a training setup resumes exactly.

    python -m stepvault.testing mytrain:make_and_train --steps 24 --interrupt-at 8

Exit status 0 when the resume is bitwise exact, 1 (with the first difference) when not.
"""

from __future__ import annotations

import argparse
import json
import sys

from .resume_check import ResumeContext, check_exact_resume, run_phase


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m stepvault.testing",
        description="Run a training function straight, interrupted and resumed in a fresh "
        "process, and compare every batch and checkpoint bit for bit.",
    )
    p.add_argument("target", nargs="?", help="'module:function' or 'file.py:function'")
    p.add_argument("--steps", type=int, help="total steps")
    p.add_argument("--interrupt-at", type=int, help="step to resume from")
    p.add_argument("--save-every", type=int, default=1)
    p.add_argument("--workdir", default=None, help="keep the stores here (default: temporary)")
    p.add_argument("--isolate", choices=("resume", "all", "none"), default="resume")
    p.add_argument(
        "--ignore", action="append", default=[], help="skip checkpoint paths containing this"
    )
    p.add_argument("--phase-json", help=argparse.SUPPRESS)  # one phase, in a fresh process
    args = p.parse_args(argv)
    if args.phase_json:
        payload = json.loads(args.phase_json)
        run_phase(payload["target"], ResumeContext(**payload["ctx"]))
        return 0
    if not args.target or args.steps is None or args.interrupt_at is None:
        p.error("give the target, --steps and --interrupt-at")
    report = check_exact_resume(
        args.target,
        steps=args.steps,
        interrupt_at=args.interrupt_at,
        save_every=args.save_every,
        workdir=args.workdir,
        isolate=args.isolate,
        ignore=args.ignore,
    )
    print(report)
    return 0 if report.exact else 1


if __name__ == "__main__":
    sys.exit(main())
