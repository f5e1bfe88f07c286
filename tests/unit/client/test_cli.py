"""``coalesce-client`` without a server: its usage errors, and what it says and returns when nobody answers."""

import json

import pytest

from coalesce_client.cli import main
from coalesce_client.load import LoadReport, sample_texts
from coalesce_tools.launcher import free_port


@pytest.fixture()
def nobody():
    """``host:port`` where nothing listens."""
    return f"127.0.0.1:{free_port()}"


@pytest.mark.parametrize(("argv", "fragment"), [
    (["load", "--requests", "many"], "argument --requests: invalid int value: 'many'"),
    (["load", "--concurrency"], "argument --concurrency: expected one argument"),
    (["--protocol", "tcp", "health"], "argument --protocol: invalid choice: 'tcp'"),
    ([], "the following arguments are required: command"),
    (["--max-attempts", "0", "health"], "max_attempts must be at least 1, got 0"),
    (["--timeout-s", "0", "health"], "timeout_s must be > 0, got 0.0"),
    (["--ca-cert", "/nonexistent/ca.pem", "health"], "TLS ca_cert '/nonexistent/ca.pem' is not a file"),
    (["--client-cert", "/nonexistent/c.pem", "health"], "client_cert and client_key go together"),
    (["--header", "authorization", "health"], "--header takes NAME=VALUE, got 'authorization'"),
    (["--header-env", "authorization=COALESCE_TEST_UNSET", "health"],
     "--header-env authorization: environment variable COALESCE_TEST_UNSET is not set"),
])
def test_bad_usage_exits_2_saying_what_is_wrong(capsys, argv, fragment):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert fragment in capsys.readouterr().err


def test_load_without_a_server_fails_with_exit_1_and_a_typed_error(capsys, nobody):
    assert main(["--url", nobody, "--timeout-s", "5", "load", "--requests", "4", "--concurrency", "2"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("coalesce-client: ServerUnavailableError: model 'minilm' at ")
    assert nobody in captured.err


def test_load_reads_statistics_from_stats_url(capsys, nobody):
    other = f"127.0.0.1:{free_port()}"
    assert main(["--url", nobody, "load", "--requests", "1", "--stats-url", other]) == 1
    assert f"at {other}" in capsys.readouterr().err


def test_health_without_a_server_prints_not_ready_and_exits_1(capsys, nobody):
    assert main(["--url", nobody, "--protocol", "http", "--timeout-s", "5", "health"]) == 1
    assert json.loads(capsys.readouterr().out) == {"url": nobody, "model": "minilm", "ready": False}


def test_embed_needs_texts(capsys, nobody):
    with pytest.raises(SystemExit) as info:
        main(["--url", nobody, "embed"])
    assert info.value.code == 2
    assert "give texts to embed, or --stdin" in capsys.readouterr().err


def test_embed_without_a_server_exits_1(capsys, nobody):
    assert main(["--url", nobody, "--timeout-s", "5", "embed", "hello"]) == 1
    assert capsys.readouterr().err.startswith("coalesce-client: ")


def test_load_texts_are_seeded_and_distinct():
    assert sample_texts(50, seed=1) == sample_texts(50, seed=1) != sample_texts(50, seed=2)
    assert len(set(sample_texts(500))) == 500


def test_a_load_report_derives_its_figures():
    report = LoadReport(requests=200, texts_per_request=2, concurrency=8, protocol="grpc", wall_s=4.0,
                        inference_count=400, execution_count=50)
    assert report.as_dict() == {"requests": 200, "texts_per_request": 2, "concurrency": 8, "protocol": "grpc",
                                "wall_s": 4.0, "inference_count": 400, "execution_count": 50,
                                "requests_per_s": 50.0, "avg_batch_size": 8.0}
    assert LoadReport(1, 1, 1, "http", 1.0, 0, 0).avg_batch_size == 0.0


def test_load_over_http_reads_statistics_from_the_same_hosts_grpc_port():
    from coalesce_client.cli import grpc_beside

    assert grpc_beside("triton.internal:8000") == "triton.internal:8001"
    assert grpc_beside("http://10.0.0.7:9000") == "10.0.0.7:8001"
