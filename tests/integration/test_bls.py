"""The bls runtime: Coalesce tokenises, coalesces and pools; another Triton model runs the encoder."""

import shutil
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from coalesce_client import EmbeddingClient
from tests.conftest import TRICKY_TEXTS
from tests.integration.conftest import EXACT_MODEL, FP32_NO_CACHE, add_model

FIXTURE = Path(__file__).parent / "fixtures" / "encoder"
RUNTIME_AUTO = r'\{ key: "runtime", value: \{ string_value: "auto" \} \}'


def bls_parameters(target):
    return (
        '{ key: "runtime", value: { string_value: "bls" } },\n'
        f'  {{ key: "bls_model", value: {{ string_value: "{target}" }} }}'
    )


@pytest.fixture(scope="module")
def bls_models(server, repository):
    target = repository / "encoder"
    (target / "1").mkdir(parents=True)
    shutil.copy(FIXTURE / "config.pbtxt", target / "config.pbtxt")
    shutil.copy(FIXTURE / "model.py", target / "1" / "model.py")
    (target / "1" / "model.onnx").symlink_to((repository / "minilm" / "1" / "model.onnx").resolve())
    # The encoder runs the FP32 graph (INT8 is an ONNX-Runtime-in-process precision), so the BLS variants
    # serve FP32, with no row cache: every row goes through the target and is compared exactly.
    for name, target_name in (("minilm_bls", "encoder"), ("minilm_bls_missing", "nowhere")):
        add_model(repository, name, replace={RUNTIME_AUTO: bls_parameters(target_name)}, parameters=FP32_NO_CACHE)
    client = httpclient.InferenceServerClient(server.http_url)
    client.load_model("encoder")  # the target first: Triton has no load order for BLS targets
    client.load_model("minilm_bls")
    yield client
    for name in ("minilm_bls", "encoder"):
        client.unload_model(name)
    client.close()


def test_bls_runtime_matches_the_in_process_runtime(server, bls_models):
    with (
        EmbeddingClient(server.grpc_url, model="minilm_bls") as bls,
        EmbeddingClient(server.grpc_url, model=EXACT_MODEL) as local,
    ):
        np.testing.assert_allclose(bls.embed(TRICKY_TEXTS), local.embed(TRICKY_TEXTS), atol=1e-5)


def test_a_missing_bls_target_fails_requests_naming_it(server, bls_models):
    from coalesce_client import ServerError

    bls_models.load_model("minilm_bls_missing")
    try:
        with (
            EmbeddingClient(server.grpc_url, model="minilm_bls_missing") as client,
            pytest.raises(ServerError, match=r"model 'nowhere' answered: .*not ready"),
        ):
            client.embed(["no target to run me"])
    finally:
        bls_models.unload_model("minilm_bls_missing")
