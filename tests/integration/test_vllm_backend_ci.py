"""Triton's vLLM backend's own client tests, run unchanged against the shipped ``smollm2``.

The files in ``tests/fixtures/vllm_backend/`` are upstream's as they are
(triton-inference-server/vllm_backend at 8de0c14: ``ci/L0_additional_outputs_vllm``,
``ci/L0_backend_vllm/{vllm_backend,enabled_stream,request_cancellation}``,
``ci/common/test_util.py``, ``samples/client.py``). Each test copies them and substitutes
only what names upstream's deployment: the model (``vllm_opt`` -> ``smollm2``), the gRPC
address, the texts that pin OPT-125m's greedy output (replaced by transformers' own greedy
output of smollm2, computed here), one prompt OPT continues past 16 tokens where smollm2 stops,
and the vLLM backend's two log lines on cancelling (replaced by ours), then runs them in a
subprocess as upstream's CI does (pytest for ``additional_outputs_test``, unittest for the rest).

Not run: ``test_vllm_triton_backend`` (it loads upstream's ``add_sub`` Python model and an
ensemble built on it, which are not a generation backend's); the full 1,458-case matrix of
``test_additional_outputs`` runs under ``-m slow``, a covering subset here (every value of
every parameter at least once).
"""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import built

pytest.importorskip("torch")

UPSTREAM = Path(__file__).resolve().parent.parent / "fixtures" / "vllm_backend"
MODEL = "smollm2"


@pytest.fixture(scope="module")
def greedy():
    """``greedy(prompt, max_tokens)``: the token ids transformers' greedy ``generate`` adds to ``prompt``, alone."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    hf = built(MODEL) / "hf"
    model = AutoModelForCausalLM.from_pretrained(str(hf)).eval()
    tokenizer = Tokenizer.from_file(str(hf / "tokenizer.json"))

    def generate(prompt: str, max_tokens: int = 16) -> tuple[list[int], Tokenizer]:
        ids = tokenizer.encode(prompt).ids
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=max_tokens, do_sample=False)
        return out[0, len(ids):].tolist(), tokenizer

    return generate


def vendored(tmp_path: Path, server, **replacements: dict[str, str]) -> Path:
    """Upstream's files in ``tmp_path``, with the model and address substituted, and ``replacements`` per file."""
    for source in UPSTREAM.iterdir():
        if source.suffix not in (".py", ".txt") or source.name == "conftest.py":
            continue
        text = source.read_text()
        text = text.replace('"vllm_opt"', f'"{MODEL}"').replace("localhost:8001", server.grpc_url)
        for old, new in replacements.get(source.stem, {}).items():
            assert old in text, f"{source.name} no longer holds {old!r}: upstream changed, update this test"
            text = text.replace(old, new)
        (tmp_path / source.name).write_text(text)
    return tmp_path


def run_pytest(folder: Path, *selection: str, timeout_s: float = 600) -> str:
    """Run upstream's tests in ``folder`` (its own folder first on the import path, as upstream's CI runs them)."""
    env = {**os.environ, "PYTHONPATH": str(folder)}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                             "--rootdir", str(folder), *selection], cwd=folder, env=env, capture_output=True,
                            text=True, timeout=timeout_s)
    assert result.returncode == 0, f"upstream's tests failed:\n{result.stdout[-6000:]}\n{result.stderr[-2000:]}"
    return result.stdout


def run_unittest(folder: Path, *names: str, timeout_s: float = 600) -> str:
    """Run upstream's unittest files as its CI does (``python3 <file>.py``), here by test names; their report."""
    env = {**os.environ, "PYTHONPATH": str(folder)}
    result = subprocess.run([sys.executable, "-m", "unittest", "-v", *names], cwd=folder, env=env,
                            capture_output=True, text=True, timeout=timeout_s)
    report = result.stdout[-3000:] + result.stderr[-6000:]
    assert result.returncode == 0, f"upstream's tests failed:\n{report}"
    return report


def covering_cases(ids: list[str]) -> list[str]:
    """Fewest of ``ids`` (``name[v1-v2-...]``) such that every value of every position appears, greedily."""
    parsed = {i: tuple(re.search(r"\[(.*)\]", i).group(1).split("-")) for i in ids}  # type: ignore[union-attr]
    wanted = {(pos, value) for values in parsed.values() for pos, value in enumerate(values)}
    chosen: list[str] = []
    while wanted:
        best = max(ids, key=lambda i: len(wanted & set(enumerate(parsed[i]))))
        chosen.append(best)
        wanted -= set(enumerate(parsed[best]))
    return chosen


#: Upstream's prompt pins OPT-125m's behaviour too: it expects 16 greedy tokens ("length"), while
#: smollm2 ends "In this example," with its end-of-text token after 13 ("stop"). Three more
#: characters give smollm2 a prompt it continues past 16 tokens, as OPT does upstream's.
ADDITIONAL_OUTPUTS_PROMPT = {'_prompt = "In this example,"': '_prompt = "In this example, we"'}


def test_additional_outputs_covering_subset(server, tmp_path, greedy):
    tokens, tokenizer = greedy("In this example, we")
    assert len(tokens) == 16, tokenizer.decode(tokens)  # transformers stops early at the end-of-text token
    folder = vendored(tmp_path, server, additional_outputs_test=ADDITIONAL_OUTPUTS_PROMPT)
    listing = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                              "-o", "addopts=", "--rootdir", str(folder), "additional_outputs_test.py"],
                             cwd=folder, capture_output=True, text=True, timeout=120)
    ids = [line.strip() for line in listing.stdout.splitlines() if "::test_additional_outputs[" in line]
    assert len(ids) == 2 * 3 ** 6, listing.stdout[-2000:]
    cases = covering_cases(ids)
    assert len(cases) <= 4
    output = run_pytest(folder, *cases)
    assert f"{len(cases)} passed" in output, output


@pytest.mark.slow
@pytest.mark.timeout(5400)
def test_additional_outputs_every_case(server, tmp_path):
    folder = vendored(tmp_path, server, additional_outputs_test=ADDITIONAL_OUTPUTS_PROMPT)
    started = time.monotonic()
    output = run_pytest(folder, "additional_outputs_test.py", timeout_s=5400)
    assert "1458 passed" in output, output
    report = os.environ.get("VLLM_CI_REPORT")
    if report:  # `make vllm-ci-full` records the last result
        summary = output.strip().splitlines()[-1]
        Path(report).write_text(
            f"# vLLM backend's L0_additional_outputs_vllm, every case ({datetime.date.today():%Y%m%d})\n\n"
            f"- command: `make vllm-ci-full` (`pytest -m slow tests/integration/test_vllm_backend_ci.py"
            f"::test_additional_outputs_every_case`)\n"
            f"- upstream: triton-inference-server/vllm_backend at 8de0c14, `ci/L0_additional_outputs_vllm/"
            f"additional_outputs_test.py` as it is, against the shipped `{MODEL}` on a real tritonserver "
            f"(prompt \"In this example, we\": see the test's docstring)\n"
            f"- result: {summary} ({time.monotonic() - started:.0f} s on {os.cpu_count()} cores)\n")


def test_exclude_input_in_output_and_invalid_models(server, repository, tmp_path, greedy):
    """Upstream's non-streaming tests, with smollm2's greedy text, and its two models that must not load."""
    from tests.integration.conftest import add_model

    tokens, tokenizer = greedy("The capital of France is")
    text = tokenizer.decode(tokens)
    # Upstream's vllm_invalid_1 sets an unknown engine attribute; vllm_invalid_2 names a model that is not there.
    add_model(repository, "vllm_invalid_1", source=built(MODEL).parent, parameters={"kv_cache_bytez": "1"})
    add_model(repository, "vllm_invalid_2", source=built(MODEL).parent,
              parameters={"torch_model_dir": "no_such_model"})
    opt_whole = "The capital of France is the capital of the French Republic.\\n\\nThe capital of France is the capital"
    opt_new = " the capital of the French Republic.\\n\\nThe capital of France is the capital"
    folder = vendored(tmp_path, server, vllm_backend_test={
        f'b"{opt_whole}"': repr(("The capital of France is" + text).encode()),
        f'b"{opt_new}"': repr(text.encode())})
    tests = ("test_model_with_invalid_attributes", "test_vllm_invalid_model_name",
             "test_exclude_input_in_output_default", "test_exclude_input_in_output_false",
             "test_exclude_input_in_output_true")
    output = run_unittest(folder, *(f"vllm_backend_test.VLLMTritonBackendTest.{test}" for test in tests))
    assert f"Ran {len(tests)} tests" in output and "\nOK" in output, output


def test_enabled_stream(server, tmp_path, greedy):
    tokens, tokenizer = greedy("The most dangerous animal is")
    pieces = [tokenizer.decode(tokens[:i + 1])[len(tokenizer.decode(tokens[:i])):] for i in range(len(tokens))]
    opt = ('" the",\n            " one",\n            " that",\n            " is",\n            " most",\n'
           '            " likely",\n            " to",\n            " be",\n            " killed",\n'
           '            " by",\n            " a",\n            " car",\n            ".",\n            "\\n",\n'
           '            "I",\n            "\'m",')
    folder = vendored(tmp_path, server, enabled_stream_test={
        opt: ", ".join(repr(p) for p in pieces if p) + ","})
    output = run_unittest(folder, "enabled_stream_test")
    assert "Ran 3 tests" in output and "\nOK" in output, output


def test_request_cancellation(server, tmp_path):
    """Cancelled with ``stop_stream(cancel_requests=True)``: the client gets CANCELLED, the server logs it."""
    log = tmp_path / "server.log"
    folder = vendored(tmp_path, server, request_cancellation_test={
        '"./request_cancellation_server.log"': repr(str(log)),
        '"[vllm] Cancelling the request"': '"cancelling request"',
        '"[vllm] Successfully cancelled the request"': '"answered CANCELLED, its KV blocks freed"'})
    stop = threading.Event()

    def copy_log() -> None:  # upstream reads the server's log file; ours is kept by the launcher
        while not stop.wait(0.1):
            log.write_text(server.log_text())

    copier = threading.Thread(target=copy_log, daemon=True)
    copier.start()
    try:
        output = run_unittest(folder, "request_cancellation_test")
        assert "Ran 1 test" in output and "\nOK" in output, output
    finally:
        stop.set()
        copier.join()


def test_sample_client(server, tmp_path):
    """Upstream's ``samples/client.py`` over its own prompts, whole and streamed: every prompt answered."""
    folder = vendored(tmp_path, server)
    prompts = [p.strip() for p in (folder / "prompts.txt").read_text().splitlines() if p.strip()]
    for mode in ([], ["--streaming-mode", "--exclude-inputs-in-outputs"]):
        results = folder / f"results{len(mode)}.txt"
        done = subprocess.run([sys.executable, "client.py", "-u", server.grpc_url, "-m", MODEL,
                               "--results-file", str(results), *mode], cwd=folder, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0 and "PASS: vLLM example" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
        answers = [a.strip() for a in results.read_text().split("\n=========\n") if a.strip()]
        assert len(answers) == len(prompts), answers
        if not mode:  # whole answers start with their prompt
            assert sorted(a.splitlines()[0] for a in answers) == sorted(prompts) or all(
                any(a.startswith(p) for p in prompts) for a in answers), answers


def test_the_vendored_files_are_upstreams():
    """Guard: nobody edits the vendored copies (substitutions happen in the test, in a temporary folder)."""
    names = sorted(p.name for p in UPSTREAM.iterdir())
    assert names == ["LICENSE", "additional_outputs_test.py", "client.py", "conftest.py", "enabled_stream_test.py",
                     "prompts.txt", "request_cancellation_test.py", "test_util.py", "vllm_backend_test.py"]
    assert all('"vllm_opt"' in (UPSTREAM / n).read_text() for n in names if n.endswith("_test.py"))
