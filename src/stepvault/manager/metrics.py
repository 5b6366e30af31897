"""Optional Prometheus metrics for a CheckpointManager (``pip install stepvault[prometheus]``)."""

from __future__ import annotations

from typing import Any


class PrometheusMetrics:
    """Counters and histograms a monitoring system can scrape, labelled by run."""

    def __init__(self, run: str, registry: Any = None) -> None:
        try:
            import prometheus_client as pc
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "prometheus metrics need the prometheus-client package: "
                "pip install 'stepvault[prometheus]'"
            ) from exc
        kw = {"registry": registry} if registry is not None else {}
        self.run = run
        self.saves = pc.Counter("stepvault_saves", "Committed checkpoints", ["run", "kind"], **kw)
        self.failures = pc.Counter("stepvault_save_failures", "Failed saves", ["run"], **kw)
        self.stall = pc.Histogram(
            "stepvault_save_stall_seconds",
            "Time the training thread was blocked by a save",
            ["run"],
            buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120),
            **kw,
        )
        self.write = pc.Histogram(
            "stepvault_save_write_seconds",
            "Time to write and commit a checkpoint",
            ["run"],
            buckets=(0.1, 0.5, 1, 5, 15, 60, 300, 1200),
            **kw,
        )
        self.new_bytes = pc.Counter("stepvault_new_bytes", "Bytes newly stored", ["run"], **kw)
        self.logical_bytes = pc.Counter(
            "stepvault_logical_bytes", "Logical bytes checkpointed", ["run"], **kw
        )
        self.restores = pc.Counter(
            "stepvault_restores", "Restores by result", ["run", "result"], **kw
        )
        self.fallbacks = pc.Counter(
            "stepvault_restore_fallbacks", "Damaged checkpoints skipped on restore", ["run"], **kw
        )
        self.latest_step = pc.Gauge(
            "stepvault_latest_step", "Step of the newest committed checkpoint", ["run"], **kw
        )

    def saved(self, kind: str, stall: float, write: float, new: int, logical: int, step: int):
        self.saves.labels(self.run, kind).inc()
        self.stall.labels(self.run).observe(stall)
        self.write.labels(self.run).observe(write)
        self.new_bytes.labels(self.run).inc(new)
        self.logical_bytes.labels(self.run).inc(logical)
        self.latest_step.labels(self.run).set(step)

    def failed(self) -> None:
        self.failures.labels(self.run).inc()

    def restored(self, ok: bool, fallbacks: int) -> None:
        self.restores.labels(self.run, "ok" if ok else "failed").inc()
        self.fallbacks.labels(self.run).inc(fallbacks)
