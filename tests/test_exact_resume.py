"""Exact resume across epoch boundaries (issue 20): ResumableLoader, the Lightning fix and
``stepvault.testing.check_exact_resume`` on the plain loop, Lightning, the HF Trainer and
Accelerate (setups in ``resume_setups.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import resume_setups as setups
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from stepvault.state.dataloader import ResumableLoader
from stepvault.testing import assert_exact_resume, check_exact_resume

try:
    from torchdata.stateful_dataloader import StatefulDataLoader
except ImportError:  # optional: only the tests marked needs_torchdata use it
    StatefulDataLoader = None

#: torchdata's StatefulDataLoader (a "stateful" setup, a bare stateful loader): a skip per
#: test, so that the ResumableLoader and check tests run where torchdata is not installed.
needs_torchdata = pytest.mark.skipif(
    StatefulDataLoader is None, reason="needs torchdata: pip install torchdata"
)
LOADERS = [
    pytest.param(DataLoader, id="DataLoader"),
    pytest.param(StatefulDataLoader, id="StatefulDataLoader", marks=needs_torchdata),
]
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

DATA = TensorDataset(torch.arange(16))


def _loader(cls, generator: bool):
    kw = {"generator": torch.Generator().manual_seed(5)} if generator else {}
    return cls(DATA, batch_size=4, shuffle=True, **kw)


def _epochs(loader, n):
    return [[b[0].tolist() for b in loader] for _ in range(n)]


def _fresh(cls, generator):
    """A loader as a new process builds it (the global RNG seeded the same way)."""
    torch.manual_seed(0)
    return ResumableLoader(_loader(cls, generator))


@pytest.mark.parametrize("generator", [True, False], ids=["generator", "no-generator"])
@pytest.mark.parametrize("cls", LOADERS)
def test_resumed_mid_epoch_continues_and_later_epochs_match(cls, generator):
    straight = _epochs(_fresh(cls, generator), 3)
    first = _fresh(cls, generator)
    seen = _epochs(first, 1)
    it = iter(first)
    seen.append([next(it)[0].tolist() for _ in range(2)])  # 2 of 4 batches of epoch 1
    state, rng = first.state_dict(), torch.get_rng_state()
    resumed = _fresh(cls, generator)
    resumed.load_state_dict(state)
    torch.set_rng_state(rng)  # what RNGState does on restore
    seen[1] += [b[0].tolist() for b in resumed]
    seen += _epochs(resumed, 1)
    assert seen == straight


@pytest.mark.parametrize("cls", LOADERS)
def test_checkpoint_after_the_last_batch(cls):
    straight = _epochs(_fresh(cls, True), 3)
    first = _fresh(cls, True)
    it = iter(first)
    epoch0 = [next(it)[0].tolist() for _ in range(4)]  # the last batch, end not seen yet
    state = first.state_dict()
    # "finish" (default): the epoch's end comes first, as for the loop that saved.
    finish = _fresh(cls, True)
    finish.load_state_dict(state)
    assert [epoch0, *_epochs(finish, 3)] == [straight[0], [], *straight[1:]]

    # "next": the next epoch at once, for a consumer that takes len(loader) batches and
    # never asks the finished iterator again (Lightning does; torch's RandomSampler draws
    # once more when asked, so such a run shuffles differently from a for-loop).
    def counted(loader, n):
        out = []
        for _ in range(n):
            it = iter(loader)
            out.append([next(it)[0].tolist() for _ in range(len(loader))])
        return out

    counted_straight = counted(_fresh(cls, True), 3)
    nxt = ResumableLoader(_loader(cls, True), at_epoch_end="next")
    nxt.load_state_dict(state)
    assert [epoch0, *counted(nxt, 2)] == counted_straight


@needs_torchdata
def test_bare_stateful_dataloader_reshuffles_the_next_epoch():
    """The upstream behaviour (torchdata 0.11) that ResumableLoader works around: the
    restored iterator leaves the shared generator one draw short. If this starts to pass
    with a bare loader, torchdata fixed it: update INTEGRATIONS.md."""
    straight = _epochs(_loader(StatefulDataLoader, True), 2)
    first = _loader(StatefulDataLoader, True)
    it = iter(first)
    head = [next(it)[0].tolist()]
    resumed = _loader(StatefulDataLoader, True)
    resumed.load_state_dict(first.state_dict())
    epoch0 = head + [b[0].tolist() for b in resumed]
    assert epoch0 == straight[0]
    assert _epochs(resumed, 1)[0] != straight[1]


class Counting(Dataset):
    def __init__(self) -> None:
        self.loaded: list[int] = []

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i):
        self.loaded.append(i)
        return torch.tensor(i)


def test_skipped_batches_are_not_loaded():
    def make():
        return ResumableLoader(
            DataLoader(
                Counting(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1)
            )
        )

    straight = [b.tolist() for b in make()]
    first = make()
    it = iter(first)
    for _ in range(3):
        next(it)
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    rest = [b.tolist() for b in resumed]
    assert rest == straight[3:]
    assert len(resumed.dataset.loaded) == 5 * 4  # only the 5 remaining batches were loaded


class Stream(IterableDataset):
    def __iter__(self):
        yield from range(8)


def test_iterable_dataset_without_state_warns_once_at_save():
    loader = ResumableLoader(DataLoader(Stream(), batch_size=2))
    next(iter(loader))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader.state_dict()
        loader.state_dict()
    texts = [str(w.message) for w in caught if "IterableDataset" in str(w.message)]
    assert len(texts) == 1 and "Stream" in texts[0] and "same sequence" in texts[0]


def test_persistent_workers_warn_at_save():
    loader = ResumableLoader(DataLoader(DATA, batch_size=4, num_workers=1, persistent_workers=True))
    with pytest.warns(RuntimeWarning, match="persistent_workers=True"):
        loader.state_dict()


def test_a_state_of_another_kind_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="not a ResumableLoader state"):
        ResumableLoader(DataLoader(DATA)).load_state_dict({"_num_yielded": 3})


# ------------------------------------------------------------------ the check itself
@needs_torchdata  # plain_stateful_unwrapped
def test_check_names_the_first_differing_step_and_tensor(tmp_path):
    # The RNG is left out of the checkpoint: dropout differs from the first resumed step.
    report = check_exact_resume(
        setups.plain_without_rng, steps=12, interrupt_at=4, isolate="none", workdir=tmp_path / "a"
    )
    assert not report.exact
    first = report.first_difference
    assert (first.step, first.what) == (5, "weights")
    assert first.path.startswith("state['model']") and "max abs difference" in first.detail
    assert "NOT an exact resume" in str(report) and "step 5" in str(report)
    # A bare StatefulDataLoader: bitwise to the end of epoch 0, then epoch 1 reshuffled.
    report = check_exact_resume(
        setups.plain_stateful_unwrapped,
        steps=12,
        interrupt_at=4,
        isolate="none",
        workdir=tmp_path / "b",
    )
    first = report.first_difference
    assert (first.step, first.what) == (setups.BATCHES_PER_EPOCH + 1, "batch")
    assert report.compared_checkpoints == list(range(1, 13))


def test_check_passes_a_plain_loop_with_an_ordinary_dataloader(tmp_path):
    report = assert_exact_resume(
        setups.plain_dataloader, steps=20, interrupt_at=3, isolate="none", workdir=tmp_path
    )
    assert report.exact and report.compared_batches == 20 and report.resumed_from == 3


def test_check_refuses_what_a_fresh_process_cannot_import():
    def local(ctx):
        pass

    with pytest.raises(ValueError, match="top level of a module"):
        check_exact_resume(local, steps=4, interrupt_at=2)
    with pytest.raises(ValueError, match="multiple of save_every"):
        check_exact_resume(setups.plain_dataloader, steps=8, interrupt_at=3, save_every=2)


# ----------------------------------------------- every integration, fresh-process resume
# Resumed mid-epoch 0 (step 3 of 8 per epoch), trained across two epoch boundaries (to 20).
FRESH = dict(steps=20, interrupt_at=3, isolate="resume")


def _skip_without_packages_of(setup: str) -> None:
    """Skip the test where a package the setup trains with is not installed."""
    if setup.startswith("lightning"):
        pytest.importorskip("lightning.pytorch")
    if setup.startswith(("transformers", "accelerate")):
        pytest.importorskip(setup.split("_")[0])
    if setup.endswith("_stateful"):
        pytest.importorskip("torchdata.stateful_dataloader")


@pytest.mark.slow
@pytest.mark.parametrize(
    "setup",
    [
        # the stateful loaders' fresh-process runs are -m extended (CI's 30 minutes); their
        # epoch-boundary resume below stays in CI
        pytest.param("plain_stateful", marks=pytest.mark.extended),
        "plain_dataloader",
        pytest.param("lightning_stateful", marks=pytest.mark.extended),
        "lightning_dataloader",
        "transformers_dataloader",
        pytest.param("accelerate_stateful", marks=pytest.mark.extended),
        "accelerate_dataloader",
    ],
)
def test_fresh_process_resume_is_bitwise(setup, tmp_path):
    _skip_without_packages_of(setup)
    report = assert_exact_resume(getattr(setups, setup), workdir=tmp_path, **FRESH)
    assert report.resumed_from == 3 and report.compared_checkpoints == list(range(1, 21))


@pytest.mark.slow
@pytest.mark.parametrize(
    "setup",
    [
        "plain_stateful",
        "plain_dataloader",
        "lightning_stateful",
        "lightning_dataloader",
        "transformers_dataloader",
        "accelerate_dataloader",
        "accelerate_stateful",  # was a measured limit: repeated the epoch (now exact)
    ],
)
def test_resume_after_the_last_batch_of_an_epoch_is_exact(setup, tmp_path):
    """A checkpoint at step 8, the last batch of epoch 0 (in this process: the
    fresh-process resume is proven above; this is the epoch-boundary case)."""
    _skip_without_packages_of(setup)
    # Lightning's own loop counters epoch_progress.total.ready/started come back one
    # lower after a resume at an epoch's end (upstream bookkeeping; training is unchanged).
    ignore = ["epoch_progress"] if setup.startswith("lightning") else []
    end = setups.BATCHES_PER_EPOCH
    report = assert_exact_resume(
        getattr(setups, setup),
        steps=20,
        interrupt_at=end,
        isolate="none",
        workdir=tmp_path,
        ignore=ignore,
    )
    assert report.compared_batches == (0 if setup.startswith("transformers") else 20)


@pytest.mark.slow
@needs_torchdata  # lightning_stateful_as_before
def test_lightning_issue_scenario_without_the_fix_is_caught(tmp_path):
    """The issue's failure, found by the check: Lightning with a bare StatefulDataLoader
    (resumable_loaders=False) reshuffles the epoch after the resumed one."""
    pytest.importorskip("lightning.pytorch")
    report = check_exact_resume(
        setups.lightning_stateful_as_before,
        steps=12,
        interrupt_at=4,
        isolate="none",
        workdir=tmp_path,
    )
    first = report.first_difference
    assert (first.step, first.what) == (setups.BATCHES_PER_EPOCH + 1, "batch")


@pytest.mark.slow
def test_command_line_reports_the_first_difference(tmp_path):
    tests = str(Path(__file__).parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "stepvault.testing", "--steps", "8", "--interrupt-at", "2"]
    cmd += ["--isolate", "none"]  # the CLI is a process of its own already
    bad = subprocess.run(
        [*cmd, "resume_setups:plain_without_rng"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert bad.returncode == 1, bad.stderr[-2000:]
    assert "NOT an exact resume" in bad.stdout and "step 3: weights differs" in bad.stdout
    good = subprocess.run(
        [*cmd, "resume_setups:plain_dataloader"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert good.returncode == 0 and "exact resume" in good.stdout, good.stderr[-2000:]
