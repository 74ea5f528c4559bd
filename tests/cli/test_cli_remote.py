"""``keyedstate storage check``, ``keyedstate checkpoints transfer`` and the transfer table of
``keyedstate checkpoints show``."""

from __future__ import annotations

import json

from click.testing import CliRunner

from keyedstate import ValueStateDescriptor
from keyedstate.cli import main
from keyedstate.runtime.local import LocalKeyedOperator

COUNT = ValueStateDescriptor("count", "bigint", default=0)


def _job(tmp_path):
    root = str(tmp_path / "job")
    with LocalKeyedOperator(root, key_types=["bigint"], parallelism=2) as op:
        for _ in range(2):
            op.process(((k, 1) for k in range(100)),
                       lambda b, k, v: b.get_state(COUNT).update(b.get_state(COUNT).value() + v))
            op.checkpoint()
        op.savepoint(str(tmp_path / "sp"))
    return root


def test_storage_check(tmp_path):
    result = CliRunner().invoke(main, ["storage", "check", str(tmp_path / "new"), "--json"])
    assert result.exit_code == 1 and "does not exist" in result.output  # docs/cli.md
    result = CliRunner().invoke(main, ["storage", "check", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["access"] == "ok" and report["local_disk"] is True
    blocked = tmp_path / "file"
    blocked.write_text("x")
    result = CliRunner().invoke(main, ["storage", "check", str(blocked / "job")])
    assert result.exit_code != 0 and "StorageLocationError" in result.output


def test_checkpoints_transfer_and_show(tmp_path):
    root = _job(tmp_path)
    result = CliRunner().invoke(main, ["checkpoints", "transfer", root, "--json"])
    assert result.exit_code == 0, result.output
    (latest,) = json.loads(result.output)  # num_retained=1
    assert latest["snapshot"]["uploaded_bytes"] > 0 and latest["objects"] > 0
    result = CliRunner().invoke(main, ["checkpoints", "transfer", str(tmp_path / "sp"),
                                       "--json"])
    (savepoint,) = json.loads(result.output)
    assert savepoint["kind"] == "savepoint"
    assert savepoint["snapshot"]["duplicated_bytes"] > 0  # hard links on one disk
    assert savepoint["snapshot"]["uploaded_bytes"] == 0
    result = CliRunner().invoke(main, ["checkpoints", "show", root, "--no-state-sizes"])
    assert result.exit_code == 0, result.output
    assert "transfers" in result.output and "duplicated server-side" in result.output
    result = CliRunner().invoke(main, ["checkpoints", "show", root, "--json",
                                       "--no-state-sizes"])
    assert json.loads(result.output)["transfer"]["snapshot"]["uploaded_bytes"] > 0
