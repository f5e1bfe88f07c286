"""Nothing unverified from Redis, and its secrets kept: against real redis-servers (plain, TLS, with a password).

Bad values are written into a real Redis by a second client; bad replies come from a
real Redis too, through a small proxy that rewrites the tier's ``MGET`` into another
command before Redis sees it.
"""

import socket
import threading

import numpy as np
import pytest
import redis

from coalesce.cache.secrets import (
    CA_FILE_ENV,
    CACHE_KEY_ENV,
    CACHE_KEY_FILE_ENV,
    PASSWORD_ENV,
    PASSWORD_FILE_ENV,
    read_secrets,
)
from coalesce.cache.shared import MAC_BYTES, mac_key, sign
from coalesce.core.errors import ConfigError
from coalesce.loader import read_settings
from coalesce_tools.launcher import RedisServer
from tests.redis_tls import make_tls_files
from tests.unit.cache.test_shared import SECRET, embed, keys, layouts, make_tier, shared_tier
from tests.unit.fakes import DIM, EncoderRuntime, embedding_pipeline, metrics

PASSWORD = "pw-7f3a9c2e-never-in-a-log"


def unit_vectors(n, seed=0):
    rows = np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)
    return [(v / np.linalg.norm(v),) for v in rows]


def corrupt(factory):
    return factory.value("coalesce_shared_cache_errors_total", op="corrupt")


def write(url, prefix, pairs):
    """Store raw values under ``prefix + key``, as anyone who can write to that Redis could."""
    client = redis.Redis.from_url(url)
    client.mset({prefix.encode() + key: value for key, value in pairs})
    client.close()


def read(url, prefix, key):
    client = redis.Redis.from_url(url)
    try:
        return client.get(prefix.encode() + key)
    finally:
        client.close()


def signed(prefix, key, array, secret=SECRET):
    return sign(mac_key(secret), prefix.encode() + key, np.ascontiguousarray(array, dtype=np.float32).tobytes())


def test_values_are_signed_and_bound_to_their_key(redis_server):
    prefix = "mac-test:"
    tier, factory, _ = make_tier(redis_server.url, prefix=prefix)
    rows = unit_vectors(3)
    tier.put_many(keys(3), rows)
    assert tier.flush()
    first, second = read(redis_server.url, prefix, keys(3)[0]), read(redis_server.url, prefix, keys(3)[1])
    assert len(first) == DIM * 4 + MAC_BYTES and first[:-MAC_BYTES] == rows[0][0].tobytes()
    # Another text's vector copied under this key: a valid value, but not for this key.
    write(redis_server.url, prefix, [(keys(3)[0], second)])
    # The right bytes signed with another secret (a peer configured differently, or a forger without it).
    write(redis_server.url, prefix, [(keys(3)[2], signed(prefix, keys(3)[2], rows[2][0], secret=b"another"))])
    found = tier.get_many(keys(3), layouts(3), (True,))
    assert found[0] is None and found[2] is None
    assert found[1][0].tobytes() == rows[1][0].tobytes()
    assert corrupt(factory) == 2
    assert factory.value("coalesce_shared_cache_hits_total") == 1
    assert factory.value("coalesce_shared_cache_misses_total") == 2
    tier.close()


def test_signed_values_that_no_model_computes_are_refused(redis_server):
    prefix = "checks-test:"
    tier, factory, sink = make_tier(redis_server.url, prefix=prefix)
    good = unit_vectors(1)[0][0]
    nan, inf = good.copy(), good.copy()
    nan[3], inf[7] = np.nan, np.inf
    bad = [nan, inf, good * 2.0, np.zeros(DIM, dtype=np.float32)]
    write(redis_server.url, prefix, [(k, signed(prefix, k, v)) for k, v in zip(keys(4), bad, strict=True)])
    truncated = signed(prefix, keys(5)[4], good)[:-1]
    write(redis_server.url, prefix, [(keys(5)[4], truncated), (keys(6)[5], b"")])
    # Where the task normalises: all six refused.
    assert tier.get_many(keys(6), layouts(6), (True,)) == [None] * 6
    assert corrupt(factory) == 6
    assert "refused 6 value(s)" in sink.lines[-1][1] and "2 norm" in sink.lines[-1][1]
    # Where it does not, a finite vector of any norm is a valid answer; non-finite ones never are.
    found = tier.get_many(keys(4), layouts(4))
    assert found[0] is None and found[1] is None
    assert found[2][0].tobytes() == (good * 2.0).tobytes() and not found[3][0].any()
    assert corrupt(factory) == 8
    tier.close()


class MgetRewritingProxy:
    """A TCP proxy to a real Redis that hands the client's ``MGET`` to Redis as another command.

    Every other command, and every reply, passes unchanged; so the tier talks to a real
    Redis and gets a real Redis reply, only not the one ``MGET`` would have given.
    """

    def __init__(self, upstream_port, rewrite):
        self.upstream_port = upstream_port
        self.rewrite = rewrite
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self):
        return f"redis://127.0.0.1:{self.port}/0"

    def close(self):
        self.listener.close()
        for sock in self.sockets:
            sock.close()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            self.sockets += [client, upstream]
            threading.Thread(target=self._replies, args=(upstream, client), daemon=True).start()
            threading.Thread(target=self._commands, args=(client, upstream), daemon=True).start()

    @staticmethod
    def _replies(upstream, client):
        try:
            while data := upstream.recv(65536):
                client.sendall(data)
        except OSError:
            pass

    def _commands(self, client, upstream):
        reader = client.makefile("rb")
        try:
            while line := reader.readline():
                assert line.startswith(b"*"), line  # redis-py sends every command as an array of bulk strings
                words = []
                for _ in range(int(line[1:])):
                    size = int(reader.readline()[1:])
                    words.append(reader.read(size + 2)[:-2])
                if words[0].upper() == b"MGET":
                    words = self.rewrite(words[1:])
                upstream.sendall(b"*%d\r\n" % len(words) + b"".join(b"$%d\r\n%s\r\n" % (len(w), w) for w in words))
        except (OSError, ValueError):
            pass


@pytest.mark.parametrize(("name", "rewrite"), [
    ("one value short", lambda ks: [b"MGET", *ks[:-1]]),
    ("one value too many", lambda ks: [b"MGET", *ks, ks[0]]),
    ("integers instead of values", lambda ks: [b"EVAL", b"local t = {} for i = 1, #KEYS do t[i] = i end return t",
                                               str(len(ks)).encode(), *ks]),
    ("not a list", lambda ks: [b"PING"]),
])
def test_a_reply_that_is_not_mget_s_answer_is_a_miss_not_a_failed_batch(redis_server, name, rewrite):
    prefix = "reply-test:"
    writer, _, _ = make_tier(redis_server.url, prefix=prefix)
    writer.put_many(keys(3), unit_vectors(3))
    assert writer.flush()
    writer.close()
    proxy = MgetRewritingProxy(redis_server.port, rewrite)
    try:
        tier, factory, _ = make_tier(proxy.url, prefix=prefix)
        assert tier.get_many(keys(3), layouts(3), (True,)) == [None] * 3, name
        assert corrupt(factory) == 3
        assert factory.value("coalesce_shared_cache_misses_total") == 3
        assert factory.value("coalesce_shared_cache_up") == 1  # Redis answered: no reason to stand aside
        tier.close()
    finally:
        proxy.close()


def test_integers_from_redis_are_refused_value_by_value(redis_server):
    """A list of the right length whose items are not values (EVAL's integers): each one refused by type."""
    proxy = MgetRewritingProxy(redis_server.port, lambda ks: [
        b"EVAL", b"local t = {} for i = 1, #KEYS do t[i] = i end return t", str(len(ks)).encode(), *ks])
    try:
        tier, factory, sink = make_tier(proxy.url, prefix="types:")
        assert tier.get_many(keys(2), layouts(2)) == [None, None]
        assert corrupt(factory) == 2 and "2 type" in sink.lines[-1][1]
        tier.close()
    finally:
        proxy.close()


def test_users_get_the_computed_rows_and_the_bad_values_are_overwritten(redis_server):
    prefix = "overwrite-test:"
    sentences = [["alpha beta"], ["gamma delta"], ["epsilon"], ["zeta eta theta"]]

    def pipeline_on(url):
        recorded = metrics()
        return embedding_pipeline(EncoderRuntime(), shared=shared_tier(url, prefix, recorded),
                                  pipeline_metrics=recorded)

    without_redis, _ = embedding_pipeline(EncoderRuntime())
    computed = [embed(without_redis, s)[0]["EMBEDDING"].tobytes() for s in sentences]
    first, _ = pipeline_on(redis_server.url)
    for s in sentences:
        embed(first, s)
    assert first.shared.flush()
    client = redis.Redis.from_url(redis_server.url)
    stored = sorted(client.keys(prefix + "*"))
    assert len(stored) == 4
    good = {k: client.get(k) for k in stored}
    vector = np.frombuffer(good[stored[0]][:-MAC_BYTES], dtype=np.float32)
    nan = vector.copy()
    nan[0] = np.nan
    secret = mac_key(SECRET)
    client.mset({stored[0]: good[stored[1]],  # another text's vector
                 stored[1]: sign(secret, stored[1], nan.tobytes()),  # signed, but NaN
                 stored[2]: good[stored[2]][: DIM * 2],  # truncated
                 stored[3]: sign(secret, stored[3], (vector * 3).tobytes())})  # signed, but not unit norm
    second, factory = pipeline_on(redis_server.url)
    warm = [embed(second, s)[0]["EMBEDDING"].tobytes() for s in sentences]
    assert warm == computed
    assert corrupt(factory) == 4 and factory.value("coalesce_shared_cache_hits_total") == 0
    assert second.shared.flush()
    assert {k: client.get(k) for k in stored} == good  # each bad value overwritten by the fresh one
    third, factory = pipeline_on(redis_server.url)
    assert [embed(third, s)[0]["EMBEDDING"].tobytes() for s in sentences] == computed
    assert factory.value("coalesce_shared_cache_hits_total") == 4 and corrupt(factory) == 0
    client.close()
    for pipeline in (first, second, third):
        pipeline.close()


# -- secrets ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    return make_tls_files(tmp_path_factory.mktemp("tls"))


def test_rediss_with_a_password_round_trips_and_a_wrong_password_only_costs_the_tier(tls_files):
    with RedisServer(password=PASSWORD, tls=tls_files) as server:
        assert server.url.startswith("rediss://127.0.0.1:")
        tier, factory, sink = make_tier(server.url, prefix="tls:", password=PASSWORD, ca_file=str(tls_files.ca_file))
        rows = unit_vectors(2)
        tier.put_many(keys(2), rows)
        assert tier.flush()
        found = tier.get_many(keys(2), layouts(2), (True,))
        assert [f[0].tobytes() for f in found] == [r[0].tobytes() for r in rows]
        assert factory.value("coalesce_shared_cache_errors_total") == 0
        tier.close()
        for password, ca_file in (("wrong-password", str(tls_files.ca_file)), (PASSWORD, None)):
            # A wrong password, or no CA that vouches for the server: the tier stands aside, nothing fails.
            tier, factory, sink = make_tier(server.url, prefix="tls:", password=password, ca_file=ca_file)
            assert factory.value("coalesce_shared_cache_errors_total", op="connect") == 1
            assert tier.get_many(keys(2), layouts(2)) == [None, None]
            assert all(PASSWORD not in line for _, line in sink.lines)
            tier.close()


def test_secrets_come_from_the_environment_or_the_files_it_names(tmp_path):
    fingerprint = bytes(32)
    none = read_secrets(fingerprint, {})
    assert none.password is None and none.ca_file is None and none.mac_secret == fingerprint
    assert "output fingerprint" in none.mac_source
    key_file, password_file = tmp_path / "key", tmp_path / "password"
    key_file.write_text("from-a-file\n")
    password_file.write_text(PASSWORD + "\n")
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    found = read_secrets(fingerprint, {PASSWORD_ENV: "ignored", PASSWORD_FILE_ENV: str(password_file),
                                       CACHE_KEY_ENV: "ignored", CACHE_KEY_FILE_ENV: str(key_file),
                                       CA_FILE_ENV: str(ca)})
    assert found.password == PASSWORD and found.mac_secret == b"from-a-file" and found.ca_file == str(ca)
    assert PASSWORD not in repr(found) and "from-a-file" not in repr(found)
    direct = read_secrets(fingerprint, {PASSWORD_ENV: PASSWORD, CACHE_KEY_ENV: "direct"})
    assert direct.password == PASSWORD and direct.mac_secret == b"direct" and direct.mac_source == CACHE_KEY_ENV
    (tmp_path / "empty").write_text("\n")
    for environ, says in (({PASSWORD_FILE_ENV: str(tmp_path / "absent")}, "cannot be read"),
                          ({CACHE_KEY_FILE_ENV: str(tmp_path / "empty")}, "is empty"),
                          ({CA_FILE_ENV: str(tmp_path / "absent.pem")}, "not a readable file")):
        with pytest.raises(ConfigError, match=says):
            read_secrets(fingerprint, environ)


def config_with_url(url):
    return {"name": "m", "max_batch_size": 8, "parameters": {"redis_url": {"string_value": url}}}


@pytest.mark.parametrize("url", [f"redis://default:{PASSWORD}@127.0.0.1:6379/0", f"rediss://:{PASSWORD}@cache:6380/0",
                                 f"unix:///run/redis.sock?db=0&password={PASSWORD}"])
def test_a_password_in_redis_url_is_refused_at_load_and_never_echoed(url):
    with pytest.raises(ConfigError) as raised:
        read_settings(config_with_url(url))
    message = str(raised.value)
    assert "carries a password" in message and "COALESCE_REDIS_PASSWORD" in message
    assert PASSWORD not in message and "***" in message


def test_a_bad_scheme_is_reported_without_the_password():
    with pytest.raises(ConfigError) as raised:
        read_settings(config_with_url(f"http://user:{PASSWORD}@cache:6379/0"))
    assert "expected a URL starting with" in str(raised.value) and PASSWORD not in str(raised.value)


def test_a_url_with_only_a_user_name_is_fine():
    assert read_settings(config_with_url("redis://reader@cache:6379/0")).cache.redis_url.endswith("cache:6379/0")


def test_unit_norm_is_what_the_task_says():
    normalised, _ = embedding_pipeline(EncoderRuntime())
    raw, _ = embedding_pipeline(EncoderRuntime(), normalize="false")
    assert normalised.task.unit_norm_outputs() == {"EMBEDDING"}
    assert raw.task.unit_norm_outputs() == frozenset()


def test_serve_starts_local_redis_with_the_password_the_models_send(tmp_path, monkeypatch):
    from coalesce_tools.launcher import free_port, start_local_redis

    port = free_port()
    model = tmp_path / "shared"
    model.mkdir()
    model.joinpath("config.pbtxt").write_text(
        f'parameters [ {{ key: "redis_url", value: {{ string_value: "redis://127.0.0.1:{port}/0" }} }} ]')
    password_file = tmp_path / "password"
    password_file.write_text(PASSWORD + "\n")
    monkeypatch.setenv(PASSWORD_FILE_ENV, str(password_file))
    started = start_local_redis(tmp_path)
    try:
        assert [s.port for s in started] == [port]
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).get("x")
        assert redis.Redis(port=port, password=PASSWORD).ping()
        assert not list(tmp_path.glob("*.conf"))
    finally:
        for server in started:
            server.stop()
