"""``keyedstate bench throughput --interleave`` is refused where there is no interleaved mode
(the mode itself runs in tests/spark/test_bench_throughput.py)."""

from __future__ import annotations

from click.testing import CliRunner

from keyedstate.cli import main


def test_cli_refuses_interleave_of_a_benchmark_without_it() -> None:
    result = CliRunner().invoke(main, ["bench", "checkpoint", "--interleave"])
    assert result.exit_code == 2 and "--interleave" in result.output
    assert "only throughput has" in result.output


def test_cli_refuses_interleave_of_the_throughput_sweep() -> None:
    result = CliRunner().invoke(main, ["bench", "throughput", "--sweep", "--interleave"])
    assert result.exit_code == 2 and "'throughput' --sweep has no interleaved mode" \
        in result.output


def test_cli_refuses_batches_of_a_benchmark_without_a_batch_count() -> None:
    result = CliRunner().invoke(main, ["bench", "checkpoint", "--batches", "24"])
    assert result.exit_code == 2 and "'checkpoint' has no batch count" in result.output


def test_cli_refuses_fewer_than_two_batches() -> None:
    result = CliRunner().invoke(main, ["bench", "throughput", "--batches", "1"])
    assert result.exit_code == 2 and "--batches" in result.output
