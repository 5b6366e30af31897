"""A collective save whose object upload is cut (issue 33, campaign trial 20 of
``stale_partition``): every rank raises a :class:`~stepvault.errors.SaveFailedError` that
names the step, the rank(s), the cause and the way out, nothing of the step is committed,
the earlier checkpoint restores bitwise, and the next save goes through once the link is
back. It was DCP's ``CheckpointException`` (a ``BaseException``) wrapping botocore's
connection error. Real 2-rank gloo group, the real S3 test server behind the fault proxy,
which resets every object upload while the cut is on."""

from __future__ import annotations

import json
import pickle

import pytest
import save_failed_workers
from helpers import spawn_ranks
from s3_server import FaultProxy

from stepvault.errors import SaveFailedError, StepvaultError


def test_a_cut_upload_fails_the_collective_save_clearly_and_commits_nothing(
    s3, bucket, tmp_path, monkeypatch
):
    out = tmp_path / "out"
    out.mkdir()
    flag = out / "cut"
    proxy = FaultProxy(s3.endpoint, rate=0.0).start()
    proxy.cut = lambda method, path: method == "PUT" and "/objects/" in path and flag.exists()
    url = f"s3://{bucket}/store"
    monkeypatch.setenv("STEPVAULT_TEST_S3_URL", url)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        spawn_ranks(save_failed_workers.run, 2, "upload_cut", tmp_path / "unused", out)
    finally:
        proxy.stop()
    assert proxy.counts["cut"] > 0  # the uploads of step 2 were cut
    results = [json.loads((out / f"result{r}.json").read_text()) for r in range(2)]
    for rank, got in enumerate(results):
        print(rank, got)
        error = got["error"]
        assert error["type"] == "SaveFailedError", (rank, error)
        assert error["step"] == 2 and error["ranks"], (rank, error)
        message = error["message"]
        failed = error["ranks"][0]
        assert f"the save of step 2 failed on rank {failed}" in message or (
            "failed on ranks" in message
        ), message
        assert f"rank {failed}: the upload to {url} failed (connection)" in message, message
        assert "Nothing of step 2 was committed and every earlier checkpoint is intact" in message
        assert "relaunch" in message and f"can reach {url}" in message
        assert got["listed"] == [1]  # nothing of step 2 committed
        assert got["restored"] == 1 and got["bitwise"]
        assert got["after"] == [1, 2]  # the next save went through
        assert ["save_failed", 2] in got["events"] and ["save", 2] in got["events"]
    assert results[0]["error"] == results[1]["error"]  # every rank says the same


def test_the_save_failed_error_survives_the_pickle_between_ranks():
    err = SaveFailedError("the save of step 4 failed on rank 1", step=4, ranks=(1,))
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, StepvaultError) and isinstance(back, Exception)
    assert (str(back), back.step, back.ranks) == (str(err), 4, (1,))


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])


def test_a_full_node_memory_says_what_happened_to_the_save(make_tmpfs, tmp_path, monkeypatch):
    """``mem_save_failed`` said "saved to disk only" for a step due in node memory only,
    whose save then failed (nothing went to disk); now the event says which."""
    full = make_tmpfs("8m")  # rank 1's node memory, filled by the rank after step 2
    monkeypatch.setenv("STEPVAULT_TEST_MEM0", str(tmp_path / "mem0"))
    monkeypatch.setenv("STEPVAULT_TEST_MEM1", str(full))
    out = tmp_path / "out"
    spawn_ranks(save_failed_workers.run, 2, "mem_full", tmp_path / "store", out)
    results = [json.loads((out / f"result{r}.json").read_text()) for r in range(2)]
    print(results)
    assert results[1]["error"]["type"] == "StepvaultError"
    assert "step 4 was due in node memory only" in results[1]["error"]["message"]
    events = results[0]["events"]
    failed = {e["step"]: e for e in events if e["event"] == "mem_save_failed"}
    assert failed[3]["rank"] == 1 and failed[3]["result"] == "saved to disk only"
    assert failed[4]["rank"] == 1 and failed[4]["result"].startswith("not saved"), failed[4]
    assert "due in node memory only" in failed[4]["result"]
    assert results[0]["on_disk"] == [3]  # step 3 on disk; step 4 nowhere on disk
