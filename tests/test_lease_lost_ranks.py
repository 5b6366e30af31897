"""A lost writer lease reaches every rank as itself (issue 33, found on namespaced hosts).

When rank 0's fenced commit is refused inside DCP's collective finish, DCP pickles the
exception to the other ranks and wraps it in a ``CheckpointException``. The other ranks
got a ``TypeError`` (``LeaseLostError`` could not be rebuilt from its pickle: keyword-only
fields) and rank 0 got DCP's wrapper. The end-to-end case is the ``stale_partition``
scenario of ``tests/hosts.py`` (slow, in ``tests/test_hosts.py``)."""

from __future__ import annotations

import pickle

from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

from stepvault.errors import LeaseLostError
from stepvault.manager.collective_saving import lease_lost_in


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:  # a traceback, as DCP's wrapper takes it
        return caught


def test_a_lost_lease_survives_the_pickle_between_ranks():
    lost = LeaseLostError("the commit of r@6 was refused", run="r", owner=("h2", 4242))
    back = pickle.loads(pickle.dumps(lost))
    assert type(back) is LeaseLostError
    assert (str(back), back.run, back.owner) == (str(lost), "r", ("h2", 4242))


def test_every_rank_raises_the_lost_lease_not_dcps_wrapper():
    lost = _raised(LeaseLostError("the commit of r@6 was refused", run="r", owner=None))
    wrapped = CheckpointException("finish failed", {0: _wrap_exception(lost)})
    # what rank 1 receives: the wrapper, pickled across ranks
    received = pickle.loads(pickle.dumps(wrapped))
    unwrapped = lease_lost_in(received)
    assert isinstance(unwrapped, LeaseLostError) and unwrapped.run == "r"
    other = CheckpointException("x", {0: _wrap_exception(_raised(OSError("disk")))})
    assert lease_lost_in(other) is other
