"""Planning: the checkpoint interval, the goodput and the storage bill (PLANNING.md).

::

    import stepvault
    p = stepvault.planning.plan("ckpts", "exp1", mtbf="24h", total_steps=100_000,
                       keep="KeepLast(3) | KeepEvery(steps=1000)")
    p.interval["daly_steps"], p.optimum.ettr, p.storage.cost_run

Modules: :mod:`.interval` (closed forms), :mod:`.schedule` (a save policy's saves),
:mod:`.simulate` (Monte Carlo), :mod:`.storage` (keep and tier policies applied over the
run), :mod:`.measure` (a run's measured costs), :mod:`.policies` (policies from text),
:mod:`.report` (the plan), :mod:`.plot` (the figure).
"""

from .report import DEFAULT_PRICES, Goodput, Plan, plan, plan_json
from .units import PlanError

__all__ = ["DEFAULT_PRICES", "Goodput", "Plan", "PlanError", "plan", "plan_json"]
