"""The core board: instances of one server see who computes, across processes, and pick threads per pass."""

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from coalesce.observability.log import Logger
from coalesce.runtimes import cores
from coalesce.runtimes.cores import CoreBoard, _remove_orphan_boards
from coalesce.runtimes.onnx import OnnxRuntime
from tests.conftest import built

BACKEND = os.path.join(os.path.dirname(cores.__file__), "..", "..")


def _in_another_process(board_path, body: str) -> subprocess.Popen:
    """A process that claims a slot on ``board_path``, runs ``body`` (``board`` in scope), prints 'ready', waits."""
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {BACKEND!r})
        from pathlib import Path
        from coalesce.runtimes.cores import CoreBoard
        board = CoreBoard(own_threads=1, cores=2, path=Path({str(board_path)!r}))
        {body}
        print('ready', board.slot, flush=True)
        sys.stdin.readline()
    """)
    process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    assert process.stdout.readline().startswith("ready")
    return process


def test_a_pass_gets_every_core_while_no_other_instance_computes(tmp_path):
    board = CoreBoard(own_threads=1, cores=4, path=tmp_path / "board")
    assert board.begin() == 4
    board.end()
    neighbour = CoreBoard(own_threads=1, cores=4, path=tmp_path / "board")
    assert neighbour.slot != board.slot
    with neighbour.computing() as threads:
        assert threads == 4  # board is idle
        assert board.begin() == 1  # the neighbour computes: back to the own share
        assert neighbour.others_active() == 1
    board.end()
    assert board.others_active() == 0 and neighbour.others_active() == 0


def test_another_process_computing_is_seen_and_its_slot_is_freed_when_it_dies(tmp_path):
    path = tmp_path / "board"
    board = CoreBoard(own_threads=1, cores=2, path=path)
    other = _in_another_process(path, "board.begin()")
    try:
        assert board.others_active() == 1
        assert board.begin() == 1
        board.end()
    finally:
        other.kill()
        other.wait()
    # Its mark stays (it died mid-pass) until a newcomer reclaims the slot, whose lock died with it.
    assert board.others_active() == 1
    newcomer = _in_another_process(path, "pass")
    try:
        assert board.others_active() == 0
    finally:
        newcomer.kill()
        newcomer.wait()


def test_a_stale_mark_is_ignored(tmp_path, monkeypatch):
    board = CoreBoard(own_threads=1, cores=2, path=tmp_path / "board")
    stuck = CoreBoard(own_threads=1, cores=2, path=tmp_path / "board")
    stuck.begin()
    assert board.others_active() == 1
    later_ns = time.monotonic_ns() + int((cores.STALE_AFTER_S + 1) * 1e9)
    assert board.others_active(now_ns=later_ns) == 0


def test_a_full_board_is_a_clear_load_error(tmp_path, monkeypatch):
    monkeypatch.setattr(cores, "BOARD_SLOTS", 2)
    path = tmp_path / "board"
    CoreBoard(own_threads=1, cores=2, path=path)
    CoreBoard(own_threads=1, cores=2, path=path)
    with pytest.raises(cores.ConfigError, match="all 2 slots of the core board"):
        CoreBoard(own_threads=1, cores=2, path=path)


def test_boards_of_servers_gone_are_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f"coalesce-cores-{dead.pid}").write_bytes(b"x")
    (tmp_path / f"coalesce-cores-{os.getpid()}").write_bytes(b"x")
    (tmp_path / "unrelated").write_bytes(b"x")
    _remove_orphan_boards(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"coalesce-cores-{os.getpid()}", "unrelated"]


def test_the_default_board_is_the_launchers_or_the_parent_process(monkeypatch, tmp_path):
    monkeypatch.setenv(cores.BOARD_ENV, str(tmp_path / "b"))
    assert cores.default_board_path() == tmp_path / "b"
    monkeypatch.delenv(cores.BOARD_ENV)
    assert cores.default_board_path().name == f"coalesce-cores-{os.getppid()}"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to have a wide session")
def test_onnx_runtime_runs_wide_alone_and_on_its_share_beside_a_neighbour(tmp_path):
    runtime = OnnxRuntime(built("minilm") / "model.onnx", intra_op_threads=1, thread_spinning=False)
    before = cores.threads_of_this_process()
    message = runtime.share_cores(CoreBoard(own_threads=1, path=tmp_path / "board"), "idle")
    assert "borrowed threads at idle priority" in message
    borrowed = cores.threads_of_this_process() - before
    assert borrowed and all(os.sched_getscheduler(t) == os.SCHED_IDLE for t in borrowed)
    feeds = {"input_ids": np.full((4, 16), 1037, dtype=np.int64), "attention_mask": np.ones((4, 16), dtype=np.int64),
             "token_type_ids": np.zeros((4, 16), dtype=np.int64)}
    feeds = {t.name: feeds[t.name] for t in runtime.graph.inputs}
    outputs = [t.name for t in runtime.graph.outputs]
    wide = runtime.run(feeds, outputs)
    assert runtime.wide_passes == 1
    neighbour = CoreBoard(own_threads=1, path=tmp_path / "board")
    with neighbour.computing():
        own = runtime.run(feeds, outputs)
    assert runtime.wide_passes == 1
    for name in outputs:  # the thread count splits the work, not the sums: the same numbers
        np.testing.assert_allclose(own[name], wide[name], rtol=0, atol=1e-5)


def test_onnx_runtime_on_every_core_marks_the_board_but_holds_one_session(tmp_path):
    runtime = OnnxRuntime(built("minilm") / "model.onnx", intra_op_threads=0)
    board = CoreBoard(own_threads=2, cores=2, path=tmp_path / "board")
    assert "every pass on all 2 cores" in runtime.share_cores(board)
    watcher = CoreBoard(own_threads=1, cores=2, path=tmp_path / "board")
    seen = []
    real_run = runtime._run

    def spy(session, feeds, outputs):
        seen.append(watcher.others_active())
        return real_run(session, feeds, outputs)

    runtime._run = spy  # type: ignore[method-assign]
    feeds = {t.name: np.ones((1, 8), dtype=np.int64) for t in runtime.graph.inputs}
    runtime.run(feeds, [t.name for t in runtime.graph.outputs])
    assert seen == [1] and runtime.wide_passes == 0 and watcher.others_active() == 0


def test_marks_nest_and_the_instance_is_idle_after_the_outermost(tmp_path):
    board = CoreBoard(own_threads=1, cores=2, path=tmp_path / "board")
    watcher = CoreBoard(own_threads=1, cores=2, path=tmp_path / "board")
    with board.computing():  # a dispatch
        with board.computing():  # a pass inside it
            pass
        assert watcher.others_active() == 1  # still reading, splitting: still busy
    assert watcher.others_active() == 0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to share them")
def test_a_pipeline_marks_the_board_for_its_whole_dispatch(monkeypatch, tmp_path):
    from coalesce.loader import load_pipeline
    from tests.conftest import model_config
    from tests.unit.fakes import answers, texts

    monkeypatch.setenv(cores.BOARD_ENV, str(tmp_path / "board"))
    pipeline = load_pipeline(model_config("minilm", cost_model="0.003,0.0001,0", precision="fp32"), built("minilm"))
    assert pipeline.board is not None and pipeline.board.path == tmp_path / "board"
    watcher = CoreBoard(own_threads=1, cores=2, path=tmp_path / "board")
    seen = []
    prepare = pipeline.task.prepare

    def spy(rows):
        seen.append(watcher.others_active())  # before any pass: tokenising is inside the mark
        return prepare(rows)

    monkeypatch.setattr(pipeline.task, "prepare", spy)
    (got,) = answers(pipeline, {"TEXT": texts("marked while tokenised")})
    assert got["EMBEDDING"].shape == (1, 384) and seen == [1] and watcher.others_active() == 0
    assert pipeline.metrics.wide_passes is not None and pipeline.runtime.wide_passes == 1
    no_sharing = load_pipeline(model_config("minilm", cost_model="0.003,0.0001,0", precision="fp32",
                                            share_idle_cores="false"), built("minilm"))
    assert no_sharing.board is None and no_sharing.runtime.board is None


def test_a_board_that_cannot_be_made_leaves_the_model_serving_on_its_share(monkeypatch, tmp_path):
    from coalesce.loader import load_pipeline
    from tests.conftest import model_config
    from tests.unit.fakes import answers, texts

    monkeypatch.setenv(cores.BOARD_ENV, str(tmp_path / "no such folder" / "board"))
    lines = []

    class Lines(Logger):
        def warning(self, message):
            lines.append(message)

    pipeline = load_pipeline(model_config("minilm", cost_model="0.003,0.0001,0", precision="fp32"), built("minilm"),
                             logger=Lines("minilm"))
    assert pipeline.board is None and pipeline.runtime.board is None
    assert any("core sharing: cannot open the core board" in line and "runs every pass on intra_op_threads" in line
               for line in lines)
    (got,) = answers(pipeline, {"TEXT": texts("still served")})
    assert got["EMBEDDING"].shape == (1, 384)

