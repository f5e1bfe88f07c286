"""A short tuning session against a real server (no timing assertions)."""

from __future__ import annotations

import json
import shutil

from coalesce_tools.tune import main as tune_main
from perf import workloads
from tests.integration.conftest import add_model


def test_short_tuning_session_writes_a_report_and_the_config(tmp_path, version_dir):
    repo = tmp_path / "repo"
    add_model(repo, "minilm")
    data = workloads.write("queries", 200, 0, tmp_path / "queries.json")
    out = tmp_path / "results"
    original = (repo / "minilm" / "config.pbtxt").read_text()
    code = tune_main(["--p99-ms", "1000000", "--model-repository", str(repo), "--input-data", str(data),
                      "--concurrency", "4", "--request-count", "100", "--delays-us", "0,100",
                      "--preferred", "none", "--rows", "16", "--tokens", "8192,100",
                      "--budget-s", "240", "--out", str(out), "--write"])
    assert code == 0
    (report,) = out.glob("tune-*.json")
    summary = json.loads(report.read_text())
    # tokens=100 is below max_sequence_length: that load fails, is reported and skipped.
    assert len(summary["failures"]) == 2
    assert "max_batch_tokens" in summary["failures"][0]["error"]
    assert len(summary["results"]) == 2
    assert summary["chosen"]["label"] in summary["frontier"]
    assert list(out.glob("tune-*.png")) and list(out.glob("tune-*.md"))
    tuned = (repo / "minilm" / "config.pbtxt").read_text()
    assert tuned != original and "max_queue_delay_microseconds: " in tuned
    assert '{ key: "max_batch_rows", value: { string_value: "16" } }' in tuned
    shutil.rmtree(repo)


def test_no_point_meeting_the_target_exits_1(tmp_path, version_dir):
    repo = tmp_path / "repo"
    add_model(repo, "minilm")
    data = workloads.write("queries", 100, 0, tmp_path / "queries.json")
    original = (repo / "minilm" / "config.pbtxt").read_text()
    code = tune_main(["--p99-ms", "0.001", "--model-repository", str(repo), "--input-data", str(data),
                      "--concurrency", "2", "--request-count", "20", "--delays-us", "0", "--preferred", "none",
                      "--rows", "16", "--tokens", "8192", "--budget-s", "120", "--out", str(tmp_path / "r"),
                      "--write"])
    assert code == 1
    assert (repo / "minilm" / "config.pbtxt").read_text() == original  # nothing written without a choice
