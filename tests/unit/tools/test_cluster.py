"""The cluster's pure parts: port layout, the haproxy configuration, its statistics, the prepared repository."""

import io
import re
import threading
from pathlib import Path

import pytest

from coalesce_tools.cli import main
from coalesce_tools.cluster import (
    GRPC_BACKEND,
    HEALTH_PATH,
    HTTP_BACKEND,
    BalancerOptions,
    ClusterError,
    ClusterOptions,
    ReplicaPorts,
    _Prefixed,
    haproxy_config,
    parse_stats_csv,
    prepare_repository,
    server_states,
)
from coalesce_tools.config import parameter, read_model_config
from tests.conftest import REPOSITORY

TWO = {"r0": ReplicaPorts.numbered(0, 8100), "r1": ReplicaPorts.numbered(1, 8100)}


def test_replica_ports_are_numbered_from_the_base_ten_apart():
    assert ReplicaPorts.numbered(0, 8100) == ReplicaPorts(http=8100, grpc=8101, metrics=8102, health=8103)
    assert ReplicaPorts.numbered(2, 8100) == ReplicaPorts(http=8120, grpc=8121, metrics=8122, health=8123)
    with pytest.raises(ClusterError, match=r"outside 1\.\.65535"):
        ReplicaPorts.numbered(1, 65530)
    free = ReplicaPorts.free()
    assert len({free.http, free.grpc, free.metrics, free.health}) == 4


def section(config: str, header: str) -> list[str]:
    """The lines of one section (``backend http_replicas``), without the header and blank lines."""
    lines = config.splitlines()
    start = lines.index(header) + 1
    out = []
    for line in lines[start:]:
        if not line.startswith("    "):
            break
        out.append(line.strip())
    return out


def test_haproxy_config_checks_each_replica_once_and_tracks_it_for_grpc():
    config = haproxy_config(TWO, BalancerOptions(http_port=9000, grpc_port=9001, stats_port=9404,
                                                 check_interval_ms=250, fall=3, rise=4))
    http = section(config, f"backend {HTTP_BACKEND}")
    assert "option httpchk" in http
    assert f"http-check send meth GET uri {HEALTH_PATH}" in http
    assert "default-server inter 250ms fall 3 rise 4" in http
    assert "server r0 127.0.0.1:8100 check port 8103" in http
    assert "server r1 127.0.0.1:8110 check port 8113" in http
    grpc = section(config, f"backend {GRPC_BACKEND}")
    # HTTP/2 cleartext to Triton's gRPC port; the state follows the HTTP server's check of the same replica.
    assert grpc[1:] == [f"server r0 127.0.0.1:8101 proto h2 track {HTTP_BACKEND}/r0",
                        f"server r1 127.0.0.1:8111 proto h2 track {HTTP_BACKEND}/r1"]
    assert "bind 127.0.0.1:9001 proto h2" in section(config, "frontend grpc_in")
    assert "bind 127.0.0.1:9000" in section(config, "frontend http_in")
    stats = section(config, "frontend stats")
    assert "bind 127.0.0.1:9404" in stats and "stats uri /stats" in stats
    defaults = section(config, "defaults")
    assert "option redispatch 1" in defaults and "retries 3" in defaults
    assert "retry-on conn-failure empty-response junk-response 503" in defaults
    assert "mode http" in defaults


def test_haproxy_config_binds_the_host_asked_for_and_needs_a_replica():
    config = haproxy_config({"r0": TWO["r0"]}, BalancerOptions(host="0.0.0.0"))
    assert "bind 0.0.0.0:8000" in config and "bind 0.0.0.0:8001 proto h2" in config
    assert "127.0.0.1:8100" in config  # replicas stay on loopback
    with pytest.raises(ClusterError, match="at least one replica"):
        haproxy_config({}, BalancerOptions())


@pytest.mark.parametrize(("kwargs", "fragment"), [
    ({"http_port": 0}, "http_port=0: outside 1..65535"),
    ({"grpc_port": 8000}, "ports must differ"),
    ({"fall": 0}, "fall=0: must be at least 1"),
    ({"retries": -1}, "retries=-1"),
])
def test_bad_balancer_options_are_named(kwargs, fragment):
    with pytest.raises(ClusterError, match=re.escape(fragment)):
        BalancerOptions(**kwargs)


def test_cluster_options_refuse_ports_among_the_replicas():
    with pytest.raises(ClusterError, match="fall among the replicas'"):
        ClusterOptions(model_repository=Path("r"), replicas=2, replica_port_base=8000)
    with pytest.raises(ClusterError, match="replicas=0"):
        ClusterOptions(model_repository=Path("r"), replicas=0)
    ClusterOptions(model_repository=Path("r"), replicas=2, replica_port_base=0)  # free ports: nothing to clash


STATS = """# pxname,svname,qcur,qmax,scur,smax,slim,stot,bin,bout,dreq,dresp,ereq,econ,eresp,wretr,wredis,status,\
hrsp_2xx,
http_in,FRONTEND,,,1,2,4096,10,0,0,0,0,0,,,,,OPEN,9,
http_replicas,r0,0,0,0,1,,5,0,0,,0,,0,0,0,0,UP,5,
http_replicas,r1,0,0,0,1,,5,0,0,,0,,0,0,1,1,DOWN,4,
http_replicas,BACKEND,0,0,0,1,410,10,0,0,0,0,,0,0,1,1,UP,9,
grpc_replicas,r0,0,0,0,1,,3,0,0,,0,,0,0,0,0,UP,3,
grpc_replicas,r1,0,0,0,1,,0,0,0,,0,,0,0,0,0,DOWN,0,
"""


def test_stats_csv_gives_each_servers_state():
    rows = parse_stats_csv(STATS)
    assert rows[1]["pxname"] == "http_replicas" and rows[1]["hrsp_2xx"] == "5"
    assert server_states(rows) == {"r0": "UP", "r1": "DOWN"}
    assert server_states(rows, GRPC_BACKEND) == {"r0": "UP", "r1": "DOWN"}


@pytest.fixture()
def source(tmp_path):
    """The example repository's configs and recipes, with stand-ins for the files `make setup` builds."""
    root = tmp_path / "source"
    for model in sorted(p.parent for p in REPOSITORY.glob("*/config.pbtxt")):
        (root / model.name / "1").mkdir(parents=True)
        for name in ("config.pbtxt", "recipe.json"):
            (root / model.name / name).write_bytes((model / name).read_bytes())
        (root / model.name / "1" / "model.onnx").write_bytes(b"graph")
        (root / model.name / "1" / "hf").mkdir()
    return root


def test_prepare_repository_points_row_models_at_redis_and_links_the_files(tmp_path, source):
    dest = tmp_path / "repo"
    shared = prepare_repository(source, dest, redis_url="redis://127.0.0.1:7000/0",
                                parameters={"precision": "fp32"})
    assert shared == ["digits", "minilm", "minilm_rerank", "minilm_tokens"]  # not smollm2: task generate
    original = read_model_config(REPOSITORY / "minilm" / "config.pbtxt")
    config = read_model_config(dest / "minilm" / "config.pbtxt")
    assert parameter(config, "redis_url") == "redis://127.0.0.1:7000/0"
    assert parameter(config, "precision") == "fp32"
    # Everything else as it was.
    for key in ("max_batch_size", "input", "output", "dynamic_batching", "instance_group"):
        assert config.get(key) == original.get(key), key
    assert {k: v for k, v in config["parameters"].items() if k not in ("redis_url", "precision")} == \
        {k: v for k, v in original["parameters"].items() if k != "precision"}
    assert parameter(read_model_config(dest / "smollm2" / "config.pbtxt"), "redis_url") == ""
    assert (dest / "smollm2" / "config.pbtxt").read_text() == (REPOSITORY / "smollm2" / "config.pbtxt").read_text()
    # Version folders are real folders of links (a file, a folder); other files are links.
    version = dest / "minilm" / "1"
    assert version.is_dir() and not version.is_symlink()
    for name in ("model.onnx", "hf"):
        linked = version / name
        assert linked.is_symlink() and linked.resolve() == (source / "minilm" / "1" / name).resolve()
    assert (version / "model.onnx").read_bytes() == b"graph"
    assert (dest / "minilm" / "recipe.json").is_symlink()


def test_prepare_repository_copies_only_the_models_asked_for(tmp_path, source):
    assert prepare_repository(source, tmp_path / "a", redis_url="redis://h:1/0", models=("minilm",)) == ["minilm"]
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["minilm"]
    with pytest.raises(ClusterError, match="has no model nope"):
        prepare_repository(source, tmp_path / "b", redis_url="redis://h:1/0", models=("minilm", "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ClusterError, match="holds no model"):
        prepare_repository(tmp_path / "empty", tmp_path / "c", redis_url="redis://h:1/0")


def test_prepare_repository_replaces_a_redis_url_the_source_sets(tmp_path):
    source = tmp_path / "src"
    (source / "m" / "1").mkdir(parents=True)
    (source / "m" / "1" / "model.onnx").write_bytes(b"graph")
    (source / "m" / "config.pbtxt").write_text(
        'name: "m"\nbackend: "coalesce"\nmax_batch_size: 8\nparameters [\n'
        '  { key: "task", value: { string_value: "tensor" } },\n'
        '  { key: "redis_url", value: { string_value: "redis://elsewhere:6379/0" } }\n]\n')
    assert prepare_repository(source, tmp_path / "dest", redis_url="redis://127.0.0.1:7000/0") == ["m"]
    config = read_model_config(tmp_path / "dest" / "m" / "config.pbtxt")
    assert parameter(config, "redis_url") == "redis://127.0.0.1:7000/0"
    assert parameter(config, "task") == "tensor" and config["max_batch_size"] == 8
    assert (tmp_path / "dest" / "m" / "1" / "model.onnx").read_bytes() == b"graph"


def test_prefixed_log_lines_name_their_replica():
    out = io.StringIO()
    stream = _Prefixed(out, "[r1] ", threading.Lock())
    stream.write("first line\nsecond ")
    stream.write("half\n")
    assert out.getvalue() == "[r1] first line\n[r1] second half\n"


@pytest.mark.parametrize(("argv", "fragment"), [
    (["cluster", "--http-port", "port"], "'port' is not a port number"),
    (["cluster", "--grpc-port", "70000"], "outside 0..65535"),
])
def test_cluster_cli_names_a_bad_port(argv, fragment, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert fragment in capsys.readouterr().err


def test_cluster_cli_refuses_options_that_cannot_work_before_starting_anything(capsys):
    assert main(["cluster", "--replicas", "0"]) == 2
    assert "replicas=0" in capsys.readouterr().err
    assert main(["cluster", "--http-port", "8100", "--replica-port-base", "8100"]) == 2
    assert "fall among the replicas'" in capsys.readouterr().err
