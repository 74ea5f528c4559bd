"""Key-group arithmetic equals Flink's ``KeyGroupRangeAssignment``, transcribed below from Java."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyedstate.errors import ConfigurationError, KeyGroupRangeError
from keyedstate.keygroups import (
    DEFAULT_LOWER_BOUND_MAX_PARALLELISM,
    UPPER_BOUND_MAX_PARALLELISM,
    KeyGroupRange,
    check_max_parallelism,
    check_parallelism,
    compute_default_max_parallelism,
    key_group_prefix_bytes,
    operator_index_for_key_group,
    serialize_key_group,
)
from tests.property_budget import budget

# --------------------------------------------------------------------------------------------
# Flink's Java, transcribed line by line with Java's 32-bit int arithmetic
# (org.apache.flink.runtime.state.KeyGroupRangeAssignment, org.apache.flink.util.MathUtils)
# --------------------------------------------------------------------------------------------


def _int(x: int) -> int:
    """Java ``int`` overflow: wrap to a signed 32-bit value."""
    x &= 0xFFFFFFFF
    return x - (1 << 32) if x >= 1 << 31 else x


def _idiv(a: int, b: int) -> int:
    """Java ``/`` on ints: truncates toward zero."""
    q = abs(a) // abs(b)
    return _int(q if (a >= 0) == (b >= 0) else -q)


def _ushr(x: int, n: int) -> int:
    return (x & 0xFFFFFFFF) >> n


def java_round_up_to_power_of_two(x: int) -> int:
    # MathUtils.roundUpToPowerOfTwo
    x = _int(x - 1)
    x = _int(x | (x >> 1))
    x = _int(x | (x >> 2))
    x = _int(x | (x >> 4))
    x = _int(x | (x >> 8))
    x = _int(x | (x >> 16))
    return _int(x + 1)


def java_check_parallelism_preconditions(parallelism: int) -> None:
    if not (parallelism > 0 and parallelism <= 1 << 15):
        raise ValueError(f"Operator parallelism not within bounds: {parallelism}")


def java_compute_default_max_parallelism(operator_parallelism: int) -> int:
    java_check_parallelism_preconditions(operator_parallelism)
    return min(
        max(java_round_up_to_power_of_two(_int(operator_parallelism
                                               + _idiv(operator_parallelism, 2))), 1 << 7),
        1 << 15,
    )


def java_compute_key_group_range_for_operator_index(
    max_parallelism: int, parallelism: int, operator_index: int
) -> tuple[int, int]:
    java_check_parallelism_preconditions(parallelism)
    java_check_parallelism_preconditions(max_parallelism)
    if not max_parallelism >= parallelism:
        raise ValueError("Maximum parallelism must not be smaller than parallelism.")
    start = _idiv(_int(_int(operator_index * max_parallelism) + parallelism - 1), parallelism)
    end = _idiv(_int(_int((operator_index + 1) * max_parallelism) - 1), parallelism)
    return start, end


def java_compute_operator_index_for_key_group(
    max_parallelism: int, parallelism: int, key_group_id: int
) -> int:
    return _idiv(_int(key_group_id * parallelism), max_parallelism)


# --------------------------------------------------------------------------------------------

PAIRS = sorted(
    {(p, m) for m in (1, 2, 3, 7, 8, 10, 127, 128, 129, 256, 1000, 4096, 32767, 32768)
     for p in (1, 2, 3, 5, 7, 8, 10, 13, 64, 100, 127, 128, 1000, 32768) if p <= m}
    | {(m, m) for m in (1, 9, 128, 32768)}
)


def test_bounds_are_flinks():
    assert DEFAULT_LOWER_BOUND_MAX_PARALLELISM == 128
    assert UPPER_BOUND_MAX_PARALLELISM == 32768


@pytest.mark.parametrize(
    ("parallelism", "expected"),
    [(1, 128), (2, 128), (85, 128), (86, 256), (100, 256), (171, 256), (172, 512),
     (1000, 2048), (21845, 32768), (21846, 32768), (30000, 32768), (32768, 32768)],
)
def test_default_max_parallelism_known_values(parallelism, expected):
    assert compute_default_max_parallelism(parallelism) == expected
    assert java_compute_default_max_parallelism(parallelism) == expected


@given(st.integers(1, UPPER_BOUND_MAX_PARALLELISM))
@settings(max_examples=budget(300), deadline=None)
def test_default_max_parallelism_equals_flink(parallelism):
    assert compute_default_max_parallelism(parallelism) == \
        java_compute_default_max_parallelism(parallelism)


def test_default_max_parallelism_exhaustive_small():
    for p in range(1, 5000):
        assert compute_default_max_parallelism(p) == java_compute_default_max_parallelism(p), p


@pytest.mark.parametrize(("parallelism", "max_parallelism"), PAIRS)
def test_ranges_equal_flink_and_partition_all_key_groups(parallelism, max_parallelism):
    owner: dict[int, int] = {}
    previous_end = -1
    for index in range(parallelism):
        rng = KeyGroupRange.of_operator(max_parallelism, parallelism, index)
        assert (rng.start, rng.end) == java_compute_key_group_range_for_operator_index(
            max_parallelism, parallelism, index)
        # contiguous, in subtask order, never empty when parallelism <= max parallelism
        assert rng.start == previous_end + 1
        assert len(rng) >= 1
        previous_end = rng.end
        for kg in rng:
            assert kg not in owner, f"key group {kg} owned twice"
            owner[kg] = index
    assert previous_end == max_parallelism - 1
    assert sorted(owner) == list(range(max_parallelism))
    for kg, index in owner.items():
        assert operator_index_for_key_group(max_parallelism, parallelism, kg) == index
        assert java_compute_operator_index_for_key_group(max_parallelism, parallelism, kg) == index


@given(st.data())
@settings(max_examples=budget(200), deadline=None)
def test_range_and_owner_equal_flink_random(data):
    max_parallelism = data.draw(st.integers(1, UPPER_BOUND_MAX_PARALLELISM), "maxP")
    parallelism = data.draw(st.integers(1, max_parallelism), "p")
    index = data.draw(st.integers(0, parallelism - 1), "index")
    rng = KeyGroupRange.of_operator(max_parallelism, parallelism, index)
    assert (rng.start, rng.end) == java_compute_key_group_range_for_operator_index(
        max_parallelism, parallelism, index)
    for kg in {rng.start, rng.end, (rng.start + rng.end) // 2}:
        assert operator_index_for_key_group(max_parallelism, parallelism, kg) == index
    kg = data.draw(st.integers(0, max_parallelism - 1), "kg")
    assert operator_index_for_key_group(max_parallelism, parallelism, kg) == \
        java_compute_operator_index_for_key_group(max_parallelism, parallelism, kg)


@pytest.mark.parametrize("parallelism", [0, -1, 32769, 1.5, "2", True, None])
def test_bad_parallelism_is_a_configuration_error(parallelism):
    with pytest.raises(ConfigurationError):
        compute_default_max_parallelism(parallelism)
    with pytest.raises(ConfigurationError):
        KeyGroupRange.of_operator(32768, parallelism, 0)


@pytest.mark.parametrize("max_parallelism", [0, -5, 32769, 1 << 20, 2.0, "128", False])
def test_bad_max_parallelism_is_a_configuration_error(max_parallelism):
    with pytest.raises(ConfigurationError):
        check_max_parallelism(max_parallelism)
    with pytest.raises(ConfigurationError):
        key_group_prefix_bytes(max_parallelism)
    with pytest.raises(ConfigurationError):
        KeyGroupRange.of_operator(max_parallelism, 1, 0)


def test_parallelism_above_max_parallelism_is_refused():
    with pytest.raises(ConfigurationError, match="max parallelism"):
        check_parallelism(9, 8)
    with pytest.raises(ConfigurationError):
        KeyGroupRange.of_operator(8, 9, 0)
    check_parallelism(8, 8)


@pytest.mark.parametrize("index", [-1, 4, 100])
def test_bad_subtask_index_is_refused(index):
    with pytest.raises(ConfigurationError):
        KeyGroupRange.of_operator(128, 4, index)


def test_configuration_error_is_a_value_error():
    with pytest.raises(ValueError):
        check_parallelism(0, 128)


@pytest.mark.parametrize(
    ("max_parallelism", "expected"),
    [(1, 1), (2, 1), (100, 1), (127, 1), (128, 1), (129, 2), (256, 2), (32768, 2)],
)
def test_key_group_prefix_bytes(max_parallelism, expected):
    assert key_group_prefix_bytes(max_parallelism) == expected


def test_serialize_key_group_is_big_endian_and_sorts_like_the_key_group():
    assert serialize_key_group(0, 1) == b"\x00"
    assert serialize_key_group(127, 1) == b"\x7f"
    assert serialize_key_group(258, 2) == b"\x01\x02"
    assert serialize_key_group(32767, 2) == b"\x7f\xff"
    encoded = [serialize_key_group(kg, 2) for kg in range(0, 32768, 97)]
    assert encoded == sorted(encoded)


def test_key_group_range_behaviour():
    rng = KeyGroupRange(3, 6)
    assert len(rng) == 4 and bool(rng)
    assert list(rng) == [3, 4, 5, 6]
    assert 3 in rng and 6 in rng and 2 not in rng and 7 not in rng
    assert "4" not in rng
    assert rng.intersection(KeyGroupRange(5, 10)) == KeyGroupRange(5, 6)
    assert not rng.intersection(KeyGroupRange(7, 10))
    assert len(rng.intersection(KeyGroupRange(7, 10))) == 0
    assert rng.contains_range(KeyGroupRange(4, 5))
    assert rng.contains_range(KeyGroupRange.empty())
    assert not rng.contains_range(KeyGroupRange(2, 4))
    empty = KeyGroupRange.empty()
    assert not empty and len(empty) == 0 and list(empty) == []
    rng.check_key_group(5)
    with pytest.raises(KeyGroupRangeError):
        rng.check_key_group(7)
    with pytest.raises(KeyGroupRangeError):
        empty.check_key_group(0)


@pytest.mark.parametrize("spark_tasks", [0, -1, 1.5, "two", "0", True])
def test_bad_spark_tasks_is_a_configuration_error(spark_tasks):
    from keyedstate.config import JobConfig

    with pytest.raises(ConfigurationError, match="keyedstate.spark.tasks"):
        JobConfig(checkpoint_dir="/x", parallelism=4, spark_tasks=spark_tasks)
    # more Spark tasks than subtasks is fine: the job runs one per subtask
    assert JobConfig(checkpoint_dir="/x", parallelism=4, spark_tasks=16).spark_tasks == 16
    # its string form is read as Flink reads an integer (tests/test_config.py)
    assert JobConfig(checkpoint_dir="/x", parallelism=4, spark_tasks="2").spark_tasks == 2


def test_a_range_is_split_into_contiguous_non_empty_parts_covering_it_exactly():
    whole = KeyGroupRange(10, 29)
    assert whole.is_split_into([KeyGroupRange(10, 14), KeyGroupRange(15, 29)])
    assert whole.is_split_into([whole])
    for parts in ([], [KeyGroupRange(10, 28)], [KeyGroupRange(10, 14), KeyGroupRange(16, 29)],
                  [KeyGroupRange(10, 15), KeyGroupRange(15, 29)],
                  [KeyGroupRange(15, 29), KeyGroupRange(10, 14)],
                  [KeyGroupRange(10, 29), KeyGroupRange.empty()],
                  [KeyGroupRange(9, 29)], [KeyGroupRange(10, 30)]):
        assert not whole.is_split_into(parts), parts
