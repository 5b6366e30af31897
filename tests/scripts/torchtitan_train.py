"""A torchtitan job for tests/test_torchtitan.py: the llama3 debug model, FSDP2 over
the ranks, trained with torchtitan's own Trainer and entry point (``torchtitan.train``),
its checkpoints through stepvault or torchtitan's own DCP checkpointer.

Run under torchrun (2 processes, gloo, CPU) in the torchtitan environment::

    torchrun --nproc_per_node 2 tests/scripts/torchtitan_train.py ASSETS DUMP OUT \\
        --checkpointer stepvault|dcp [--stall-after N] [torchtitan's options]

``ASSETS`` holds the tokenizer and the text dataset (tests/scripts/torchtitan_assets.py
makes them). Each rank writes ``OUT/rank<r>.json``: a digest of its model shards, its
optimizer shards (AdamW moments), the lr, the step and the dataloader position at the end,
and the first step it ran (after a resume: the one after the checkpoint).
``--stall-after N`` makes the job stop moving after step N (the test SIGKILLs it there,
once a checkpoint is committed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent


# --------------------------------------------------------------------------------------
# TEST-ONLY PATCHES: make torchtitan 0.3.0 train on CPU over gloo (it targets GPUs).
# They live here, never in the package. Each says what torchtitan does on CPU without it.
# --------------------------------------------------------------------------------------
class _Anything:
    """Stands for any name of the stubbed module: callable, subscriptable, an attribute."""

    def __call__(self, *args: object, **kwargs: object) -> object:
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else self

    def __getattr__(self, name: str) -> _Anything:
        if name.startswith("__"):
            raise AttributeError(name)
        return self

    def __getitem__(self, key: object) -> _Anything:
        return self


#: torchtitan's modules that import Triton at import time (GPU-only kernels: MoE
#: dispatch, fused MLA and SwiGLU), whether a model uses them or not.
TRITON_MODULES = (
    "torchtitan.distributed.minimal_async_ep.kernels",
    "torchtitan.overrides.fused_mla",
    "torchtitan.overrides.fused_swiglu",
)


def _stub_triton_kernels() -> None:
    """The CPU build of torch has no Triton: stand-ins for torchtitan's Triton kernel
    modules let the imports pass (the debug model never calls a kernel). Triton itself is
    not stubbed: torch probes for it and must find it absent."""
    import types

    class _Module(types.ModuleType):
        def __getattr__(self, name: str) -> _Anything:
            if name.startswith("__"):  # __file__, __spec__...: what inspect asks
                raise AttributeError(name)
            return _Anything()

    for name in TRITON_MODULES:
        sys.modules.setdefault(name, _Module(name))


def _patch_torchtitan_for_cpu() -> None:
    try:
        import triton  # noqa: F401
    except ImportError:
        _stub_triton_kernels()
    # Device: torchtitan takes torch's available accelerator type at import, "cuda" when
    # there is none, and then sets CUDA devices. On CPU it must see "cpu"; its local
    # device is then the CPU on every rank (it would index CPU devices by LOCAL_RANK).
    import torch._utils

    torch._utils._get_available_device_type = lambda: "cpu"
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tt_utils

    tt_utils.get_local_device = lambda: torch.device("cpu")
    dist_utils.get_local_device = tt_utils.get_local_device
    # Metrics: torchtitan's memory monitor reads the accelerator's memory statistics.
    import torchtitan.components.metrics as tt_metrics

    class _CPUMemoryMonitor:
        device_name = "cpu"
        device_capacity_gib = 0.0

        def reset_peak_stats(self) -> None:
            pass

        def get_peak_stats(self) -> object:
            return tt_metrics.DeviceMemStats(0, 0, 0, 0, 0, 0)

    tt_metrics.build_device_memory_monitor = _CPUMemoryMonitor
    # Gradients: torchtitan sets FSDP's divide factor to 1.0 (it scales by the token count
    # itself), which FSDP reduces with NCCL's PREMUL_SUM; gloo has no such op. A plain
    # SUM is the same reduction (a factor of 1.0).
    import torchtitan.distributed.fsdp as tt_fsdp
    from torch.distributed.fsdp import FSDPModule

    original_disable = tt_fsdp.disable_fsdp_gradient_division

    def disable_division(model: torch.nn.Module) -> None:
        original_disable(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    tt_fsdp.disable_fsdp_gradient_division = disable_division
    # The trainer shortens the process groups' timeouts after the first step through the
    # device's backend (NCCL), which gloo groups on CPU do not have.
    dist_utils.set_pg_timeouts = lambda *args, **kwargs: None
    _patch_pipeline_schedule_step()


def _patch_pipeline_schedule_step() -> None:
    """Pipeline parallel (not a CPU matter, a version one): torchtitan 0.3.0 calls
    ``schedule.step(arg_mbs=, kwarg_mbs=, target_mbs=)`` with batches it already split into
    microbatches, an API of a newer torch; torch 2.13's ``step`` takes whole batches and
    splits them itself. Microbatches go straight to the schedule's ``_step_microbatches``
    (what 2.13's ``step`` calls after its split)."""
    from torch.distributed.pipelining import schedules

    def wrap(cls: type, stages: Any) -> None:
        original = cls.step

        def step(self: Any, *args: Any, **kwargs: Any) -> Any:
            if "arg_mbs" not in kwargs and "kwarg_mbs" not in kwargs:
                return original(self, *args, **kwargs)
            for stage in stages(self):
                stage.has_backward = self._has_backward
                stage.clear_runtime_states()
            self._step_microbatches(
                kwargs.get("arg_mbs"),
                kwargs.get("kwarg_mbs"),
                kwargs.get("target_mbs"),
                kwargs.get("losses"),
                kwargs.get("return_outputs", False),
                loss_kwargs=kwargs.get("loss_kwargs"),
            )
            return None

        cls.step = step

    wrap(schedules.PipelineScheduleMulti, lambda s: s._stages)
    wrap(schedules.PipelineScheduleSingle, lambda s: [s._stage])


def _config(args: argparse.Namespace, overrides: list[str]) -> list[str]:
    """torchtitan's own command line: the config function and its overrides."""
    return [
        "--module",
        "torchtitan_configs",
        "--config",
        "llama3_stepvault" if args.checkpointer == "stepvault" else "llama3_dcp",
        "--dump_folder",
        str(args.dump),
        "--hf_assets_path",
        str(Path(args.assets) / "tokenizer"),
        "--dataloader.dataset_path",
        str(Path(args.assets) / "c4_test"),
        *overrides,
    ]


def _digest(trainer: object) -> dict[str, object]:
    """This rank's end state: its shards of the weights and of the optimizer state."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> bytes:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()

    h_model = hashlib.sha256()
    for part in trainer.model_parts:  # type: ignore[attr-defined]
        for name, value in sorted(part.state_dict().items()):
            h_model.update(name.encode() + local(value))
    h_opt = hashlib.sha256()
    moments = 0
    for opt in trainer.optimizers.optimizers:  # type: ignore[attr-defined]
        for group in opt.param_groups:
            for p in group["params"]:
                for key, value in sorted(opt.state.get(p, {}).items()):
                    if isinstance(value, torch.Tensor):
                        h_opt.update(key.encode() + local(value))
                        moments += 1
    loader = trainer.dataloader  # type: ignore[attr-defined]
    from torchdata.stateful_dataloader import StatefulDataLoader

    position = StatefulDataLoader.state_dict(loader)
    return {
        "step": trainer.step,  # type: ignore[attr-defined]
        "ntokens_seen": trainer.ntokens_seen,  # type: ignore[attr-defined]
        "model": h_model.hexdigest(),
        "optimizer": h_opt.hexdigest(),
        "moments": moments,
        "lr": trainer.lr_schedulers.schedulers[0].get_last_lr(),  # type: ignore[attr-defined]
        "data": hashlib.sha256(
            json.dumps(position, sort_keys=True, default=str).encode()
        ).hexdigest(),
    }


def _write_full_weights(trainer: object, path: Path, rank: int) -> None:
    """The model's full weights at the end, as torchtitan checkpoints them (its model
    wrapper's FQNs), gathered tensor by tensor and written by rank 0: what an export of
    the last checkpoint must hold."""
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    state = trainer.checkpointer.states["model"].state_dict()  # type: ignore[attr-defined]
    full = {}
    for name, value in sorted(state.items()):
        if isinstance(value, DTensor):
            value = value.full_tensor()  # collective: every rank, in the same order
        full[name] = value.detach().cpu().contiguous()
    if rank == 0:
        save_file(full, str(path))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("assets")
    parser.add_argument("dump")
    parser.add_argument("out")
    parser.add_argument("--checkpointer", choices=("stepvault", "dcp"), default="stepvault")
    parser.add_argument("--stall-after", type=int, default=0)
    parser.add_argument("--full-weights", action="store_true")
    parser.add_argument("--timings", default="", help="benchmarks/bench_torchtitan.py's")
    args, overrides = parser.parse_known_args()  # the rest: torchtitan's own options

    # The dataset is a local folder: nothing is fetched, nothing cached in $HOME.
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_CACHE", str(Path(args.dump) / "hf-datasets"))
    sys.path.insert(0, str(HERE))  # torchtitan_configs, the job's config_registry module
    _patch_torchtitan_for_cpu()
    from torchtitan import train as tt_train
    from torchtitan.trainer import Trainer

    rank = int(os.environ.get("RANK", "0"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    original_step = Trainer.train_step
    original_close = Trainer.close

    first: list[int] = []
    timings: dict[str, list[float]] = {"step": [], "stall": [], "durable": []}

    def timed_save(checkpointer: Any) -> Any:
        """The checkpointer's save, timed (the benchmark): how long the call holds the
        loop (stall), and until the checkpoint is durable (waited for at once)."""
        save = checkpointer.save

        def timed(curr_step: int, last_step: bool = False) -> bool:
            begin = time.perf_counter()
            saved = save(curr_step, last_step=last_step)
            if saved:
                timings["stall"].append(time.perf_counter() - begin)
                if hasattr(checkpointer, "manager"):  # stepvault: its background write
                    checkpointer.manager.wait()
                else:  # torchtitan's async DCP save: its future
                    checkpointer.maybe_wait_for_saving()
                timings["durable"].append(time.perf_counter() - begin)
            return bool(saved)

        return timed

    def train_step(self: Trainer, data_iterator: object) -> None:
        if not first:
            first.append(self.step)  # the step a resumed job runs first
            if args.timings:
                self.checkpointer.save = timed_save(self.checkpointer)  # type: ignore[method-assign]
        if args.stall_after and self.step > args.stall_after:
            (out / f"stalled{rank}").write_text(str(self.step))
            # The test SIGKILLs the job here, or SIGTERMs it: then the step goes on and
            # the checkpointer's preemption save follows it (stepvault's OnSignal).
            on_signal = getattr(self.checkpointer, "on_signal", None)
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline and not (on_signal and on_signal.triggered):
                time.sleep(0.1)
        begin = time.perf_counter()
        original_step(self, data_iterator)
        timings["step"].append(time.perf_counter() - begin)

    def close(self: Trainer) -> None:
        # Before torchtitan's close: the process group is still up (full_tensor is not
        # needed: each rank digests its own shards).
        if getattr(self, "step", 0):
            record = _digest(self)
            record["first_step"] = first[0] if first else None
            restore = getattr(self.checkpointer, "last_restore", None)
            record["resumed"] = restore.step if restore is not None else None
            record["skipped"] = [s.step for s in restore.skipped] if restore is not None else []
            (out / f"rank{rank}.json").write_text(json.dumps(record, indent=1))
            if args.timings and rank == 0:
                Path(args.timings).write_text(json.dumps(timings))
            if args.full_weights:
                _write_full_weights(self, out / "weights.safetensors", rank)
        original_close(self)

    Trainer.train_step = train_step  # type: ignore[method-assign]
    Trainer.close = close  # type: ignore[method-assign]
    sys.argv = [sys.argv[0], *_config(args, overrides)]
    try:
        tt_train.main()
    except SystemExit as exc:  # a preemption save ends the rank with the policy's code
        (out / f"exit{rank}").write_text(str(exc.code))
        raise


if __name__ == "__main__":
    main()
