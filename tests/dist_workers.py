"""Worker functions for multi-process tests (spawned; must be importable at module level)."""

from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from stepvault.manager.options import GCOptions, ManagerOptions


def full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(8, 6, generator=g),
        "b": torch.randn(6, generator=g),
        "emb": torch.randn(12, 4, generator=g).to(torch.bfloat16),
    }


def make_state(mesh, *, zeros: bool = False) -> dict:
    full = full_tensors()
    if zeros:
        full = {k: torch.zeros_like(v) for k, v in full.items()}
    return {
        "model": {
            "w": distribute_tensor(full["w"], mesh, [Shard(0)]),
            "b": distribute_tensor(full["b"], mesh, [Replicate()]),
            "emb": distribute_tensor(full["emb"], mesh, [Shard(1)]),
        },
        "extra": {"step": 0 if zeros else 7, "betas": (0.0, 0.0) if zeros else (0.9, 0.99)},
    }


def run(rank: int, world: int, port: int, task: str, root: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        globals()[f"task_{task}"](rank, world, root, out)
        result = "ok"
    except BaseException as exc:  # reported to the parent through a file per rank
        result = f"error {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    finally:
        with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
            f.write(result)
        dist.destroy_process_group()
    # Leave without running C++ static destructors: at interpreter exit a background thread
    # of the gloo/c10d runtime can still be joinable and its destructor then aborts the
    # process ("terminate called without an active exception", SIGABRT) after the rank
    # finished and reported; CI saw it once in ~750 spawns. The result is already on disk.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def task_save(rank, world, root, out):
    import stepvault.distributed as sd

    mesh = init_device_mesh("cpu", (world,))
    sd.save_sharded(root, make_state(mesh), run="r", step=1, metrics={"loss": 0.5})


def task_load(rank, world, root, out):
    import stepvault.distributed as sd

    mesh = init_device_mesh("cpu", (world,))
    state = make_state(mesh, zeros=True)
    step = sd.load_sharded(root, state, run="r")
    full = full_tensors()
    for k, v in state["model"].items():
        assert torch.equal(v.full_tensor(), full[k]), k
    assert state["extra"] == {"step": 7, "betas": (0.9, 0.99)}, state["extra"]
    with open(os.path.join(out, f"step{rank}.txt"), "w") as f:
        f.write(str(step))


def task_save_fail_on_rank1(rank, world, root, out):
    import stepvault.distributed as sd
    from stepvault.distributed import storage

    mesh = init_device_mesh("cpu", (world,))
    sd.save_sharded(root, make_state(mesh), run="r", step=1)
    if rank == 1:
        original = storage.StepvaultWriter.write_data

        def broken(self, plan, planner):
            raise OSError("rank 1 lost its disk")

        storage.StepvaultWriter.write_data = broken
    try:
        sd.save_sharded(root, make_state(mesh), run="r", step=2)
    except BaseException as exc:  # DCP's CheckpointException derives from BaseException
        with open(os.path.join(out, f"err{rank}.txt"), "w") as f:
            f.write(repr(exc))
    else:
        raise AssertionError("the failed save did not raise on this rank")
    finally:
        if rank == 1:
            storage.StepvaultWriter.write_data = original


def task_load_fallback(rank, world, root, out):
    import stepvault.distributed as sd

    mesh = init_device_mesh("cpu", (world,))
    state = make_state(mesh, zeros=True)
    step = sd.load_sharded(root, state, run="r")
    full = full_tensors()
    for k, v in state["model"].items():
        assert torch.equal(v.full_tensor(), full[k]), k
    with open(os.path.join(out, f"step{rank}.txt"), "w") as f:
        f.write(str(step))


def _fsdp_model(mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
        torch.nn.Linear(32, 4),
    )  # fmt: skip
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fsdp_state(mesh):
    import stepvault

    model = _fsdp_model(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    return {
        "model": model,
        "optimizer": opt,
        "scheduler": sched,
        "rng": stepvault.RNGState(),
        "step": 0,
    }


def _train(state, steps):
    g = torch.Generator().manual_seed(100 + state["step"])
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g)
        loss = state["model"](x).pow(2).mean()
        state["optimizer"].zero_grad()
        loss.backward()
        state["optimizer"].step()
        state["scheduler"].step()
        state["step"] += 1


def _full(state) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=False)
    msd, osd = get_state_dict(state["model"], state["optimizer"], options=opts)
    flat = {f"model.{k}": v for k, v in msd.items()}
    for name, st in osd["state"].items():
        for k, v in st.items():
            flat[f"opt.{name}.{k}"] = v
    return flat


def _dump(out, rank, tag, flat):
    if rank == 0:
        torch.save({k: v.clone() for k, v in flat.items()}, os.path.join(out, f"{tag}.pt"))


def task_fsdp_save(rank, world, root, out):
    import stepvault

    mesh = init_device_mesh("cpu", (world,))
    state = _fsdp_state(mesh)
    _train(state, 3)
    stepvault.save(root, state, run="f", step=3)
    _dump(out, rank, "saved", _full(state))
    _train(state, 2)
    _dump(out, rank, "continued", _full(state))


def task_fsdp_restore(rank, world, root, out):
    import stepvault

    mesh = init_device_mesh("cpu", (world,))
    state = _fsdp_state(mesh)
    info = stepvault.restore(root, state, run="f")
    assert info.step == 3 and state["step"] == 3, (info, state["step"])
    assert state["scheduler"].last_epoch == 3
    _dump(out, rank, "restored", _full(state))
    _train(state, 2)
    _dump(out, rank, "resumed", _full(state))


def task_rank0_only_sharded_save(rank, world, root, out):
    import stepvault

    mesh = init_device_mesh("cpu", (world,))
    state = _fsdp_state(mesh)
    if rank == 0:
        try:
            stepvault.save(root, state, run="bad", step=1, collective=False)
        except stepvault.errors.StepvaultError as exc:
            with open(os.path.join(out, "err.txt"), "w") as f:
                f.write(str(exc))
    dist.barrier()


def task_manager_ddp(rank, world, root, out):
    """DDP (replicated) through a CheckpointManager on every rank, then resume."""
    import stepvault

    def build():
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return {"model": model, "optimizer": opt, "step": 0, "rng": stepvault.RNGState()}

    state = build()
    with stepvault.CheckpointManager(
        # light saves are built by one process: under a process group they are full ones
        root,
        "ddp",
        save=stepvault.Every(steps=2, what="light"),
        keep=stepvault.KeepLast(2),
        options=ManagerOptions(gc=GCOptions(grace_seconds=0)),
    ) as mgr:
        assert mgr.restore(state) is None
        for step in range(1, 7):
            g = torch.Generator().manual_seed(step * 10 + rank)
            loss = state["model"](torch.randn(4, 8, generator=g)).pow(2).mean()
            state["optimizer"].zero_grad()
            loss.backward()
            state["optimizer"].step()
            state["step"] = step
            mgr.save(step, state, metrics={"loss": loss.item()})
        expected = state["model"].module.weight.detach().clone()
        mgr.wait()  # saves are asynchronous: the last one may still be in flight
        dist.barrier()  # and rank 0 applies retention after its own commit
        assert [c.step for c in mgr.checkpoints()] == [4, 6]
        assert mgr.stats()["saves"] == 3 and mgr.stats()["failures"] == 0
    fresh = build()
    with stepvault.CheckpointManager(root, "ddp") as mgr:
        info = mgr.restore(fresh)
        assert info.step == 6 and fresh["step"] == 6
        assert torch.equal(fresh["model"].module.weight, expected)
        momentum = fresh["optimizer"].state_dict()["state"][0]["momentum_buffer"]
        assert momentum is not None and momentum.shape == (4, 8)


def task_rank1_killed_mid_save(rank, world, root, out):
    import signal

    import stepvault.distributed as sd
    from stepvault.distributed import storage

    mesh = init_device_mesh("cpu", (world,))
    sd.save_sharded(root, make_state(mesh), run="r", step=1)
    if rank == 1:
        original = storage.StepvaultWriter.write_data

        def dying(self, plan, planner):
            original(self, plan, planner)  # its objects are written ...
            os.kill(os.getpid(), signal.SIGKILL)  # ... then the rank dies before reporting

        storage.StepvaultWriter.write_data = dying
    try:
        sd.save_sharded(root, make_state(mesh), run="r", step=2)
    except BaseException as exc:
        with open(os.path.join(out, f"err{rank}.txt"), "w") as f:
            f.write(repr(exc))


def task_fsdp_restore_audited(rank, world, root, out):
    """Restore with an audit hook recording every class an unpickler resolves on this rank."""
    import json
    import sys

    import stepvault

    mesh = init_device_mesh("cpu", (world,))
    state = _fsdp_state(mesh)
    seen: list[list[str]] = []
    recording = [False]

    def hook(event, args):
        # (marshal is not recorded here: lazy imports of installed modules load .pyc files
        # with marshal.loads; that is code the process already trusts, not stored data.)
        if recording[0] and event == "pickle.find_class":
            seen.append([str(args[0]), str(args[1])])

    sys.addaudithook(hook)
    dist.barrier()
    recording[0] = True
    info = stepvault.restore(root, state, run="f")
    recording[0] = False
    assert info.step == 3 and state["step"] == 3
    with open(os.path.join(out, f"unpickled{rank}.json"), "w") as f:
        json.dump(sorted({tuple(x) for x in seen}), f)


def task_manager_fsdp_async(rank, world, root, out):
    """FSDP2 + optimizer through an asynchronous manager: training mutates the parameters
    while each save is still being written; every checkpoint holds the state at its step."""
    import stepvault

    mesh = init_device_mesh("cpu", (world,))
    state = _fsdp_state(mesh)
    with stepvault.CheckpointManager(
        root, "fa", save=stepvault.Every(steps=2), keep=stepvault.KeepLast(3), async_save=True
    ) as mgr:
        for _ in range(6):
            _train(state, 1)
            handle = mgr.save(state["step"], state)
            if handle is not None:
                assert handle.asynchronous
                _dump(out, rank, f"at{state['step']}", _full(state))
        _train(state, 1)  # runs while the step-6 save is in flight
    fresh = _fsdp_state(mesh)
    with stepvault.CheckpointManager(root, "fa") as mgr:
        for step in (6, 4, 2):
            info = mgr.restore(fresh, step=step)
            assert info.step == step and fresh["step"] == step
            _dump(out, rank, f"restored{step}", _full(fresh))


def task_manager_async_fails_on_rank1(rank, world, root, out):
    """A background write failing on one rank: every rank raises at the next call, and
    nothing of that step is committed."""
    import stepvault
    from stepvault.distributed import storage

    mesh = init_device_mesh("cpu", (world,))
    state = _fsdp_state(mesh)
    mgr = stepvault.CheckpointManager(root, "ff", async_save=True)
    _train(state, 1)
    mgr.save(1, state)
    mgr.wait()
    original = storage.StepvaultWriter.write_data
    if rank == 1:

        def broken(self, plan, planner):
            raise OSError("rank 1 lost its disk")

        storage.StepvaultWriter.write_data = broken
    _train(state, 1)
    handle = mgr.save(2, state)  # returns at once: the failure happens in the background
    assert handle is not None and handle.asynchronous
    try:
        mgr.save(3, state)
    except BaseException as exc:
        with open(os.path.join(out, f"err{rank}.txt"), "w") as f:
            f.write(repr(exc))
    else:
        raise AssertionError("the failed background save did not surface on this rank")
    finally:
        storage.StepvaultWriter.write_data = original
    mgr.save(4, state)  # the manager keeps working after reporting the failure
    mgr.close()


def task_manager_rank0_only(rank, world, root, out):
    """A rank-local manager (collective=False) on rank 0 of a DDP job: what Lightning and the
    HF Trainer do (they checkpoint on rank 0 only). Sharded state is refused."""
    import stepvault

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model.module, "optimizer": opt, "step": 0}
    for step in range(1, 4):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        state["step"] = step
        if rank == 0:
            with stepvault.CheckpointManager(root, "r0", collective=False, async_save=True) as m:
                m.save(step, state)
        dist.barrier()  # the other ranks never call into stepvault
    if rank == 0:
        fresh = {"model": torch.nn.Linear(8, 4), "optimizer": None, "step": None}
        fresh["optimizer"] = torch.optim.SGD(fresh["model"].parameters(), lr=0.1)
        with stepvault.CheckpointManager(root, "r0", collective=False) as m:
            assert m.restore(fresh).step == 3
        assert torch.equal(fresh["model"].weight, model.module.weight)
    mesh = init_device_mesh("cpu", (world,))  # collectives: every rank takes part
    sharded = {"w": distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])}
    if rank == 0:
        try:
            with stepvault.CheckpointManager(root, "bad", collective=False) as m:
                m.save(1, sharded)
        except stepvault.errors.StepvaultError as exc:
            assert "sharded DTensors" in str(exc)
        else:
            raise AssertionError("sharded state saved from one rank")


def task_fsdp_tiered(rank, world, root, out):
    """Sharded saves through a manager with a cold tier; hot keeps 1; restore from cold."""
    import stepvault
    from stepvault.tiers import CopyEvery, HotLast

    mesh = init_device_mesh("cpu", (world,))
    cold = os.path.join(out, "cold")
    state = _fsdp_state(mesh)
    policy = HotLast(1) | CopyEvery("cold", steps=1)
    with stepvault.CheckpointManager(
        root, "t", save=stepvault.Every(steps=1), tiers={"cold": cold}, tier_policy=policy,
        async_save=False, options=ManagerOptions(gc=GCOptions(grace_seconds=0)),
    ) as mgr:  # fmt: skip
        for _ in range(3):
            _train(state, 1)
            mgr.save(state["step"], state)
            _dump(out, rank, f"saved{state['step']}", _full(state))
    dist.barrier()  # rank 0's mover finished its last pass in close()
    fresh = _fsdp_state(mesh)
    with stepvault.CheckpointManager(root, "t", tiers={"cold": cold}) as mgr:
        info = mgr.restore(fresh, step=2)  # evicted from hot: read from the cold tier
        assert info.step == 2 and fresh["step"] == 2, (info, fresh["step"])
        _dump(out, rank, "restored2", _full(fresh))
        latest = mgr.restore(fresh)
        assert latest.step == 3, latest


def task_manager_cuda(rank, world, root, out):
    """A replicated model + AdamW on the GPU (every rank on the first device), saved
    asynchronously through DCP with pinned staging while the next steps run, then restored."""
    import stepvault

    device = os.environ.get("STEPVAULT_TEST_DEVICE", "cuda")  # cpu: a check of this task

    def build(seed):
        torch.manual_seed(seed)
        layers = [torch.nn.Linear(512, 512) for _ in range(4)]
        model = torch.nn.Sequential(*layers).to(device)
        return {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-2)}

    def step(state, n):  # the same batch on every rank: the replicas stay identical
        g = torch.Generator(device=device).manual_seed(n)
        x = torch.randn(64, 512, device=device, generator=g)
        state["model"](x).square().mean().backward()
        state["optimizer"].step()
        state["optimizer"].zero_grad()

    def snapshot(state):
        flat = {k: v.detach().clone() for k, v in state["model"].state_dict().items()}
        for i, s in enumerate(state["optimizer"].state.values()):
            flat.update({f"opt{i}.{k}": v.detach().clone() for k, v in s.items()})
        return flat

    state = build(0)
    step(state, 0)
    with stepvault.CheckpointManager(root, "gpu", lineage=False) as mgr:
        step(state, 1)
        snaps = {}
        for at in (2, 5, 6):  # a second and third save reuse the staging buffers
            snaps[at] = snapshot(state)
            handle = mgr.save(at, state)
            assert handle.asynchronous
            for n in range(at, at + 3):  # in-place updates while the save is staged/written
                step(state, n)
        mgr.wait()
        assert mgr.stats()["failures"] == 0 and mgr.stats()["saves"] == 3
    for at, snap in snaps.items():
        fresh = build(at)
        step(fresh, 0)
        with stepvault.CheckpointManager(root, "gpu", lineage=False) as mgr:
            assert mgr.restore(fresh, step=at).step == at
        now = snapshot(fresh)
        assert now.keys() == snap.keys()
        for k, v in snap.items():
            assert now[k].device == v.device and torch.equal(now[k], v), (at, k)


def task_manager_step0_save(rank, world, root, out):
    """A collective save before the first optimizer step leaves the optimizer untouched:
    DCP's get_state_dict gives a stateless optimizer a state (a zero-lr step, AdamW step 1),
    so the first real step would have run as step 2."""
    import stepvault

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    twin = torch.nn.Linear(8, 4)  # the same training without any save
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    with stepvault.CheckpointManager(root, "s0", lineage=False) as mgr:
        mgr.save(0, {"model": model, "optimizer": opt})
        mgr.wait()
        assert not opt.state, "the save gave the optimizer a state"
        for m, o in ((model, opt), (twin, twin_opt)):
            m(torch.ones(2, 8)).sum().backward()
            o.step()
        assert all(int(s["step"]) == 1 for s in opt.state.values())
        assert torch.equal(model.module.weight, twin.weight)
        mgr.save(1, {"model": model, "optimizer": opt})
        mgr.wait()
    fresh = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    with stepvault.CheckpointManager(root, "s0", lineage=False) as mgr:
        assert mgr.restore({"model": fresh, "optimizer": fresh_opt}).step == 1
    assert torch.equal(fresh.module.weight, twin.weight)
    assert all(int(s["step"]) == 1 for s in fresh_opt.state.values())


def task_per_rank_loaders(rank, world, root, out):
    """Each rank's own data loader (its own shuffle generator) and a value that differs
    per rank, saved collectively mid-epoch: after a restore each rank continues its own
    batches, and the value is rank 0's (the documented rule; it was rank 1's)."""
    import json

    from torch.utils.data import DataLoader

    import stepvault
    from stepvault import ResumableLoader

    def loader():
        g = torch.Generator().manual_seed(50 + rank)
        return ResumableLoader(DataLoader(list(range(16)), batch_size=2, shuffle=True, generator=g))

    model = torch.nn.Linear(2, 2)
    it_loader = loader()
    batches = iter(it_loader)
    seen = [next(batches).tolist() for _ in range(3)]
    state = {"model": model, "loader": it_loader, "who": rank}
    stepvault.save(root, state, run="r", step=3)
    expected = [b.tolist() for b in batches][:2]  # this rank's next batches

    fresh = {"model": torch.nn.Linear(2, 2), "loader": loader(), "who": -1}
    assert stepvault.restore(root, fresh, run="r").step == 3
    got = [b.tolist() for _, b in zip(range(2), iter(fresh["loader"]))]
    with open(os.path.join(out, f"loader{rank}.json"), "w") as f:
        json.dump({"seen": seen, "expected": expected, "got": got, "who": fresh["who"]}, f)


def task_rank_local_on_every_rank(rank, world, root, out):
    """A rank-local manager (collective=False) made on every rank: one gets the lease,
    the other a LeaseHeldError that said only "being written by <host> pid <sibling>"."""
    from stepvault import CheckpointManager
    from stepvault.errors import LeaseHeldError

    mgr, said = None, "got the lease"
    if rank == 1:
        dist.barrier()  # rank 0 holds the lease first
    try:
        mgr = CheckpointManager(root, "r", collective=False)
    except LeaseHeldError as exc:
        said = str(exc)
    if rank == 0:
        dist.barrier()
    dist.barrier()  # the holder keeps it until the other has tried
    if mgr is not None:
        mgr.close()
    with open(os.path.join(out, f"lease{rank}.txt"), "w") as f:
        f.write(said)
