"""``keyedstate chaos`` attaches to a CLI group and refuses a plan that can't fit."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from keyedstate.cli.chaos import chaos
from keyedstate.testing.chaos.plan import make_plan

pytestmark = pytest.mark.chaos


def test_the_command_attaches_to_a_group():
    group = click.Group("keyedstate")
    group.add_command(chaos)
    result = CliRunner().invoke(group, ["chaos", "--help"])
    assert result.exit_code == 0, result.output
    for option in ("--batches", "--seed", "--master", "--faults-per-kind", "--checkpointing",
                   "--s3", "--json"):
        assert option in result.output
    text = " ".join(result.output.split())  # click wraps the help
    assert "[default: sync]" in text and "_metadata and the registry" in text


def test_too_many_faults_for_the_batches_are_refused():
    with pytest.raises(ValueError, match="too few"):
        make_plan(1, 10, 5, checkpoint_root="/x")
