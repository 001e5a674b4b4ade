"""Experience buffer.

Aspects under test:
- aging by policy versions and by seconds, with the limit itself kept, on add and on evict;
- take serves oldest-created first and evicts before serving;
- capacity drops the oldest (also when the newcomer is the oldest) and counts it;
- a trajectory id is accepted once: redeliveries are dropped and counted, even after a take;
- take_groups returns only whole groups, contiguous, oldest group first;
- a member dropped (capacity, expiry) takes the rest of its group with it, and later members of
  that group are dropped on arrival: no partial group waits forever;
- drop counts by reason; oldest_age; constructor validation;
- a trajectory without response tokens, or without one log-prob per response token, is
  dropped as ``malformed`` on add and never served;
- ``Trajectory`` holds its tokens as numpy arrays: lists are converted once (int32 ids; float32
  log-probs when lossless, else float64, never rounded), arrays of the right dtype are kept
  without a copy, equality compares values exactly, and ids outside int32 or non-integer ids
  are errors naming the trajectory and field.
"""

import dataclasses
from typing import Any

import numpy as np
import pytest

from rljob_workers.buffer import DROP_REASONS, ExperienceBuffer, Trajectory


def traj(
    traj_id: str, *, version: int = 0, created_at: float = 0.0, group: str | None = None
) -> Trajectory:
    """A trajectory; a group of its own unless ``group`` is given."""
    return Trajectory(
        id=traj_id,
        policy_version=version,
        created_at=created_at,
        prompt_ids=[1, 2],
        response_ids=[3],
        behaviour_logprobs=[-0.5],
        reward=1.0,
        group_id=group or traj_id,
    )


def ids(trajectories: list[Trajectory]) -> list[str]:
    return [t.id for t in trajectories]


def test_buffer_new_buffer_counts_every_reason_at_zero() -> None:
    buffer = ExperienceBuffer(capacity=4)

    assert buffer.dropped == dict.fromkeys(DROP_REASONS, 0)
    assert set(DROP_REASONS) == {"stale_version", "expired", "capacity", "duplicate", "malformed"}
    assert len(buffer) == 0


def test_buffer_add_duplicate_id_dropped_and_counted() -> None:
    buffer = ExperienceBuffer(capacity=4)

    assert buffer.add(traj("a"), now=0.0)
    assert not buffer.add(traj("a", created_at=1.0), now=1.0)
    assert len(buffer) == 1
    assert buffer.dropped["duplicate"] == 1


def test_buffer_add_redelivery_after_take_never_trained_twice() -> None:
    buffer = ExperienceBuffer(capacity=4)
    buffer.add(traj("a"), now=0.0)
    first = buffer.take(1, current_version=0, now=0.0)

    accepted = buffer.add(traj("a"), now=1.0)

    assert ids(first) == ["a"]
    assert not accepted
    assert buffer.take(1, current_version=0, now=1.0) == []
    assert buffer.dropped["duplicate"] == 1


def test_buffer_duplicate_memory_stays_flat_over_many_versions() -> None:
    """Issue 27 item 7: every id was remembered forever (~157 B each). Ids are forgotten once a
    redelivery would be stale anyway; one inside the window is still refused."""
    buffer = ExperienceBuffer(capacity=64, max_staleness_versions=2)
    for version in range(500):
        for i in range(8):
            buffer.add(traj(f"v{version}-{i}", version=version), now=float(version))
        assert len(buffer.take(8, current_version=version, now=float(version))) == 8
    assert buffer.remembered_ids <= 3 * 8  # versions 497..499
    assert not buffer.add(traj("v498-3", version=498), now=500.0, current_version=499)
    assert buffer.dropped["duplicate"] == 1
    # behind the window a redelivery is refused as stale, so forgetting it lost nothing
    assert not buffer.add(traj("v100-3", version=100), now=500.0, current_version=499)
    assert buffer.dropped["stale_version"] == 1


def test_buffer_without_a_version_bound_forgets_ids_by_age() -> None:
    buffer = ExperienceBuffer(capacity=64, max_age_seconds=10.0)
    buffer.add(traj("a", created_at=0.0), now=0.0)
    buffer.take(1, current_version=0, now=0.0)
    buffer.evict(current_version=0, now=11.0)
    assert buffer.remembered_ids == 0
    assert not buffer.add(traj("a", created_at=0.0), now=11.0)  # and expired if redelivered
    assert buffer.dropped["expired"] == 1


def test_buffer_add_past_max_age_refused_limit_kept() -> None:
    buffer = ExperienceBuffer(capacity=4, max_age_seconds=10.0)

    assert buffer.add(traj("at-limit", created_at=0.0), now=10.0)
    assert not buffer.add(traj("too-old", created_at=0.0), now=10.5)
    assert buffer.dropped["expired"] == 1


def test_buffer_add_with_current_version_refuses_stale() -> None:
    buffer = ExperienceBuffer(capacity=4, max_staleness_versions=1)

    assert buffer.add(traj("one-behind", version=4), now=0.0, current_version=5)
    assert not buffer.add(traj("two-behind", version=3), now=0.0, current_version=5)
    assert buffer.dropped["stale_version"] == 1


def test_buffer_evict_beyond_max_staleness_versions_dropped() -> None:
    buffer = ExperienceBuffer(capacity=8, max_staleness_versions=2)
    for version in range(4):
        buffer.add(traj(f"v{version}", version=version), now=0.0)

    evicted = buffer.evict(current_version=3, now=0.0)

    # versions behind: 3, 2, 1, 0 -> only v0 exceeds 2
    assert evicted == 1
    assert ids(buffer.take(8, current_version=3, now=0.0)) == ["v1", "v2", "v3"]
    assert buffer.dropped["stale_version"] == 1


def test_buffer_evict_older_than_max_age_seconds_dropped() -> None:
    buffer = ExperienceBuffer(capacity=8, max_age_seconds=60.0)
    for created_at in (0.0, 30.0, 50.0):
        buffer.add(traj(f"t{created_at:g}", created_at=created_at), now=created_at)

    evicted = buffer.evict(current_version=0, now=100.0)

    # ages 100, 70, 50 at now=100
    assert evicted == 2
    assert len(buffer) == 1
    assert buffer.dropped["expired"] == 2


def test_buffer_evict_both_stale_and_expired_counted_once_as_stale() -> None:
    buffer = ExperienceBuffer(capacity=4, max_staleness_versions=0, max_age_seconds=1.0)
    buffer.add(traj("old"), now=0.0)

    assert buffer.evict(current_version=1, now=5.0) == 1
    assert buffer.dropped["stale_version"] == 1
    assert buffer.dropped["expired"] == 0


def test_buffer_take_oldest_created_first_and_evicts_before_serving() -> None:
    buffer = ExperienceBuffer(capacity=8, max_staleness_versions=1)
    buffer.add(traj("late", created_at=3.0, version=5), now=3.0)
    buffer.add(traj("early", created_at=1.0, version=5), now=3.0)
    buffer.add(traj("stale", created_at=0.0, version=3), now=3.0)
    buffer.add(traj("middle", created_at=2.0, version=5), now=3.0)

    first = buffer.take(2, current_version=5, now=3.0)
    rest = buffer.take(5, current_version=5, now=3.0)

    assert ids(first) == ["early", "middle"]
    assert ids(rest) == ["late"]
    assert buffer.dropped["stale_version"] == 1


def test_buffer_full_drops_oldest_and_counts_capacity() -> None:
    buffer = ExperienceBuffer(capacity=2)
    buffer.add(traj("t1", created_at=1.0), now=3.0)
    buffer.add(traj("t2", created_at=2.0), now=3.0)

    accepted_newest = buffer.add(traj("t3", created_at=3.0), now=3.0)
    accepted_oldest = buffer.add(traj("t0", created_at=0.0), now=3.0)

    assert accepted_newest and not accepted_oldest
    assert ids(buffer.take(2, current_version=0, now=3.0)) == ["t2", "t3"]
    assert buffer.dropped["capacity"] == 2


def test_buffer_take_groups_returns_only_whole_groups_oldest_first() -> None:
    buffer = ExperienceBuffer(capacity=8)
    arrivals = [("c1", "c", 0.5), ("a1", "a", 1.0), ("b1", "b", 1.5), ("a2", "a", 2.0)]
    arrivals += [("c2", "c", 2.5)]
    for traj_id, group, created_at in arrivals:
        buffer.add(traj(traj_id, group=group, created_at=created_at), now=3.0)

    taken = buffer.take_groups(3, 2, current_version=0, now=3.0)

    # c is oldest (0.5), then a (1.0); b is incomplete and waits for its sibling
    assert ids(taken) == ["c1", "c2", "a1", "a2"]
    assert len(buffer) == 1
    buffer.add(traj("b2", group="b", created_at=3.5), now=4.0)
    assert ids(buffer.take_groups(3, 2, current_version=0, now=4.0)) == ["b1", "b2"]


def test_buffer_take_groups_limits_number_of_groups() -> None:
    buffer = ExperienceBuffer(capacity=8)
    for index, group in enumerate(["x", "x", "y", "y"]):
        buffer.add(traj(f"{group}{index}", group=group, created_at=float(index)), now=4.0)

    taken = buffer.take_groups(1, 2, current_version=0, now=4.0)

    assert ids(taken) == ["x0", "x1"]
    assert len(buffer) == 2


def test_buffer_oldest_age_none_when_empty_else_seconds() -> None:
    buffer = ExperienceBuffer(capacity=4)
    assert buffer.oldest_age(now=10.0) is None

    buffer.add(traj("a", created_at=4.0), now=5.0)
    buffer.add(traj("b", created_at=2.0), now=5.0)

    assert buffer.oldest_age(now=10.0) == 8.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"capacity": 0}, "capacity must be >= 1"),
        ({"capacity": 1, "max_staleness_versions": -1}, "max_staleness_versions must be >= 0"),
        ({"capacity": 1, "max_age_seconds": 0.0}, "max_age_seconds must be > 0"),
    ],
)
def test_buffer_invalid_settings_raise_naming_the_parameter(
    kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        ExperienceBuffer(**kwargs)


def test_buffer_bound_zero_keeps_current_version_and_hold_rule_agrees() -> None:
    from rljob_workers.staleness import must_hold

    buffer = ExperienceBuffer(capacity=4, max_staleness_versions=0)
    buffer.add(traj("now", version=5), now=0.0)
    buffer.add(traj("behind", version=4), now=0.0)

    assert [t.id for t in buffer.take(4, current_version=5, now=0.0)] == ["now"]
    assert buffer.dropped["stale_version"] == 1
    # the same rule for a rollout: on the current version it generates, one behind it holds
    assert not must_hold(5, 5, 0) and must_hold(5, 4, 0)


def test_trajectory_lists_become_int32_and_float64_arrays() -> None:
    t = Trajectory("a", 0, 0.0, [1, 2], [3, 151_000], [-0.5, -1.0 / 3.0], 1.0, "g")

    assert t.prompt_ids.dtype == np.int32 and t.response_ids.dtype == np.int32
    assert t.behaviour_logprobs.dtype == np.float64
    assert t.response_ids.tolist() == [3, 151_000]
    assert t.behaviour_logprobs.tolist() == [-0.5, -1.0 / 3.0]


def test_trajectory_float32_exact_logprob_list_stored_as_float32() -> None:
    sampled = [float(np.float32(-1.0 / 3.0)), -0.5, 0.0]

    t = Trajectory("a", 0, 0.0, [1], [2, 3, 4], sampled, 1.0, "g")

    assert t.behaviour_logprobs.dtype == np.float32
    assert t.behaviour_logprobs.tolist() == sampled


def test_trajectory_arrays_of_wire_dtypes_kept_without_copy() -> None:
    ids = np.array([5, 6], dtype=np.int32)
    logprobs = np.array([-0.25, -2.0], dtype=np.float32)

    t = Trajectory("a", 0, 0.0, ids, ids, logprobs, 1.0, "g")

    assert t.prompt_ids is ids and t.response_ids is ids and t.behaviour_logprobs is logprobs


def test_trajectory_empty_response_is_an_empty_int32_array() -> None:
    t = Trajectory("a", 0, 0.0, [1], [], [], 0.0, "g")

    assert t.response_ids.dtype == np.int32 and len(t.response_ids) == 0
    assert len(t.behaviour_logprobs) == 0


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("response_ids", [1, 1 << 40], "token id 1099511627776 beyond int32"),
        ("prompt_ids", [5, -(1 << 31) - 1], "token id -2147483649 beyond int32"),
        ("prompt_ids", [1.5], "expected integer token ids"),
        ("response_ids", [[1, 2]], "expected one row"),
        ("behaviour_logprobs", ["x"], "expected a sequence of numbers"),
    ],
)
def test_trajectory_bad_tokens_error_names_trajectory_and_field(field, value, message) -> None:
    fields = {"prompt_ids": [1], "response_ids": [2], "behaviour_logprobs": [-1.0]}
    fields[field] = value

    with pytest.raises(ValueError, match=f"trajectory 'bad' field '{field}': {message}"):
        Trajectory("bad", 0, 0.0, reward=0.0, group_id="g", **fields)


def test_trajectory_equality_compares_values_exactly() -> None:
    lists = Trajectory("a", 1, 2.0, [1, 2], [3], [-0.5], 1.0, "g", {"k": 1})
    arrays = Trajectory(
        "a", 1, 2.0, np.array([1, 2], np.int32), np.array([3], np.int32),
        np.array([-0.5], np.float32), 1.0, "g", {"k": 1},
    )  # fmt: skip
    off_by_ulp = dataclasses.replace(lists, behaviour_logprobs=[np.nextafter(-0.5, 0.0)])

    assert lists == arrays
    assert lists != off_by_ulp and lists != dataclasses.replace(lists, info={"k": 2})
    assert len({lists, arrays}) == 2  # hashable by identity, as a buffer entry


@pytest.mark.parametrize(
    ("response", "logprobs"),
    [([3, 4, 5], [-0.5, -0.5]), ([3], [-0.5, -0.5]), ([], [])],
    ids=["fewer-logprobs", "more-logprobs", "no-tokens"],
)
def test_buffer_malformed_trajectory_dropped_counted_and_never_served(response, logprobs) -> None:
    buffer = ExperienceBuffer(capacity=4)
    bad = dataclasses.replace(traj("bad"), response_ids=response, behaviour_logprobs=logprobs)

    assert not buffer.add(bad, now=0.0)
    assert buffer.add(traj("good"), now=0.0)

    assert buffer.dropped["malformed"] == 1
    assert ids(buffer.take(4, current_version=0, now=0.0)) == ["good"]


def test_buffer_capacity_drop_takes_the_rest_of_the_group_and_its_late_members() -> None:
    buffer = ExperienceBuffer(capacity=4)
    for name, created in (("a1", 0.0), ("a2", 1.0), ("b1", 2.0), ("b2", 3.0)):
        assert buffer.add(traj(name, created_at=created, group=name[0]), now=3.0)

    buffer.add(traj("c1", created_at=4.0, group="c"), now=4.0)  # full: a1, the oldest, goes
    late = buffer.add(traj("a3", created_at=5.0, group="a"), now=5.0)  # a member of a gone group
    buffer.add(traj("c2", created_at=6.0, group="c"), now=6.0)

    assert not late
    assert buffer.dropped["capacity"] == 3  # a1, then a2 with it, then the late a3
    assert ids(buffer.take_groups(5, 2, current_version=0, now=6.0)) == ["b1", "b2", "c1", "c2"]
    assert len(buffer) == 0  # no partial group left waiting for a member that is gone


def test_buffer_expired_member_takes_its_group_with_it() -> None:
    buffer = ExperienceBuffer(capacity=8, max_age_seconds=10)
    buffer.add(traj("a1", created_at=0.0, group="a"), now=0.0)
    buffer.add(traj("a2", created_at=5.0, group="a"), now=5.0)
    buffer.add(traj("b1", created_at=5.0, group="b"), now=5.0)

    assert buffer.take_groups(1, 2, current_version=0, now=12.0) == []  # a1 expired

    assert buffer.dropped["expired"] == 2 and len(buffer) == 1
    assert not buffer.add(traj("a3", created_at=12.0, group="a"), now=12.0)
    assert buffer.add(traj("b2", created_at=12.0, group="b"), now=12.0)
    assert ids(buffer.take_groups(1, 2, current_version=0, now=12.0)) == ["b1", "b2"]
