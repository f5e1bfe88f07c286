"""Locust against the real server: both protocols, headless, counts checked against Triton's statistics."""

import csv

import pytest

from coalesce_tools.launcher import free_port
from perf.load import run_locust


@pytest.mark.parametrize(("protocol", "shape"), [("grpc", "poisson"), ("http", "burst")])
def test_locust_run_counts_match_triton(server, tmp_path, protocol, shape):
    prefix = tmp_path / f"{shape}-{protocol}"
    summary = run_locust(shape=shape, protocol=protocol, rate_per_s=20, duration_s=3, pool=8, profile="queries",
                         grpc_url=server.grpc_url, http_url=server.http_url, prefix=prefix,
                         extra=["--burst-s", "1", "--period-s", "2"])
    assert summary["exit_code"] == 0, summary
    assert summary["locust_failures"] == 0
    # Every scheduled arrival was sent, and Triton saw exactly the requests Locust counted.
    assert summary["locust_requests"] == summary["offered_requests"] > 0
    assert summary["triton_inferences"] == summary["locust_requests"]
    assert summary["counts_match"] is True
    assert (tmp_path / f"{shape}-{protocol}.html").stat().st_size > 1000
    with (tmp_path / f"{shape}-{protocol}_stats.csv").open() as handle:
        rows = {row["Name"]: row for row in csv.DictReader(handle)}
    assert int(rows["Aggregated"]["Request Count"]) == summary["locust_requests"]
    assert sum(p["sent"] for p in summary["timeline"]) == summary["locust_requests"]


def test_failed_requests_fail_the_run(server, tmp_path):
    # HTTP to a port nobody listens on: every request fails; Triton (statistics over gRPC) saw none.
    summary = run_locust(shape="steady", protocol="http", rate_per_s=10, duration_s=1, pool=2, profile="queries",
                         grpc_url=server.grpc_url, http_url=f"127.0.0.1:{free_port()}", prefix=tmp_path / "down")
    assert summary["exit_code"] == 1
    assert summary["locust_failures"] == summary["locust_requests"] == summary["offered_requests"] > 0
    assert summary["triton_inferences"] == 0


def test_unknown_model_stops_the_run_saying_why(server, tmp_path):
    with pytest.raises(RuntimeError, match=r"cannot read Triton's statistics for model 'no_such_model'"):
        run_locust(shape="steady", protocol="grpc", rate_per_s=5, duration_s=1, pool=2, profile="queries",
                   grpc_url=server.grpc_url, http_url=server.http_url, prefix=tmp_path / "missing",
                   model="no_such_model")
