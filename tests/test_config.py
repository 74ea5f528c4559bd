"""Configuration means what it says: every setting is read from its string form as Flink's
configuration reads it (booleans, integers, byte sizes, durations, enums, names, mappings),
and a value that doesn't parse, from a mapping or given to ``JobConfig(...)``, is a
``ConfigurationError`` at construction naming the key, the value and what the key takes."""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import pathlib
import re
from typing import Any

import pytest

from keyedstate.config import ConfigOption, JobConfig, LateEvents, RestoreMode, parse_restore_mode
from keyedstate.config_values import (
    parse_bool,
    parse_bytes,
    parse_duration,
    parse_int,
    parse_mapping,
    parse_names,
    parse_str,
)
from keyedstate.errors import ConfigurationError

DIR = "/tmp/keyedstate-config-test"


def string_form(option: ConfigOption) -> tuple[str, Any]:
    """A string a user would write for ``option`` and the value it must parse to, unlike the
    default (so that a setting left at its default can't pass). A setting of a type not
    handled here fails: a new type needs its string form tested."""
    low = max(option.minimum or 0, option.default if isinstance(option.default, int)
              and not isinstance(option.default, bool) else 0)
    if option.type.python_type is bool:
        value = not option.default if isinstance(option.default, bool) else False
        return (" TRUE " if value else "False"), value
    if option.type.python_type is int and "bytes" in option.type.takes:
        return ("3 kb", 3 << 10) if low < 3 << 10 else ("2 gb", 2 << 30)
    if option.type.python_type is int:
        return f" {low + 3}", low + 3
    if option.type.python_type is dt.timedelta:
        return "5 min", dt.timedelta(minutes=5)
    if isinstance(option.type.python_type, type) and issubclass(option.type.python_type,
                                                                enum.Enum):
        # another member, in the other case and with '-' and '_' swapped
        other = next(m for m in option.type.python_type if m != option.default)
        spelled = str(other.value).swapcase().translate(str.maketrans("-_", "_-"))
        return spelled, other
    if option.type.python_type is str:
        return "some/where", "some/where"
    if option.type.python_type is tuple:
        return "a, b ,c", ("a", "b", "c")
    if option.type.python_type is dict:
        return '{"endpoint_url": "http://x", "n": 1}', {"endpoint_url": "http://x", "n": 1}
    raise AssertionError(f"{option.key}: no string form tested for its type ({option.type})")


@pytest.mark.parametrize("option", JobConfig.options(), ids=lambda o: o.key)
def test_every_key_is_read_from_its_string_form(option: ConfigOption) -> None:
    text, expected = string_form(option)
    assert expected != option.default
    mapping = {"execution.checkpointing.dir": DIR, option.key: text}
    config = JobConfig.from_mapping(mapping)
    assert getattr(config, option.field_name) == expected
    assert type(getattr(config, option.field_name)) is type(expected)
    # the same string given to JobConfig(...) directly
    direct = JobConfig(**{"checkpoint_dir": DIR, option.field_name: text})
    assert getattr(direct, option.field_name) == expected


def test_the_issue_examples_mean_what_they_say() -> None:
    config = JobConfig.from_mapping({
        "execution.checkpointing.dir": DIR,
        "execution.checkpointing.file-merging.enabled": "false",
        "keyedstate.watermark.delay": "300000",
        "execution.checkpointing.num-retained": "2",
        "keyedstate.late-events": "side_output",
    })
    assert config.file_merging is False
    assert config.transfer_options().merge_file_size == 0  # merging off, not on
    assert config.watermark_delay == dt.timedelta(minutes=5)
    assert config.watermark_delay_ms == 300_000
    assert config.num_retained == 2
    assert config.late_events is LateEvents.SIDE_OUTPUT
    assert JobConfig(DIR, late_events="side_output").late_events is LateEvents.SIDE_OUTPUT


@pytest.mark.parametrize("text, expected", [
    ("5 min", dt.timedelta(minutes=5)), ("300 s", dt.timedelta(seconds=300)),
    ("300000 ms", dt.timedelta(seconds=300)), ("2h", dt.timedelta(hours=2)),
    ("300000", dt.timedelta(seconds=300)), ("1 d", dt.timedelta(days=1)),
    ("2 days", dt.timedelta(days=2)), ("3 hours", dt.timedelta(hours=3)),
    ("1m", dt.timedelta(minutes=1)), ("10 Minutes", dt.timedelta(minutes=10)),
    ("7sec", dt.timedelta(seconds=7)), ("1 second", dt.timedelta(seconds=1)),
    ("5 millis", dt.timedelta(milliseconds=5)), ("250 µs", dt.timedelta(microseconds=250)),
    ("250us", dt.timedelta(microseconds=250)), ("2000 ns", dt.timedelta(microseconds=2)),
    ("0", dt.timedelta(0)), ("  15 S  ", dt.timedelta(seconds=15)),
])
def test_durations_as_flink_time_utils_reads_them(text: str, expected: dt.timedelta) -> None:
    assert parse_duration(text) == expected


def test_durations_as_python_values() -> None:
    assert parse_duration(dt.timedelta(seconds=3)) == dt.timedelta(seconds=3)
    assert parse_duration(1500) == dt.timedelta(milliseconds=1500)  # a number: ms
    assert parse_duration(2.5) == dt.timedelta(microseconds=2500)


@pytest.mark.parametrize("text, expected", [
    ("20kb", 20 * 1024), ("32 mb", 32 << 20), ("1g", 1 << 30), ("1 GB", 1 << 30),
    ("7", 7), ("-1", -1), ("12 b", 12), ("2 bytes", 2), ("1 t", 1 << 40),
    ("3 mebibytes", 3 << 20),
])
def test_byte_sizes_as_flink_memory_size_reads_them(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


#: per field: values of the wrong type or that don't parse, given as a mapping's string or to
#: JobConfig(...) directly
BAD = {
    "num_retained": ["two", "2.0", "", 2.0, True, "0", 0, None],
    "parallelism": ["1e3", 0, "x", [2]],
    "max_parallelism": ["many", 0, 1.5],
    "spark_tasks": ["0", "all"],
    "transfer_attempts": ["0", "five"],
    "tolerable_failed_checkpoints": ["-1", "3 times"],
    "watermark_delay": ["soon", "5 fortnights", "-5 s", "1.5 s", "5 min ago", -1, True,
                        dt.timedelta(seconds=-1), float("nan")],
    "file_merging": ["yes", "1", "on", 1, "enabled"],
    "background_catch_up": ["no", 0, "auto"],
    "late_events": ["sideoutput", "drop it", 1, None],
    "restore_mode": ["steal", ""],
    "source_positions": ["skip"],
    "memory_threshold": ["20 kib", "lots", "-2", "1.5mb"],
    "file_merging_max_file_size": ["0", "0 mb"],
    "file_cache_size": ["-1", "1 pb"],
    "drop_states": [[""], ["a", 3], 5],
    "backend": ["", 3, None],
    "checkpoint_dir": [3, "   "],
    "local_dir": [5],
    "backend_options": ["{not json", "[1, 2]", {1: 2}, 3],
}


def _bad_cases() -> list[tuple[str, Any]]:
    return [(name, value) for name, values in BAD.items() for value in values]


@pytest.mark.parametrize("field_name, value", _bad_cases(),
                         ids=lambda v: repr(v)[:30])
def test_a_bad_value_names_the_key_the_value_and_what_it_takes(field_name: str,
                                                                value: Any) -> None:
    option = next(o for o in JobConfig.options() if o.field_name == field_name)
    if field_name == "checkpoint_dir" or option.required:
        kwargs: dict[str, Any] = {field_name: value}
    else:
        kwargs = {"checkpoint_dir": DIR, field_name: value}
    with pytest.raises(ConfigurationError) as direct:
        JobConfig(**kwargs)
    message = str(direct.value)
    assert option.key in message and f"JobConfig.{field_name}" in message
    assert repr(value) in message and "it takes " in message
    assert isinstance(direct.value, ValueError)
    mapping = {"execution.checkpointing.dir": DIR, option.key: value}
    with pytest.raises(ConfigurationError, match=re.escape(option.key)):
        JobConfig.from_mapping(mapping)


def test_what_a_key_takes_is_said_in_its_error() -> None:
    with pytest.raises(ConfigurationError, match="one of drop, side-output"):
        JobConfig(DIR, late_events="side output")
    with pytest.raises(ConfigurationError, match="NO_CLAIM, CLAIM, LEGACY"):
        JobConfig.from_mapping({"execution.checkpointing.dir": DIR,
                                "execution.state-recovery.claim-mode": "steal"})
    with pytest.raises(ConfigurationError, match="'5 min'.*units d, h, min, s, ms"):
        JobConfig(DIR, watermark_delay="five minutes")
    with pytest.raises(ConfigurationError, match="an integer >= 1"):
        JobConfig(DIR, num_retained="0")
    with pytest.raises(ConfigurationError, match="true or false"):
        JobConfig(DIR, background_restore="yes")


@pytest.mark.parametrize("spelled", ["NO_CLAIM", "no_claim", "no-claim", "No-Claim", " no_claim "])
def test_a_restore_mode_reads_in_any_case_with_dash_or_underscore(spelled: str) -> None:
    # the configuration, LocalJob(restore_mode=) and restore_snapshot all take one spelling
    assert parse_restore_mode(spelled) is RestoreMode.NO_CLAIM
    assert JobConfig(DIR, restore_mode=spelled).restore_mode is RestoreMode.NO_CLAIM
    mapping = {"execution.checkpointing.dir": DIR, "execution.state-recovery.claim-mode": spelled}
    assert JobConfig.from_mapping(mapping).restore_mode is RestoreMode.NO_CLAIM


def test_a_missing_checkpoint_dir_names_the_key() -> None:
    with pytest.raises(ConfigurationError, match="execution.checkpointing.dir .* is required"):
        JobConfig.from_mapping({"parallelism.default": "2"})
    with pytest.raises(ConfigurationError, match="execution.checkpointing.dir"):
        JobConfig("")


def test_storage_options_that_dont_parse_are_not_shown() -> None:
    with pytest.raises(ConfigurationError) as refused:
        JobConfig(DIR, storage_options='{"secret": "hunter2"')
    assert "hunter2" not in str(refused.value)
    assert "keyedstate.checkpointing.storage-options" in str(refused.value)


def test_python_values_keep_working() -> None:
    config = JobConfig(pathlib.Path(DIR), restore_mode="claim", watermark_delay=300_000,
                       drop_states=["a", "b"], file_merging=None, max_parallelism=None,
                       restore_path="", storage_options={"anon": True})
    assert config.checkpoint_dir == DIR
    assert config.restore_mode is RestoreMode.CLAIM
    assert config.watermark_delay == dt.timedelta(minutes=5)
    assert config.drop_states == ("a", "b")
    assert config.restore_path is None  # an empty string: unset
    assert config.storage_options == {"anon": True}


def test_recorded_configuration_reads_back() -> None:
    config = JobConfig.from_mapping({"execution.checkpointing.dir": DIR,
                                     "keyedstate.watermark.delay": "2 min",
                                     "state.storage.fs.memory-threshold": "20kb",
                                     "keyedstate.late-events": "SIDE-OUTPUT"})
    assert JobConfig.from_mapping(config.recorded()) == config
    # and as strings, as a properties file or Spark conf would hold them
    as_text = {k: v if isinstance(v, (dict, tuple)) else ("" if v is None else str(v))
               for k, v in config.recorded().items()}
    assert JobConfig.from_mapping(as_text) == config


def test_every_field_is_a_declared_option_with_its_default() -> None:
    fields = dataclasses.fields(JobConfig)
    assert [o.field_name for o in JobConfig.options()] == [f.name for f in fields]
    assert len(set(JobConfig.keys())) == len(fields)
    config = JobConfig(DIR)
    for option in JobConfig.options():
        if not option.required:
            assert getattr(config, option.field_name) == option.default, option.key


def test_plain_parsers() -> None:
    assert parse_bool("TRUE") is True and parse_bool(" false ") is False
    assert parse_int("+5") == 5 and parse_int("-3") == -3
    assert parse_names("a,,b") == ("a", "b")
    assert parse_mapping('{"a": {"b": 1}}') == {"a": {"b": 1}}
    assert parse_str(pathlib.Path("/x")) == "/x"


def test_every_key_is_in_the_reference_table() -> None:
    page = (pathlib.Path(__file__).parent.parent / "docs" / "reference" / "configuration.md"
            ).read_text(encoding="utf-8")
    rows = set(re.findall(r"^\| `([\w.-]+)` \| `(\w+)` \|", page, re.M))
    assert [(o.key, o.field_name) for o in JobConfig.options()
            if (o.key, o.field_name) not in rows] == []
