"""Simulated vs closed-form ETTR over the documented parameter range (PLANNING.md).

    python benchmarks/plan_validation.py [--trials 1000] [--weibull 0.7]

Prints a summary per parameter and the worst points as Markdown; PLANNING.md quotes it.
"""

from __future__ import annotations

import argparse
import time

from stepvault.planning.validation import GRID, validation_grid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weibull", type=float, default=None, help="Weibull shape k")
    args = parser.parse_args()
    t0 = time.perf_counter()
    rows = list(
        validation_grid(
            trials=args.trials,
            seed=args.seed,
            distribution="weibull" if args.weibull else "exponential",
            weibull_shape=args.weibull,
        )
    )
    seconds = time.perf_counter() - t0
    worst = max(rows, key=lambda r: abs(r["relative_difference"]))
    within = sum(abs(r["relative_difference"]) < 0.02 for r in rows)
    kind = f"Weibull k={args.weibull}" if args.weibull else "exponential"
    print(
        f"{kind} failures, {args.trials} trials, seed {args.seed}: {len(rows)} points, "
        f"{within} within 2 %, worst {worst['relative_difference']:+.3%} ({seconds:.0f} s)\n"
    )
    print("| parameter | value | points | max abs. difference | mean difference |")
    print("|---|---|---|---|---|")
    for key, name in (
        ("delta", "delta/M"),
        ("restart", "R/M"),
        ("interval", "tau/tau_daly"),
        ("length", "T_s/M"),
        ("commit", "W/M"),
    ):
        for value in GRID[key]:
            sel = [r for r in rows if r[name] == value]
            if not sel:
                continue
            diffs = [r["relative_difference"] for r in sel]
            print(
                f"| {name} | {value:g} | {len(sel)} | {max(map(abs, diffs)):.3%} | "
                f"{sum(diffs) / len(diffs):+.3%} |"
            )
    print("\nworst points:\n")
    print("| delta/M | R/M | tau/tau_daly | T_s/M | W/M | saves | analytic | simulated ± SE |")
    print("|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: -abs(r["relative_difference"]))[:5]:
        print(
            f"| {r['delta/M']:g} | {r['R/M']:g} | {r['tau/tau_daly']:g} | {r['T_s/M']:g} | "
            f"{r['W/M']:g} | {r['saves']} | {r['ettr_analytic']:.4f} | "
            f"{r['ettr_simulated']:.4f} ± {r['ettr_se']:.4f} |"
        )


if __name__ == "__main__":
    main()
