"""content_hash: the same digest whether BLAKE3 uses its own threads or the caller's only."""

from __future__ import annotations

import os
import threading

import blake3

from stepvault.format import hashing
from stepvault.format.hashing import content_hash, one_thread_per_hash


def test_one_thread_per_hash_gives_the_same_digest_and_is_scoped(monkeypatch):
    data = os.urandom((4 << 20) + 123)  # above the size where BLAKE3's threads are used
    seen: list[int] = []
    real = hashing.blake3

    def spy(buf, max_threads=1):
        seen.append(max_threads)
        return real(buf, max_threads=max_threads)

    monkeypatch.setattr(hashing, "blake3", spy)
    spy.AUTO = real.AUTO  # type: ignore[attr-defined]
    want = blake3.blake3(data).hexdigest()
    assert content_hash(memoryview(data)) == want
    with one_thread_per_hash():
        assert content_hash(memoryview(data)) == want
        with one_thread_per_hash():
            pass
        assert content_hash(memoryview(data)) == want  # still single after a nested exit
        other: list[str] = []
        t = threading.Thread(target=lambda: other.append(content_hash(memoryview(data))))
        t.start()
        t.join()
    assert content_hash(memoryview(data)) == want
    # AUTO outside, 1 inside (twice), AUTO on the other thread (the mode is per thread), AUTO after
    assert seen == [real.AUTO, 1, 1, real.AUTO, real.AUTO]
    assert other == [want]
