"""Every command that can't do what was asked exits non-zero with a typed error naming the path,
and no command deletes or writes anything under the paths it is given (docs/cli.md, "Exit
status and errors"). Real checkpoint directories written by the local runtime; no Spark."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

import keyedstate.errors
from keyedstate.checkpoint.resolve import resolve_snapshot
from keyedstate.cli import main
from keyedstate.processor.inspection import describe
from tests.runtime.test_local_job import batches, config, new_job

#: The bad inputs of the matrix: a missing path, a plain file, a checkpoint's ``_metadata``
#: file, the parent of a checkpoint directory, another job's directory (where a command
#: writes: as its --out), a job whose latest ``_metadata`` is truncated, a job with a damaged
#: SST file.
KINDS = ("missing", "file", "metadata", "parent", "other_job", "truncated", "damaged")

#: Commands that take no snapshot path, or whose path is tested with the command itself.
NOT_IN_MATRIX = {
    "bench": "takes no snapshot path (its --out is a file it writes, dir_okay=False)",
    "chaos": "starts Spark; its --dir is a fresh run directory of its own",
    "demo": "its --dir rule is the demo's own (tests/cli/test_cli.py); --events below",
    "metrics serve": "serves until interrupted; its path check is metrics show's "
                     "(tests/processor/test_metrics.py)",
}

OK, FAIL = "ok", "fail"


class Paths:
    """The paths of one matrix test: ``data`` holds every input (snapshotted before and after),
    ``out`` is where a command's own outputs go."""

    def __init__(self, root: Path) -> None:
        self.data, self.out = root / "data", root / "out"
        self.job = self.data / "job" / "ckpt"
        self.other = self.data / "other" / "ckpt"
        self.truncated = self.data / "truncated"
        self.damaged = self.data / "damaged"

    def bad(self, kind: str) -> Path:
        return {"missing": self.data / "no-such-dir", "file": self.data / "notes.txt",
                "metadata": self.job / "chk-2" / "_metadata", "parent": self.job.parent,
                "other_job": self.other, "truncated": self.truncated,
                "damaged": self.damaged}[kind]


def _argv(command: str, p: Paths, kind: str) -> list[str]:
    """The command line of ``command`` with the bad input of ``kind``: its source path, or for
    ``other_job`` the path it writes to, where it has one."""
    source = str(p.job if kind == "other_job" else p.bad(kind))
    target = str(p.bad(kind)) if kind == "other_job" else None
    return {
        "checkpoints list": ["checkpoints", "list", source],
        "checkpoints show": ["checkpoints", "show", source],
        "checkpoints transfer": ["checkpoints", "transfer", source],
        "checkpoints report": ["checkpoints", "report", source, "--out",
                               target or str(p.out / "report.html")],
        "savepoint create": ["savepoint", "create", source, str(p.out / "savepoint")],
        "gc": ["gc", source],
        "gc --apply": ["gc", source, "--apply"],
        "state read": ["state", "read", source, "--state", "count",
                       *(["--out", target] if target else [])],
        "storage check": ["storage", "check", source],
        "metrics show": ["metrics", "show", source],
    }[command]


_ALL_FAIL = dict.fromkeys(KINDS, FAIL)
_READS_METADATA_ONLY = {"metadata": OK, "other_job": OK, "damaged": OK}

#: command -> kind -> OK (exit 0, nothing written) or FAIL (typed error naming the path,
#: nothing written). The commands that read only ``_metadata`` files (list,
#: transfer, report, gc) don't read data files: a damaged one is found by those that do.
EXPECTED: dict[str, dict[str, str]] = {
    "checkpoints list": {**_ALL_FAIL, **_READS_METADATA_ONLY},
    "checkpoints show": {**_ALL_FAIL, "metadata": OK, "other_job": OK, "damaged": FAIL},
    "checkpoints transfer": {**_ALL_FAIL, **_READS_METADATA_ONLY},
    "checkpoints report": {**_ALL_FAIL, "metadata": OK, "damaged": OK},
    "savepoint create": {**_ALL_FAIL, "metadata": OK, "other_job": OK, "damaged": FAIL},
    "gc": {**_ALL_FAIL, "other_job": OK, "damaged": OK},
    "gc --apply": {**_ALL_FAIL, "other_job": OK, "damaged": OK},
    "state read": {**_ALL_FAIL, "metadata": OK},
    "storage check": {**dict.fromkeys(KINDS, OK), "missing": FAIL, "file": FAIL,
                      "metadata": FAIL},
    "metrics show": {**_ALL_FAIL, **_READS_METADATA_ONLY},
}


def _run_job(root: Path) -> None:
    with new_job(config(root)) as job:
        for table in batches(2, events=100):
            job.process_batch(table)


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One set of inputs, copied per test (a command that wrongly writes spoils only its own)."""
    root = tmp_path_factory.mktemp("cli-matrix")
    p = Paths(root)
    _run_job(p.job.parent)
    _run_job(p.other.parent)
    shutil.copytree(p.job, p.truncated)
    metadata = p.truncated / "chk-2" / "_metadata"
    metadata.write_bytes(metadata.read_bytes()[: metadata.stat().st_size // 2])
    shutil.copytree(p.job, p.damaged)
    ssts = [f for f in describe(resolve_snapshot(str(p.damaged)))["files"]
            if f.endswith(".sst")]
    damaged = bytearray(Path(ssts[0]).read_bytes())
    damaged[-40:] = bytes(b ^ 0xFF for b in damaged[-40:])  # the footer: same size
    Path(ssts[0]).write_bytes(damaged)
    (p.data / "notes.txt").write_text("not a checkpoint\n")
    return root


def tree(root: Path) -> dict[str, tuple[object, ...]]:
    """Every directory and file under ``root``: a file's size, mtime and content hash."""
    out: dict[str, tuple[object, ...]] = {}
    for dirpath, _, files in os.walk(root):
        out[dirpath] = ("dir",)
        for name in files:
            path = os.path.join(dirpath, name)
            st = os.stat(path)
            out[path] = (st.st_size, st.st_mtime_ns,
                         hashlib.sha256(Path(path).read_bytes()).hexdigest())
    return out


def _leaf_commands(group: click.Group, prefix: str = "") -> list[str]:
    names = []
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            names += _leaf_commands(command, f"{prefix}{name} ")
        else:
            names.append(f"{prefix}{name}")
    return names


def test_the_matrix_covers_every_command():
    covered = {c.split(" --")[0] for c in EXPECTED} | set(NOT_IN_MATRIX)
    assert set(_leaf_commands(main)) == covered


def _cases() -> list[object]:
    cases = []
    for command, kinds in EXPECTED.items():
        for kind in KINDS:
            cases.append(pytest.param(command, kind, kinds[kind], id=f"{command}-{kind}"))
    return cases


@pytest.mark.parametrize("command,kind,expected", _cases())
def test_command_on_a_bad_path(template, tmp_path, monkeypatch, command, kind, expected):
    shutil.copytree(template, tmp_path, dirs_exist_ok=True, symlinks=True)
    p = Paths(tmp_path)
    p.out.mkdir()
    monkeypatch.chdir(p.out)  # a default output lands here, never among the inputs
    before = tree(p.data)
    result = CliRunner().invoke(main, _argv(command, p, kind))
    output = result.output
    if expected == OK:
        assert result.exit_code == 0, output
    else:
        assert result.exit_code not in (0, None), output
        named = re.findall(r"\b([A-Z]\w*Error)\b", output)
        assert named and all(
            issubclass(getattr(keyedstate.errors, n, OSError), (keyedstate.errors.
                                                                KeyedStateError, OSError))
            for n in named), output
        assert str(p.bad(kind)) in output, output
        assert list(p.out.iterdir()) == [], "a failed command left output behind"
    assert tree(p.data) == before, "a command wrote or deleted under its inputs"


# -- one test per item -----------------------------------------------------------------------

def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def test_checkpoints_list_of_a_metadata_file_lists_that_checkpoint(template):
    p = Paths(template)
    code, output = invoke("checkpoints", "list", str(p.job / "chk-2" / "_metadata"), "--json")
    assert code == 0, output
    [entry] = json.loads(output)
    assert entry["id"] == 2 and entry["error"] is None


def test_report_refuses_a_directory_and_a_file_it_did_not_write(template, tmp_path):
    p = Paths(template)
    code, output = invoke("checkpoints", "report", str(p.job), "--out", str(tmp_path))
    assert code == 1 and f"OutputPathError: --out {tmp_path} is a directory" in output
    theirs = p.other / "chk-2" / "_metadata"
    before = theirs.read_bytes()
    code, output = invoke("checkpoints", "report", str(p.job), "--out", str(theirs))
    assert code == 1 and "OutputPathError" in output and str(theirs) in output
    assert theirs.read_bytes() == before
    page = tmp_path / "report.html"
    assert invoke("checkpoints", "report", str(p.job), "--out", str(page))[0] == 0
    assert invoke("checkpoints", "report", str(p.other), "--out", str(page))[0] == 0  # its own
    assert str(p.other) in page.read_text() and not list(tmp_path.glob("*.tmp"))


def test_state_read_out_refuses_a_non_empty_directory_with_a_typed_error(template, tmp_path):
    (tmp_path / "kept.txt").write_text("mine")
    code, output = invoke("state", "read", str(Paths(template).job), "--state", "count",
                          "--out", str(tmp_path))
    assert code == 1 and f"OutputPathError: --out {tmp_path} is not empty" in output


def test_state_read_out_of_an_unknown_state_creates_nothing(template, tmp_path):
    out = tmp_path / "rows"
    code, output = invoke("state", "read", str(Paths(template).job), "--state", "nope",
                          "--out", str(out))
    assert code == 1 and "StateNotFoundError" in output and "'nope'" in output
    assert not out.exists()


def test_storage_check_of_a_missing_directory_names_its_parent(tmp_path):
    code, output = invoke("storage", "check", str(tmp_path / "a" / "b"))
    assert code == 1 and "StorageLocationError" in output
    assert f"nearest existing parent is {tmp_path}" in output
    assert not (tmp_path / "a").exists()
    assert invoke("storage", "check", str(tmp_path))[0] == 0


def test_gc_of_an_empty_job_directory_is_nothing_to_collect(tmp_path):
    code, output = invoke("gc", str(tmp_path))
    assert code == 0 and "nothing is known to be garbage" in output


@pytest.mark.parametrize("option", ["--events", "--users"])
@pytest.mark.parametrize("value", ["-5", "0"])
def test_demo_refuses_no_events_or_users_before_running(tmp_path, option, value):
    code, output = invoke("demo", "--local", "--dir", str(tmp_path / "d"), option, value)
    assert code == 2 and option in output
    assert not (tmp_path / "d").exists()
