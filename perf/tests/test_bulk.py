import json

import numpy as np
import pytest

from coalesce_client.batch import read_jsonl
from perf import bulk, repository


def test_the_corpus_is_a_jsonl_file_the_job_reads_whole(tmp_path):
    rows = bulk.corpus_rows(["first text", 'a "quoted" text', "ünïcode"], "queries")
    assert [r["id"] for r in rows] == ["queries-0", "queries-1", "queries-2"]
    read = read_jsonl(bulk.write_jsonl(rows, tmp_path / "corpus.jsonl"))
    assert read.ids == ["queries-0", "queries-1", "queries-2"] and not read.rejects
    assert read.texts[2] == "ünïcode".encode()


def test_cost_per_million_rows_is_the_machine_price_over_the_rows():
    # 2 cores at $0.05 each: $0.10 an hour; 100 rows/s is 360 000 rows an hour.
    assert bulk.cost_per_million_rows(100.0, 0.05, 2) == pytest.approx(0.10 / 360_000 * 1e6)
    assert bulk.cost_per_million_rows(0.0, 0.05, 2) == float("inf")


def test_the_job_is_run_as_a_user_runs_it(tmp_path):
    command = bulk.batch_command(tmp_path / "python", "127.0.0.1:8001", "minilm", tmp_path / "q.jsonl",
                                 tmp_path / "q.parquet")
    assert command[1:] == ["-m", "coalesce_client.cli", "--url", "127.0.0.1:8001", "--model", "minilm", "batch",
                           str(tmp_path / "q.jsonl"), str(tmp_path / "q.parquet"), "--restart", "--no-progress"]
    counted = bulk.batch_command(tmp_path / "python", "h:1", "m", tmp_path / "q.jsonl", tmp_path / "q.parquet",
                                 tmp_path / "tokenizer.json")
    assert counted[-2:] == ["--tokenizer", str(tmp_path / "tokenizer.json")]


def test_layouts_replace_the_instance_group_and_threads():
    shipped = (repository.MINILM / "config.pbtxt").read_text()
    two = bulk.layout_config(shipped, 2, 1)
    assert "instance_group [ { count: 2, kind: KIND_CPU } ]" in two and bulk.INSTANCE_GROUP not in two
    for key, value in (("intra_op_threads", "1"), ("thread_spinning", "false"), ("cache_bytes", "0")):
        assert f'{{ key: "{key}", value: {{ string_value: "{value}" }} }}' in two
    assert '{ key: "intra_op_threads", value: { string_value: "0" } }' in bulk.layout_config(shipped, 1, 0)
    with pytest.raises(ValueError, match="has no"):
        bulk.layout_config("name: \"x\"", 2, 1)


def test_passes_are_dealt_out_in_turn():
    groups = [np.array([i]) for i in range(5)]
    assert [[int(g[0]) for g in share] for share in bulk.deal(groups, 2)] == [[0, 2, 4], [1, 3]]


def points():
    rates = {("queries", "limit"): [500.0, 400.0], ("queries", "bulk"): [460.0, 380.0],
             ("queries", "bulk-1x2"): [420.0, 360.0], ("queries", "bulk-est"): [400.0, 300.0],
             ("queries", "online"): [250.0, 260.0], ("queries", "online-1x2"): [200.0, 220.0],
             ("documents", "limit"): [80.0, 100.0], ("documents", "bulk"): [60.0, 90.0]}
    out = [{"round": r, "profile": p, "system": s, "rows_per_s": v, "detail": f"{s} detail"}
           for (p, s), values in rates.items() for r, v in enumerate(values)]
    for point in out:
        if point["profile"] == "queries" and point["system"] == "limit":
            point["variants"] = {"1 x every core, spinning false": [point["rows_per_s"] * 0.9, "sorted, fixed 64"],
                                 "2 x 1 thread": [point["rows_per_s"], "sorted, fixed 32"]}
    return out


def test_the_summary_takes_same_round_ratios_and_costs_from_medians():
    queries, documents = bulk.summarize(points(), ["queries", "documents"], price_per_core_hour=0.05, cores=2)
    assert queries["bulk_over_limit_rounds"] == pytest.approx([0.92, 0.95])
    assert queries["bulk_over_limit"] == pytest.approx(0.935) and queries["met"]
    assert queries["bulk-est_over_limit"] == pytest.approx((0.8 + 0.75) / 2)
    assert queries["bulk-1x2_over_limit"] == pytest.approx((0.84 + 0.9) / 2)
    assert queries["bulk_rows_per_s"] == 420.0 and queries["online_rows_per_s"] == 255.0
    assert queries["bulk_cost_per_m_rows"] == pytest.approx(bulk.cost_per_million_rows(420.0, 0.05, 2))
    assert queries["bulk_over_online"] == pytest.approx(420.0 / 255.0)
    assert queries["bulk-1x2_over_online-1x2"] == pytest.approx(390.0 / 210.0)
    assert queries["limit-1x2_rows_per_s"] == pytest.approx(405.0)
    assert queries["bulk-1x2_over_limit-1x2"] == pytest.approx((420 / 450 + 360 / 360) / 2)
    assert documents["limit-1x2_rows_per_s"] is None and documents["bulk-1x2_over_limit-1x2"] is None
    assert documents["bulk_over_limit"] == pytest.approx((0.75 + 0.9) / 2) and not documents["met"]
    assert documents["online_rows_per_s"] is None and documents["online_cost_per_m_rows"] is None
    assert documents["bulk-est_over_limit"] is None


def test_the_report_is_written_again_from_its_json(tmp_path):
    run = {"date": "20261205", "command": "python -m perf.bulk", "machine": "m", "cores": 2, "rounds": 2,
           "counts": {"queries": 10000, "documents": 3000}, "seed": 0, "online_duration_s": 15.0,
           "price_per_core_hour": 0.05, "limit_note": "n", "points": points(), "summary": [], "notes": []}
    path = tmp_path / "bulk-x.json"
    path.write_text(json.dumps(run))
    assert bulk.main(["--from-json", str(path), "--note", "Quiet machine."]) == 0
    again = json.loads(path.read_text())
    assert again["summary"][0]["bulk_over_limit"] == pytest.approx(0.935) and again["notes"] == ["Quiet machine."]
    assert (tmp_path / "bulk-x.md").read_text().rstrip().endswith("Quiet machine.")


def test_the_report_states_the_price_and_every_point():
    run = {"date": "20261205", "command": "python -m perf.bulk", "machine": "x86_64, 2 cores", "cores": 2,
           "rounds": 2, "counts": {"queries": 10000, "documents": 3000}, "seed": 0, "online_duration_s": 15.0,
           "price_per_core_hour": 0.05, "limit_note": "sorted, best cuts", "points": points(),
           "summary": bulk.summarize(points(), ["queries", "documents"], price_per_core_hour=0.05, cores=2),
           "notes": ["A note."]}
    text = bulk.markdown(run)
    assert "corpora of 10000 queries, 3000 documents" in text
    assert "an assumed $0.05 per core-hour x 2 cores = $0.1/hour" in text
    assert ("| queries | 450.0 | 420.0 | **0.94** (met; rounds 0.92, 0.95) | 390.0 (0.87) | 350.0 (0.78) | - (-) | "
            "255.0 | 0.066 | 0.109 | 1.65x |") in text
    assert ("| documents | 90.0 | 75.0 | **0.82** (missed; rounds 0.75, 0.90) | - (-) | - (-) | - (-) | - | 0.370 | - "
            "| - |") in text
    assert "| queries | 405.0 | 390.0 (0.97) | 210.0 | 0.071 | 0.132 | 1.86x |" in text
    assert "| 1 | documents | bulk | 90.0 | - | bulk detail |" in text
    assert text.rstrip().endswith("A note.")
