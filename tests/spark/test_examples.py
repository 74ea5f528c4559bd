"""The examples on Spark (local[2,4]): they match their oracles, and the ParquetSink output of a
real run has the names docs/spark.md shows (its listing and the sink's patterns) and reads
back as that page says."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import pytest

from examples import card_alerts, page_views
from keyedstate.spark.sinks import (
    BATCH_DIR_PATTERN,
    PART_FILE_PATTERN,
    SUCCESS_FILE,
    TEMPORARY_DIR,
)

pytestmark = pytest.mark.spark

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FILES = 2  # batches 0 and 1, then the drain as batch 2: the run docs/spark.md lists
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


@pytest.fixture(scope="module")
def card_alerts_run(spark: Any, tmp_path_factory: pytest.TempPathFactory
                    ) -> tuple[card_alerts.Report, str]:
    directory = str(tmp_path_factory.mktemp("card-alerts"))
    return card_alerts.run_spark(spark, directory, 3000, 100, files=FILES), directory


def test_card_alerts_on_spark_matches_its_oracle(card_alerts_run):
    report, _ = card_alerts_run
    assert report.verified, report.checks
    assert report.batches == FILES + 1 and report.outputs["alerts"] > 0
    assert report.details["query_name"] == "card-alerts"
    # Idle timers fired between batches, not only in the drain.
    assert report.details["timers_fired"] > report.details["timers_fired_in_drain"] > 0


def find(root: str, directory: str) -> list[str]:
    """``cd root && find directory``: every path under it, ``directory`` included."""
    found = [directory]
    for folder, subfolders, names in os.walk(os.path.join(root, directory)):
        found += [os.path.relpath(os.path.join(folder, n), root) for n in [*subfolders, *names]]
    return sorted(found)


def shape(path: str) -> str:
    """A listed path with the query id, batch id and part number left out."""
    path = UUID.sub("<query id>", path)
    path = re.sub(r"batch-\d{10}", "batch-<B>", path)
    return re.sub(r"part-\d{5}", "part-<n>", path)


def documented_listing() -> tuple[list[str], dict[str, Any]]:
    """The ``find`` listing of docs/spark.md (*ParquetSink files*) and the ``_SUCCESS`` it
    shows."""
    with open(os.path.join(ROOT, "docs", "spark.md"), encoding="utf-8") as f:
        doc = f.read()
    block = re.search(r"\n\$ cd card-alerts && find output/periods[^\n]*\n(.*?)\n\$ cat [^\n]*"
                      r"\n(\{.*?\})\n```", doc, re.S)
    assert block, "docs/spark.md lost its listing of a ParquetSink"
    return block.group(1).split("\n"), json.loads(block.group(2))


def test_parquet_sink_names_are_the_documented_ones(card_alerts_run):
    report, directory = card_alerts_run
    query_id = report.details["query_id"]
    for output in ("periods", "alerts"):
        out = os.path.join(directory, "output", output)
        batches = sorted(d for d in os.listdir(out) if d != TEMPORARY_DIR)
        for name in batches:
            match = BATCH_DIR_PATTERN.match(name)
            assert match and match["lineage"] == query_id, name
            files = sorted(os.listdir(os.path.join(out, name)))
            assert SUCCESS_FILE in files and all(
                PART_FILE_PATTERN.match(f) for f in files if f != SUCCESS_FILE), files
            with open(os.path.join(out, name, SUCCESS_FILE)) as f:
                manifest = json.load(f)
            assert manifest["lineage"] == query_id
            assert manifest["batch_id"] == int(match["batch_id"])
            assert [p["name"] for p in manifest["files"]] == [f for f in files
                                                              if f != SUCCESS_FILE]
        assert os.listdir(os.path.join(out, TEMPORARY_DIR)) == []
    # The drain's batch is named like every other (the timers it fires emit summaries).
    periods = os.listdir(os.path.join(directory, "output", "periods"))
    assert {int(BATCH_DIR_PATTERN.match(d)["batch_id"]) for d in periods
            if d != TEMPORARY_DIR} == set(range(FILES + 1))
    # docs/spark.md shows a listing of the same shape, under the same patterns.
    listed, manifest = documented_listing()
    real = find(directory, os.path.join("output", "periods"))
    assert sorted({shape(p) for p in listed}) == sorted({shape(p) for p in real})
    for path in listed:
        for part in path.split("/")[2:]:
            assert (part in (SUCCESS_FILE, TEMPORARY_DIR) or BATCH_DIR_PATTERN.match(part)
                    or PART_FILE_PATTERN.match(part)), part
    documented_batch = f"{manifest['lineage']}-batch-{manifest['batch_id']:010d}"
    assert [p["name"] for p in manifest["files"]] == [
        p.split("/")[-1] for p in listed if f"/{documented_batch}/part-" in p]


def test_parquet_sink_output_reads_back_as_documented(spark, card_alerts_run):
    import duckdb
    import pandas as pd
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq
    from pyspark.errors import AnalysisException

    report, directory = card_alerts_run
    path = os.path.join(directory, "output", "periods")
    columns = [c.split()[0] for c in card_alerts.PERIODS_DDL.split(", ")]
    frames = {
        "pandas": pd.read_parquet(path),
        "pyarrow dataset": ds.dataset(path, format="parquet").to_table().to_pandas(),
        "pq.read_table": pq.read_table(path).to_pandas(),
        "spark": spark.read.option("recursiveFileLookup", "true").parquet(path).toPandas(),
        "duckdb": duckdb.sql(f"SELECT * FROM read_parquet('{path}/*/*.parquet')").df(),
    }
    for reader, frame in frames.items():
        assert list(frame.columns) == columns, reader
        assert len(frame) == report.outputs["periods"], reader
    with pytest.raises(AnalysisException, match="UNABLE_TO_INFER_SCHEMA"):
        spark.read.parquet(path).collect()


def test_page_views_on_spark_matches_its_oracle_across_a_restart(spark, tmp_path):
    files = 4
    report = page_views.run_spark(spark, str(tmp_path / "page-views"), 3000, 50, files=files)
    assert report.verified, report.checks
    # The second start resumed after the first one's last batch, and met redeliveries of
    # views counted before the stop.
    assert report.details["first_batch_of_each_start"] == [0, files // 2]
    assert report.batches == files
    assert report.details["redelivered_across_the_restart"] > 0
