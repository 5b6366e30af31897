"""Ray Train points at stepvault checkpoints (issue 32): a local Ray cluster started here
(CPU, 2 workers) runs a ``TorchTrainer`` whose workers save through one collective
``CheckpointManager`` (RayCheckpointer) and report each checkpoint to Ray as a pointer.
The first attempt damages its newest checkpoint and kills a worker mid-run; Ray restarts
the group (FailureConfig), every worker restores from stepvault past the damaged
checkpoint, and the run ends with the weights of a straight run, bitwise.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

import stepvault
from stepvault.catalog.events import read_events
from stepvault.store import Store

# Ray is imported by the test itself: importing it costs seconds that a default (fast)
# run, which deselects this slow test, should not pay at collection.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason='needs Ray Train: pip install "stepvault[ray]"'
)

HERE = Path(__file__).resolve().parent


@pytest.fixture
def ray_cluster():
    import ray

    src = str(HERE.parent / "src")
    env = {
        "PYTHONPATH": os.pathsep.join([str(HERE), src, os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "RAY_TRAIN_V2_ENABLED": "1",
    }
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        runtime_env={"env_vars": env},
        log_to_driver=False,
        configure_logging=False,
    )
    yield
    ray.shutdown()


@pytest.mark.slow
def test_torchtrainer_with_a_killed_worker_resumes_from_stepvault_bitwise(ray_cluster, tmp_path):
    import ray_workers
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from stepvault.integrations.ray import POINTER, checkpoint_uri

    root, log = tmp_path / "ckpts", tmp_path / "attempts"
    log.mkdir()
    trainer = TorchTrainer(
        ray_workers.train_fn,
        train_loop_config={"root": str(root), "log": str(log)},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(
            name="stepvault-ray",
            storage_path=str(tmp_path / "ray-results"),
            failure_config=FailureConfig(max_failures=1),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
        ),
    )
    result = trainer.fit()
    assert result.error is None

    # Two attempts: the first started fresh; after the kill, every worker of the new
    # group restored step 3, having skipped the damaged step 6.
    attempts = [json.loads(p.read_text()) for p in log.glob("*.json")]
    fresh = [a for a in attempts if a["step"] is None]
    resumed = [a for a in attempts if a["step"] is not None]
    assert sorted(a["rank"] for a in fresh) == [0, 1]
    assert sorted(a["rank"] for a in resumed) == [0, 1]
    assert all(a["step"] == 3 and a["skipped"] == [6] for a in resumed), resumed

    # The run's last checkpoint is a straight run's weights, bitwise.
    model = ray_workers.make_model()
    state = {"model": model, "step": 0}
    info = stepvault.restore(root, state, run="ray", strict=False)
    assert info.step == ray_workers.TOTAL
    expected = ray_workers.reference()
    for (name, got), want in zip(model.state_dict().items(), expected.state_dict().values()):
        assert torch.equal(got, want), name

    # Ray tracked pointers, not tensors: its checkpoint is a few hundred bytes naming
    # the stepvault checkpoint, which restores.
    uri = checkpoint_uri(result.checkpoint)
    assert uri == f"stepvault:{Store.open(root).backend.url}#ray@{ray_workers.TOTAL}"
    ray_dir = Path(result.checkpoint.path)
    assert [p.name for p in ray_dir.iterdir()] == [POINTER]
    assert (ray_dir / POINTER).stat().st_size < 1000
    again = ray_workers.make_model()
    stepvault.restore(uri, {"model": again, "step": 0}, strict=False)
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), model.parameters()))

    events = [e for e in read_events(Store.open(root), "ray") if e["event"] == "tracker_ref"]
    assert {e["tracker"] for e in events} == {"ray"}
    assert [e["step"] for e in events][-2:] == [9, 12]
