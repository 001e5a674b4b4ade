"""The trainer's memory of trajectory ids (security review, issue 27 item 7: the dedup sets never
shrank, ~157 B per trajectory). Aspects under test:

- a redelivered id is refused while a redelivery could be trained, remembered per version;
- ids of versions behind the staleness window are forgotten as the trainer moves on; without a
  window, ids are forgotten ``forget_after_s`` after their version's last arrival;
- many versions of traffic keep the remembered ids and the traced memory flat (measured with
  tracemalloc: the same after 2,000 versions as after 200);
- bad settings raise naming the setting.
"""

from __future__ import annotations

import tracemalloc

import pytest

from rljob_workers.dedup import SeenIds


def test_redelivery_refused_within_the_window_and_forgotten_behind_it():
    seen = SeenIds(max_versions_behind=2)
    assert seen.first_time("a", 0, now=0.0)
    assert not seen.first_time("a", 0, now=1.0)
    assert seen.first_time("b", 1, now=1.0)
    assert seen.forget(current_version=2, now=2.0) == 0  # version 0 is 2 behind: still in
    assert not seen.first_time("a", 0, now=2.0)
    assert seen.forget(current_version=3, now=3.0) == 1  # version 0 is 3 behind: forgotten
    assert "a" not in seen and "b" in seen and len(seen) == 1


def test_without_a_window_time_forgets():
    seen = SeenIds(forget_after_s=10.0)
    seen.first_time("a", 0, now=0.0)
    seen.first_time("b", 5, now=8.0)
    assert seen.forget(current_version=1000, now=9.0) == 0  # no bound: versions do not matter
    assert seen.forget(current_version=1000, now=10.5) == 1
    assert "a" not in seen and "b" in seen
    seen.first_time("c", 5, now=15.0)  # a late arrival keeps version 5 alive
    assert seen.forget(current_version=1000, now=19.0) == 0
    assert seen.forget(current_version=1000, now=25.5) == 2 and len(seen) == 0


def _traffic(seen: SeenIds, versions: range, per_version: int = 64) -> None:
    for version in versions:
        for i in range(per_version):
            seen.first_time(f"rollout-3-{version}-{i:04d}-aaaaaaaaaaaaaaaa", version, now=version)
        seen.forget(current_version=version, now=float(version))


def test_many_versions_keep_memory_flat():
    seen = SeenIds(max_versions_behind=4)
    tracemalloc.start()
    try:
        _traffic(seen, range(200))
        early = tracemalloc.get_traced_memory()[0]
        held_early = len(seen)
        _traffic(seen, range(200, 2000))
        late = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held_early == len(seen) == 5 * 64  # the window: versions current-4 .. current
    assert late < early * 1.2 + 64 * 1024, (early, late)


def test_bad_settings_raise():
    with pytest.raises(ValueError, match="max_versions_behind"):
        SeenIds(max_versions_behind=-1)
    with pytest.raises(ValueError, match="forget_after_s"):
        SeenIds(forget_after_s=0)
