"""The shared tier's integrity and secrets inside a real server, on a real TLS redis-server that wants a password.

A server of its own, started with the secrets in its environment (the stub inherits
it): ``COALESCE_REDIS_PASSWORD_FILE``, ``COALESCE_REDIS_CA_FILE`` and ``COALESCE_CACHE_KEY``.
Its models reach Redis only over ``rediss://``; a model beside them computes without Redis.
"""

import re
import urllib.error
import urllib.request

import numpy as np
import pytest
import redis

from coalesce.cache.secrets import CA_FILE_ENV, CACHE_KEY_ENV, PASSWORD_FILE_ENV
from coalesce.cache.shared import MAC_BYTES, mac_key, sign
from coalesce_tools.launcher import RedisServer, ServerOptions
from tests.conftest import built
from tests.integration.conftest import FIXED_COST, add_model, infer, start_server
from tests.integration.test_cache import settled_metric, wait_for
from tests.redis_tls import make_tls_files

PASSWORD = "redis-pw-3b8e1d0c-never-logged"
CACHE_KEY = "cache-key-91c4f7aa-never-logged"
SECURE, PLAIN = "secure", "plain"
PREFIX = "secure:"
DIM = 384


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    tls = make_tls_files(tmp_path_factory.mktemp("tls"))
    server = RedisServer(password=PASSWORD, tls=tls).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def secure_server(tmp_path_factory, tls_redis):
    built("minilm")
    repo = tmp_path_factory.mktemp("secure_repository")
    parameters = {"cache_bytes": "0", "cost_model": FIXED_COST}
    add_model(repo, SECURE, parameters={**parameters, "redis_url": tls_redis.url, "redis_key_prefix": PREFIX,
                                        "redis_timeout_ms": "1000", "redis_retry_s": "0.2"})
    add_model(repo, PLAIN, parameters=parameters)
    password_file = tmp_path_factory.mktemp("secrets") / "redis-password"
    password_file.write_text(PASSWORD + "\n")
    options = ServerOptions.on_free_ports(repo, model_control="explicit", load_models=(SECURE, PLAIN), log_verbose=1)
    with pytest.MonkeyPatch.context() as env:
        env.setenv(PASSWORD_FILE_ENV, str(password_file))
        env.setenv(CA_FILE_ENV, str(tls_redis.tls.ca_file))
        env.setenv(CACHE_KEY_ENV, CACHE_KEY)
        triton = start_server(options)
    yield triton
    code = triton.stop()
    assert code in (0, -2), f"tritonserver stopped with code {code}:\n{triton.log_tail()}"


def redis_client(server):
    return redis.Redis.from_url(server.url, password=PASSWORD, ssl_ca_certs=str(server.tls.ca_file))


def embed(server, model, text):
    return infer(server, "grpc", model, [("TEXT", np.array([[text.encode()]], dtype=object), "BYTES")],
                 ["EMBEDDING"])["EMBEDDING"][0]


def counter(server, name, model, **labels):
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    total = 0.0
    for found, value in re.findall(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M):
        wanted = {"model": model, **labels}
        if all(f'{key}="{val}"' in found for key, val in wanted.items()):
            total += float(value)
    return total


def reload(server, model):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(server.http_url)
    try:
        client.load_model(model)  # a new stub process: nothing in memory, only Redis can answer
    finally:
        client.close()


def test_rediss_with_a_password_serves_rows_from_redis_and_no_secret_is_shown(secure_server, tls_redis):
    texts = ["secret tier one", "secret tier two", "secret tier three"]
    computed = [embed(secure_server, SECURE, t) for t in texts]
    client = redis_client(tls_redis)
    assert wait_for(lambda: len(client.keys(PREFIX + "*")) >= 3), "rows never reached Redis over TLS"
    reload(secure_server, SECURE)
    warm = [embed(secure_server, SECURE, t) for t in texts]
    assert [w.tobytes() for w in warm] == [c.tobytes() for c in computed]
    assert [embed(secure_server, PLAIN, t).tobytes() for t in texts] == [c.tobytes() for c in computed]
    settled_metric(secure_server, "coalesce_shared_cache_hits_total", SECURE, lambda v: v >= 3)
    assert counter(secure_server, "coalesce_shared_cache_errors_total", SECURE) == 0
    client.close()
    with urllib.request.urlopen(f"http://{secure_server.http_url}/v2/models/{SECURE}/config", timeout=10) as answer:
        config = answer.read().decode()
    assert tls_redis.url in config
    log = secure_server.log_text()
    assert "values signed with a key from COALESCE_CACHE_KEY; password set" in log
    for secret in (PASSWORD, CACHE_KEY):
        assert secret not in config and secret not in log


def test_a_password_in_redis_url_is_refused_at_load_and_never_echoed(server, repository, tls_redis):
    """On the suite's server (Triton's log not verbose: at --log-verbose 1 Triton itself prints config.pbtxt)."""
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    url = tls_redis.url.replace("rediss://", f"rediss://default:{PASSWORD}@")
    add_model(repository, "leaky", parameters={"redis_url": url, "cost_model": FIXED_COST})
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        with pytest.raises(InferenceServerException) as refused:
            client.load_model("leaky")
        assert not client.is_model_ready("leaky")
    finally:
        client.close()
    assert "carries a password" in str(refused.value) and "COALESCE_REDIS_PASSWORD" in str(refused.value)
    assert "rediss://default:***@127.0.0.1" in str(refused.value) and PASSWORD not in str(refused.value)
    assert "carries a password" in server.log_text() and PASSWORD not in server.log_text()


def test_bad_values_in_redis_are_refused_counted_and_overwritten(secure_server, tls_redis):
    client = redis_client(tls_redis)
    texts = ["integrity one", "integrity two", "integrity three", "integrity four"]
    computed, stored = [], []
    for text in texts:  # one at a time, to learn which key holds which text's row
        before = set(client.keys(PREFIX + "*"))
        computed.append(embed(secure_server, SECURE, text).tobytes())
        assert wait_for(lambda before=before: len(set(client.keys(PREFIX + "*")) - before) == 1)
        (key,) = set(client.keys(PREFIX + "*")) - before
        stored.append(key)
    good = [client.get(key) for key in stored]
    vector = np.frombuffer(good[0][:-MAC_BYTES], dtype=np.float32)
    nan = vector.copy()
    nan[5] = np.nan
    secret = mac_key(CACHE_KEY.encode())
    client.mset({stored[0]: good[1],  # another text's vector, copied
                 stored[1]: sign(secret, stored[1], nan.tobytes()),  # validly signed, but NaN
                 stored[2]: good[2][:-7],  # truncated
                 stored[3]: sign(secret, stored[3], (vector * 2).tobytes())})  # validly signed, norm 2
    reload(secure_server, SECURE)
    answered = [embed(secure_server, SECURE, t).tobytes() for t in texts]
    assert answered == computed
    assert [embed(secure_server, PLAIN, t).tobytes() for t in texts] == computed  # as without Redis
    assert wait_for(lambda: counter(secure_server, "coalesce_shared_cache_errors_total", SECURE, op="corrupt") == 4)
    assert wait_for(lambda: [client.get(key) for key in stored] == good), "the bad values were not overwritten"
    assert "value(s) that failed verification" in secure_server.log_text()  # once per 30 s, with a count
    reload(secure_server, SECURE)
    assert [embed(secure_server, SECURE, t).tobytes() for t in texts] == computed
    settled_metric(secure_server, "coalesce_shared_cache_hits_total", SECURE, lambda v: v >= 4)
    client.close()
