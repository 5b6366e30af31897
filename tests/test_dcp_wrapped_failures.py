"""What a rank's failure inside DCP's collectives becomes on every rank.

DCP wraps each rank's exception as ``(exception, traceback summary)`` in a
``CheckpointException`` and pickles it to the other ranks. The restore agreement must still
see a mismatched state (raised as itself, with its problems) and damage (fall back) in it.
"""

from __future__ import annotations

import pickle

from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

from stepvault.distributed.agreement import _is_damage, _mismatch
from stepvault.errors import CorruptObjectError, StateMismatchError


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:  # a traceback, as DCP's wrapper takes it
        return caught


def _across_ranks(exc: BaseException) -> CheckpointException:
    """``exc`` raised on rank 1, as another rank receives DCP's wrapper of it."""
    wrapped = CheckpointException("load failed", {1: _wrap_exception(_raised(exc))})
    return pickle.loads(pickle.dumps(wrapped))


def test_a_mismatched_state_on_another_rank_is_raised_as_itself():
    problems = ["model.w: shape (4, 4) in the checkpoint, (8, 4) live", "missing: opt.step"]
    found = _mismatch(_across_ranks(StateMismatchError(problems)))
    assert isinstance(found, StateMismatchError)
    assert found.problems == problems  # not the characters of its message
    assert not _is_damage(_across_ranks(StateMismatchError(problems)))


def test_damage_on_another_rank_is_damage_and_no_mismatch():
    received = _across_ranks(CorruptObjectError("object ab12 does not match its hash"))
    assert _is_damage(received)
    assert _mismatch(received) is None
    assert not _is_damage(_across_ranks(OSError("connection reset")))


def test_a_rank_that_exited_during_a_save_is_not_called_an_upload_failure():
    """A rank whose training loop raised right after handing a save over ends the process:
    its write then fails with "cannot schedule new futures after interpreter shutdown",
    which every rank reported as "the upload to <store> failed" (the storage was fine)."""
    from stepvault.errors import SaveFailedError
    from stepvault.manager.collective_saving import save_failed_in

    exiting = RuntimeError("cannot schedule new futures after interpreter shutdown")
    found = save_failed_in(_across_ranks(exiting), 10, "/ckpts")
    assert isinstance(found, SaveFailedError) and found.ranks == (1,)
    assert "exited during the save" in str(found) and "upload" not in str(found)
    other = save_failed_in(_across_ranks(OSError("disk gone")), 10, "/ckpts")
    assert "its part failed" in str(other) or "upload" in str(other)
