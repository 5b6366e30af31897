"""Closed forms for the checkpoint interval and the expected wall time (PLANNING.md).

Symbols (all in seconds): ``delta`` the cost of one save as training sees it, ``restart``
the time from a failure until training runs again (start-up + restore), ``mtbf`` the
job's mean time between failures, ``tau`` the compute time between two saves.

* Young (1974): ``tau = sqrt(2 delta M)``.
* Daly (2006), higher order: ``tau = sqrt(2 delta M) [1 + 1/3 sqrt(delta/2M) +
  1/9 (delta/2M)] - delta`` for ``delta < 2M``, else ``tau = M``.
* Daly's expected wall time of a job of ``T_s`` seconds of work, saved every ``tau``:
  ``T_w = M e^(R/M) (e^((tau + delta)/M) - 1) T_s / tau``. It is exact for exponential
  failures that may strike at any moment (in work, saves and restarts alike) when the job
  is a whole number of segments; :func:`segment_time` is the same expression for one
  segment, so a schedule of uneven segments is summed exactly.
* The exact minimiser of ``T_w`` is ``tau = M (1 + W0(-e^(-1 - delta/M)))`` (W0: the
  principal branch of Lambert's W), which Daly's series approximates. Near the ends it is
  evaluated without the rounding of that expression: for a tiny ``delta/M`` from the
  series of ``1 + W0`` at the branch point (its first term is Young's ``sqrt(2 delta M)``),
  for a huge one as ``M`` (``e^(-1 - delta/M)`` underflows; ``W0(x) ~ x``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = [
    "daly_interval",
    "daly_wall_time",
    "exact_interval",
    "lambert_w0",
    "restart_time_expected",
    "segment_time",
    "wall_time",
    "young_interval",
]


def young_interval(delta: float, mtbf: float) -> float:
    """Young's first-order optimum ``sqrt(2 delta M)`` (seconds of compute between saves)."""
    return math.sqrt(2.0 * delta * mtbf)


def daly_interval(delta: float, mtbf: float) -> float:
    """Daly's higher-order optimum (Daly 2006): for ``delta < 2M``
    ``sqrt(2 delta M) [1 + sqrt(delta / 2M) / 3 + (delta / 2M) / 9] - delta``, else ``M``."""
    if delta >= 2.0 * mtbf:
        return mtbf
    x = delta / (2.0 * mtbf)
    return math.sqrt(2.0 * delta * mtbf) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - delta


def lambert_w0(x: float) -> float:
    """Principal branch of Lambert's W for ``-1/e <= x <= 0`` (all this module needs):
    the ``w`` in ``[-1, 0]`` with ``w e^w = x``; Halley's iteration to machine precision."""
    if not -1.0 / math.e <= x <= 0.0:
        raise ValueError(f"lambert_w0 is implemented for -1/e <= x <= 0, got {x!r}")
    if x == 0.0:  # also -0.0, what -e^(-1 - delta/M) underflows to
        return 0.0
    if x == -1.0 / math.e:
        return -1.0
    # Start from the branch-point series (good near -1/e) or from x itself (good near 0).
    p = math.sqrt(2.0 * (math.e * x + 1.0))
    w = -1.0 + p - p * p / 3.0 if x < -0.25 else x
    for _ in range(100):
        ew = math.exp(w)
        f = w * ew - x
        step = f / (ew * (w + 1.0) - (w + 2.0) * f / (2.0 * w + 2.0))
        w -= step
        if abs(step) <= 1e-15 * (1.0 + abs(w)):
            break
    return w


#: Coefficients of ``1 + W0`` at the branch point in ``p = sqrt(2 (1 + e x))``:
#: ``p - p^2/3 + 11/72 p^3 - 43/540 p^4 + 769/17280 p^5 - 221/8505 p^6``.
_BRANCH_SERIES = (1.0, -1.0 / 3.0, 11.0 / 72.0, -43.0 / 540.0, 769.0 / 17280.0, -221.0 / 8505.0)

#: Below this ``p`` the series is used: its first left-out term is ~1e-14 of the sum, while
#: ``W0(x)`` itself would lose ~1e-16 / p^2 to the rounding of ``x`` next to ``-1/e``.
_SERIES_BELOW = 1e-2


def exact_interval(delta: float, mtbf: float) -> float:
    """The ``tau`` that minimises Daly's ``T_w`` exactly: ``M (1 + W0(-e^(-1 - delta/M)))``.

    With ``x = -e^(-1 - delta/M)``, ``1 + e x = -expm1(-delta/M)`` exactly, so for a small
    ``delta/M`` the series of ``1 + W0`` in ``p = sqrt(2 (1 + e x))`` gives ``tau`` to full
    precision (``~ sqrt(2 delta M)``, Young's, as ``delta/M -> 0``) where ``1 + W0(x)``
    would cancel to 0; for a ``delta/M`` so large that ``x`` underflows, ``W0(x) = x``
    rounds to 0 and ``tau = M``, the limit."""
    ratio = delta / mtbf
    p = math.sqrt(-2.0 * math.expm1(-ratio))
    if p < _SERIES_BELOW:
        return mtbf * p * math.fsum(c * p**i for i, c in enumerate(_BRANCH_SERIES))
    return mtbf * (1.0 + lambert_w0(-math.exp(-1.0 - ratio)))


def segment_time(work: float, delta: float, restart: float, mtbf: float) -> float:
    """Expected wall time to get ``work`` seconds of compute plus a save of ``delta``
    committed, under exponential failures of mean ``mtbf``: each failure costs a restart of
    ``restart`` seconds (which may fail too) and a redo of the segment.
    ``M e^(R/M) (e^((work + delta)/M) - 1)``; ``expm1`` keeps it accurate for tiny ratios.
    ``inf`` where that exceeds a float (a save or restart of hundreds of MTBFs: the run is
    not expected to finish)."""
    try:
        return mtbf * math.exp(restart / mtbf) * math.expm1((work + delta) / mtbf)
    except OverflowError:
        return math.inf


def wall_time(segments: Iterable[tuple[float, float]], restart: float, mtbf: float) -> float:
    """Expected wall time of a run made of ``(work, save cost)`` segments (a last segment
    with no save at its end has cost 0): the sum of :func:`segment_time`."""
    return sum(segment_time(w, d, restart, mtbf) for w, d in segments)


def daly_wall_time(work: float, tau: float, delta: float, restart: float, mtbf: float) -> float:
    """Daly's ``T_w = M e^(R/M) (e^((tau + delta)/M) - 1) T_s / tau`` (``T_s = work``)."""
    return segment_time(tau, delta, restart, mtbf) * work / tau


def restart_time_expected(restart: float, mtbf: float) -> float:
    """Expected time from a failure until training runs again when the restart itself may
    fail (exponential failures): ``M (e^(R/M) - 1)`` (the RTO; ``~ R`` for ``R << M``);
    ``inf`` where that exceeds a float."""
    try:
        return mtbf * math.expm1(restart / mtbf)
    except OverflowError:
        return math.inf
