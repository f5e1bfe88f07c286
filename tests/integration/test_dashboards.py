"""The Grafana dashboard and the Prometheus scrape config (``scripts/deploy/``) against a real server's metrics."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import promql_parser
import pytest
import tritonclient.grpc as grpcclient
import yaml
from tritonclient.utils import InferenceServerException

from coalesce_tools.launcher import ServerOptions
from tests.integration.test_adaptive import adaptive_config, text_input

DEPLOY = Path(__file__).resolve().parents[2] / "scripts" / "deploy"
DASHBOARD = DEPLOY / "grafana" / "coalesce-dashboard.json"
SCRAPE_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
#: What the issue asks the dashboard to show, each found in some panel's title.
TOPICS = ("Throughput", "p50 / p99", "Queue time", "Batch fill", "Padding waste", "Cache hit rate",
          "Refusals per tenant")


def dashboard_metrics(dashboard: dict) -> dict[str, set[str]]:
    """Every metric name (Triton's ``nv_*``, the backend's ``coalesce_*``) each panel's queries name, by panel title."""
    return {panel["title"]: {name for target in panel["targets"]
                             for name in re.findall(r"\b((?:nv|coalesce)_[a-z0-9_]+)\b", target["expr"])}
            for panel in dashboard["panels"]}


def exported_samples(metrics_url: str) -> set[str]:
    """The sample names a server's metrics page has now (histograms as ``_bucket``/``_sum``/``_count``)."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", text, flags=re.M))


def test_the_dashboard_shows_each_topic_per_model():
    dashboard = json.loads(DASHBOARD.read_text())
    titles = [panel["title"] for panel in dashboard["panels"]]
    for topic in TOPICS:
        assert any(topic in title for title in titles), (topic, titles)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["model"]["multi"] and variables["datasource"]["query"] == "prometheus"
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert 'model=~"$model"' in target["expr"], (panel["title"], target["expr"])
            assert "{{model}}" in target["legendFormat"], (panel["title"], target["legendFormat"])


def test_every_query_is_valid_promql():
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel["targets"]:
            # Grafana's variables, as Grafana substitutes them before Prometheus sees the query.
            query = target["expr"].replace("$__rate_interval", "1m").replace("$model", ".*")
            promql_parser.parse(query)  # raises ValueError naming what is wrong
    with pytest.raises(ValueError, match="unclosed left parenthesis"):
        promql_parser.parse("sum(rate(coalesce_rows_total[1m])")


def test_the_scrape_config_reads_the_servers_metrics_port():
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    job = next(job for job in config["scrape_configs"] if job["job_name"] == "coalesce")
    assert job["metrics_path"] == "/metrics"
    targets = [t for group in job["static_configs"] for t in group["targets"]]
    assert targets == [f"localhost:{ServerOptions(model_repository=Path('.')).metrics_port}"]


def exercise_adaptive_model(server, scratch_model, http_client, name: str) -> None:
    """Load an adaptive model with a rate-limited tenant and have that tenant refused; call minilm once.

    The backend's queue and per-tenant refusal metrics exist only once used.
    """
    scratch_model(name, replace=adaptive_config(target_p99_ms="60000", tenant_max_rows_per_s="slow:1",
                                                max_dispatch_rows="1"))
    http_client.load_model(name)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    refused = 0
    for i in range(6):
        try:
            client.infer(name, [text_input([f"slow tenant text {i}"])], parameters={"tenant": "slow"})
        except InferenceServerException as exc:
            assert "over its rate limit" in exc.message(), exc.message()
            refused += 1
    assert refused, "the slow tenant was never refused"
    client.infer("minilm", [text_input(["a text for the shipped model"])])


def missing_samples(metrics_url: str, wanted: set[str], timeout_s: float = 30.0) -> set[str]:
    """The names of ``wanted`` not on the metrics page within ``timeout_s`` (the backend sends every 100 ms)."""
    deadline = time.monotonic() + timeout_s
    while True:
        missing = wanted - exported_samples(metrics_url)
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(0.2)


def test_every_dashboard_query_names_a_metric_the_server_exports(server, scratch_model, http_client):
    exercise_adaptive_model(server, scratch_model, http_client, "dash_adaptive")
    wanted = set().union(*dashboard_metrics(json.loads(DASHBOARD.read_text())).values())
    missing = missing_samples(server.metrics_url, wanted)
    assert not missing, f"the dashboard names metrics the server does not export: {sorted(missing)}"
    assert {"nv_inference_request_summary_us", "coalesce_tenant_rejections_total",
            "coalesce_queue_wait_seconds_bucket"} <= wanted
