"""The suite's own pytest options: slow tests deselected unless asked for, a hanging test failed by a timeout.

Each check runs a child pytest in a scratch folder under the project's ``[tool.pytest.ini_options]``
(the per-test timeout shortened, so a hang shows in seconds), as CI would meet them.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import tomllib

from tests.conftest import ROOT

SCRATCH_TESTS = """
import time
import pytest

def test_quick():
    pass

@pytest.mark.slow
def test_minutes_of_load():
    pass

def test_hangs():
    time.sleep(120)
"""


def _options() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]


def _scratch(tmp_path, timeout_s: int) -> None:
    options = dict(_options(), timeout=timeout_s, testpaths=["."])
    lines = ["[pytest]"]
    for key, value in options.items():
        if isinstance(value, list):
            value = "\n    " + "\n    ".join(f'"{v}"' if key == "addopts" and " " in v else v for v in value)
        lines.append(f"{key} = {value}")
    (tmp_path / "pytest.ini").write_text("\n".join(lines) + "\n")
    (tmp_path / "test_scratch.py").write_text(SCRATCH_TESTS)


def _pytest(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=100,
    )
    return run, time.monotonic() - started


def test_the_project_sets_a_per_test_timeout_and_deselects_slow_tests():
    options = _options()
    assert int(options["timeout"]) > 0
    assert options["addopts"][-2:] == ["-m", "not slow"]


def test_a_hanging_test_fails_within_the_timeout(tmp_path):
    _scratch(tmp_path, timeout_s=2)
    run, took_s = _pytest(tmp_path, "test_scratch.py::test_hangs")
    assert run.returncode == 1, run.stdout[-2000:]
    assert "Timeout" in run.stdout and "FAILED test_scratch.py::test_hangs" in run.stdout, run.stdout[-2000:]
    assert took_s < 60, f"the hanging test ran {took_s:.0f} s"


@pytest.mark.parametrize(
    ("args", "ran", "deselected"),
    [
        ((), {"test_quick"}, {"test_minutes_of_load"}),
        (("-m", "slow"), {"test_minutes_of_load"}, {"test_quick"}),
    ],
)
def test_slow_tests_run_only_when_asked_for(tmp_path, args, ran, deselected):
    _scratch(tmp_path, timeout_s=30)
    run, _ = _pytest(tmp_path, "-k", "not hangs", *args)
    assert run.returncode == 0, run.stdout[-2000:]
    passed = {line.split("::")[1].split()[0] for line in run.stdout.splitlines() if line.startswith("PASSED")}
    assert passed == ran, run.stdout[-2000:]
    assert f"{len(deselected) + 1} deselected" in run.stdout, run.stdout[-2000:]
