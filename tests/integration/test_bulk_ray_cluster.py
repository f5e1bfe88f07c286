"""A bulk job on a real Ray cluster loses a worker node mid-job and still writes every id exactly once (slow).

On this machine, as separate processes: a Ray head (no CPUs, so no work runs there) and two
worker nodes (2 Ray CPUs each: two actors of a quarter CPU and a read task fit) started with
``ray start``, each beside its own tritonserver serving minilm as
shipped (``COALESCE_TRITON_URL``, so ``--url node`` sends each node's requests to its own
replica). ``coalesce-client batch --engine ray`` runs 100 000 rows over the cluster; once a
tenth of the part files are written, node ``b`` is killed (its ``ray start``, raylet and
agents, SIGKILL). Ray restarts the lost actors on node ``a`` and retries their batches. The
output must hold each of the 100 000 ids exactly once, and so must the part files.

``make bulk-ray-test`` runs it and writes perf/results/bulk-ray-test-<date>.md
(``BULK_RAY_REPORT``).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from coalesce_client.load import sample_texts
from coalesce_tools.launcher import ServerOptions, free_port
from tests.conftest import REPOSITORY, built
from tests.integration.conftest import add_model, start_server

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ray = pytest.importorskip("ray", reason="the ray extra is not installed")

ROWS = 100_000
BATCH_ROWS = 1000
#: Ray's settings for a cluster of separate processes on one machine: no token (every process would need the
#: same one), no usage report, and a dead node noticed in about 3 s instead of 15.
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "RAY_health_check_period_ms": "1000",
           "RAY_health_check_failure_threshold": "3"}
RAY = str(Path(sys.executable).with_name("ray"))


class RayCluster:
    """A head and worker nodes, each ``ray start`` in its own process group and temporary folder."""

    def __init__(self, root: Path) -> None:
        self.port = free_port()
        # Short: a Unix socket path under it must stay within 107 bytes.
        self.root = Path(f"/tmp/coalesce-ray-{self.port}")
        self.logs = root
        self.nodes: dict[str, subprocess.Popen] = {}
        self.head_group: int | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start_head(self) -> None:
        # A session of its own: the head's daemons keep its process group after `ray start` returns.
        head = subprocess.Popen([RAY, "start", "--head", f"--port={self.port}", "--num-cpus=0",
                                 "--include-dashboard=false", "--disable-usage-stats", "--node-ip-address=127.0.0.1",
                                 "--object-store-memory=200000000", f"--temp-dir={self.root}/head"],
                                env={**os.environ, **RAY_ENV}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        self.head_group = head.pid
        out, _ = head.communicate(timeout=120)
        assert head.returncode == 0, out[-3000:]

    def start_worker(self, name: str, triton_url: str) -> None:
        # A folder of its own: worker nodes started together on one host would race on the head's sockets.
        log = open(self.logs / f"ray-{name}.log", "w")  # noqa: SIM115 (closed with the process)
        self.nodes[name] = subprocess.Popen(
            [RAY, "start", f"--address={self.address}", "--num-cpus=2", "--node-ip-address=127.0.0.1",
             "--object-store-memory=200000000", f"--temp-dir={self.root}/{name}", "--disable-usage-stats",
             "--block"],
            env={**os.environ, **RAY_ENV, "COALESCE_TRITON_URL": triton_url}, start_new_session=True, stdout=log,
            stderr=subprocess.STDOUT)

    def wait_alive(self, count: int, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            status = subprocess.run([RAY, "status", f"--address={self.address}"], env={**os.environ, **RAY_ENV},
                                    capture_output=True, text=True, timeout=60)
            if status.stdout.count(" node_") >= count + 1:
                return
            for name, process in self.nodes.items():
                assert process.poll() is None, f"Ray node {name} exited: {(self.logs / f'ray-{name}.log').read_text()}"
            assert time.monotonic() < deadline, f"{count} worker nodes did not join: {status.stdout}"
            time.sleep(1)

    def kill(self, name: str) -> None:
        """SIGKILL a worker node: its ``ray start``, raylet and agents (its workers exit with their raylet)."""
        os.killpg(self.nodes.pop(name).pid, signal.SIGKILL)

    def stop(self) -> None:
        """Kill every node's processes (not `ray stop`, which would stop any other Ray on the machine too)."""
        groups = [process.pid for process in self.nodes.values()]
        groups += [self.head_group] if self.head_group else []
        for group in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """Two tritonservers, each serving minilm as shipped from a repository of its own."""
    built("minilm")
    servers = []
    for name in ("a", "b"):
        repo = tmp_path_factory.mktemp(f"replica_{name}")
        add_model(repo, "minilm", source=REPOSITORY / "minilm")
        servers.append(start_server(ServerOptions.on_free_ports(repo, model_control="explicit",
                                                                load_models=("minilm",))))
    yield servers
    for server in servers:
        server.stop()


def test_a_killed_worker_node_loses_no_row_and_writes_none_twice(replicas, tmp_path):
    texts = sample_texts(ROWS, seed=5)
    source = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"id": pa.array(range(ROWS), pa.int64()), "text": texts}), source)
    output, parts = tmp_path / "vectors.parquet", tmp_path / "vectors.parquet.parts"
    cluster = RayCluster(tmp_path)
    job = None
    try:
        started = time.monotonic()
        cluster.start_head()
        cluster.start_worker("a", replicas[0].grpc_url)
        cluster.start_worker("b", replicas[1].grpc_url)
        cluster.wait_alive(2)
        cluster_s = time.monotonic() - started
        # The driver reads the model's config from its own "node" server (replica a); actors use theirs.
        command = [sys.executable, "-m", "coalesce_client.cli", "--url", "node", "--model", "minilm", "batch",
                   str(source), str(output), "--engine", "ray", "--ray-address", cluster.address,
                   "--ray-batch-rows", str(BATCH_ROWS), "--concurrency", "4", "--keep-parts", "--no-progress"]
        job_started = time.monotonic()
        job = subprocess.Popen(command, env={**os.environ, **RAY_ENV, "COALESCE_TRITON_URL": replicas[0].grpc_url},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 600
        while len(list(parts.glob("part-*.parquet"))) < ROWS // BATCH_ROWS // 10:
            assert job.poll() is None, f"the job ended before the kill: {job.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, "no part file came within 600 s"
            time.sleep(0.2)
        written_before_kill = len(list(parts.glob("part-*.parquet")))
        killed_at_s = time.monotonic() - job_started
        cluster.kill("b")
        stdout, stderr = job.communicate(timeout=1200)
        job_s = time.monotonic() - job_started
    finally:
        if job is not None and job.poll() is None:
            job.kill()
        cluster.stop()
    assert job is not None and job.returncode == 0, stderr[-4000:]
    report = json.loads(stdout)
    ids = pq.read_table(output, columns=["id"]).column("id").to_pylist()
    assert len(ids) == ROWS and set(ids) == set(range(ROWS)), "an id is missing from the output, or in it twice"
    in_parts = [i for part in sorted(parts.glob("part-*.parquet"))
                for i in pq.read_table(part, columns=["id"]).column("id").to_pylist()]
    assert len(in_parts) == ROWS, f"the part files hold {len(in_parts)} rows for {ROWS} ids: a batch written twice"
    assert "were in two part files" not in stderr
    assert report["output_rows"] == ROWS and report["rejected"] == 0
    if os.environ.get("BULK_RAY_REPORT"):
        path = Path(os.environ["BULK_RAY_REPORT"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join([
            f"# Ray bulk job with a worker node killed mid-job ({datetime.date.today():%Y-%m-%d})", "",
            "`make bulk-ray-test` (tests/integration/test_bulk_ray_cluster.py): a Ray head (0 CPUs) and two worker "
            "nodes (2 Ray CPUs each) started with `ray start` as separate processes on this machine, each beside its "
            "own tritonserver serving minilm as shipped; `coalesce-client batch --engine ray --url node` over "
            f"{ROWS} rows (`sample_texts`, 3-16 words) in batches of {BATCH_ROWS}, 4 actors; node b killed "
            "(SIGKILL to its `ray start`, raylet and agents) once a tenth of the part files were written.", "",
            "| what | value |", "| --- | --- |",
            f"| cluster start (head + 2 workers joined) | {cluster_s:.1f} s |",
            f"| part files written before the kill | {written_before_kill} of {ROWS // BATCH_ROWS} |",
            f"| kill at | {killed_at_s:.1f} s into the job |",
            f"| job wall time (driver start to output merged) | {job_s:.1f} s |",
            f"| rows/s over the whole job, kill included | {ROWS / job_s:.0f} |",
            f"| ids in the output | {len(ids)}, {len(set(ids))} distinct, all {ROWS} present |",
            f"| rows in the part files | {len(in_parts)} (none written twice) |",
            f"| result | passed on {sys.platform}, {os.cpu_count()} cores |", ""]))
