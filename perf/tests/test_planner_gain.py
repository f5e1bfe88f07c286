import json

from perf import planner_gain


def test_planner_gain_writes_a_report(tmp_path, version_dir):
    code = planner_gain.main(["--profiles", "queries", "--windows", "1,4", "--texts", "8",
                              "--version-dir", str(version_dir), "--run", "g", "--out", str(tmp_path)])
    assert code == 0
    run = json.loads((tmp_path / "g.json").read_text())
    assert [(r["profile"], r["window"]) for r in run["rows"]] == [("queries", 1), ("queries", 4)]
    assert all(r[w] > 0 for r in run["rows"] for w in planner_gain.WAYS)
    text = (tmp_path / "g.md").read_text()
    assert "| queries | 4 |" in text and "planner / one at a time" in text
