"""The supervisor's view of a server's stubs, read from a ``/proc`` laid out as Linux lays it out."""

from pathlib import Path

from coalesce_tools.processes import StubProcess, programs_under, rss_kib, stub_processes

SERVER_PID = 4678


def _process(proc: Path, pid: int, ppid: int, state: str, argv: list[str], comm: str) -> None:
    entry = proc / str(pid)
    entry.mkdir()
    (entry / "stat").write_text(f"{pid} ({comm}) {state} {ppid} 1 1 0 -1 4194560 90 0 0 0\n")
    (entry / "cmdline").write_bytes(b"".join(a.encode() + b"\0" for a in argv))


def _stub_argv(model: str, instance: str) -> list[str]:
    return ["/tmp/b/python/triton_python_backend_stub", f"/repo/{model}/1/model.py", "shm-region", "1048576",
            "1048576", str(SERVER_PID), "/tmp/b/python", "336", instance, "/tmp/b/coalesce"]


def test_stubs_of_the_server_with_their_model_and_instance(tmp_path):
    _process(tmp_path, 10, SERVER_PID, "S", _stub_argv("minilm", "minilm_0_0"), "triton_python_b")
    _process(tmp_path, 11, SERVER_PID, "Z", [], "triton_python_b")  # killed, not yet reaped: no cmdline
    _process(tmp_path, 12, 1, "S", _stub_argv("digits", "digits_0"), "triton_python_b")  # another server's
    _process(tmp_path, 13, SERVER_PID, "S", ["/usr/bin/redis-server", "--port", "1"], "redis-server")
    _process(tmp_path, 14, SERVER_PID, "R", _stub_argv("my model (v2)", "m_0"), "triton_python_b")
    (tmp_path / "self").mkdir()
    found = sorted(stub_processes(SERVER_PID, tmp_path), key=lambda s: s.pid)
    assert found == [StubProcess(pid=10, model="minilm", instance="minilm_0_0", dead=False),
                     StubProcess(pid=11, model="", instance="", dead=True),
                     StubProcess(pid=14, model="my model (v2)", instance="m_0", dead=False)]


def test_a_process_gone_between_listing_and_reading_is_skipped(tmp_path):
    (tmp_path / "99").mkdir()  # no stat, no cmdline: it exited
    assert stub_processes(SERVER_PID, tmp_path) == []


def test_resident_memory_in_kib(tmp_path):
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "status").write_text("Name:\tredis-server\nVmPeak:\t  9000 kB\nVmRSS:\t  4321 kB\n")
    assert rss_kib(7, tmp_path) == 4321
    assert rss_kib(8, tmp_path) == 0  # gone


def test_programs_under_a_folder(tmp_path):
    _process(tmp_path, 20, 1, "S", ["/tmp/coalesce-triton-ab/backends/python/triton_python_backend_stub", "x"],
             "triton_python_b")  # orphaned: its server is gone
    _process(tmp_path, 21, 1, "S", ["/tmp/coalesce-triton-abc/backends/python/triton_python_backend_stub"],
             "triton_python_b")  # another server's folder, whose name only starts alike
    _process(tmp_path, 22, 1, "Z", [], "triton_python_b")
    assert programs_under(Path("/tmp/coalesce-triton-ab"), tmp_path) == [20]
