"""Cores shared, not split, on a real tritonserver: the example models as shipped.

A model alone computes on every core; two busy models each keep to their one-thread share.
What the board decided is counted per model (``coalesce_forward_passes_wide_total`` out of
``coalesce_forward_passes_total``), so these tests read counts, never timings.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from coalesce_client.client import encode_texts
from tests.integration.conftest import infer
from tests.integration.test_cache import metric, settled_metric

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="sharing cores needs at least 2 of them")

WIDE = "coalesce_forward_passes_wide_total"
PASSES = "coalesce_forward_passes_total"
SHARING_MODELS = ("minilm", "minilm_rerank", "minilm_tokens", "digits")


def _embed(server, texts):
    return infer(server, "grpc", "minilm", [("TEXT", encode_texts(texts), "BYTES")], ["EMBEDDING"])


def _score(server, texts):
    return infer(server, "grpc", "minilm_rerank", [("TEXT", encode_texts(texts), "BYTES"),
                                                   ("TEXT_PAIR", encode_texts(texts[::-1]), "BYTES")], ["SCORES"])


def test_every_example_model_set_up_sharing(server):
    log = server.log_text()
    cores = len(os.sched_getaffinity(0))
    for model in SHARING_MODELS:
        assert (f"coalesce[{model}] core sharing: a pass runs on {cores} cores while no other model computes, "
                "else on 1; 1 borrowed threads at idle priority" if cores == 2 else
                f"coalesce[{model}] core sharing: a pass runs on {cores} cores") in log, model


def test_a_model_alone_runs_its_passes_on_every_core(server):
    wide, passes = metric(server, WIDE, "minilm"), metric(server, PASSES, "minilm")
    for i in range(5):  # one at a time, nothing else computing: every pass is wide
        _embed(server, [f"alone on the server, text {i}"])
    ran = settled_metric(server, PASSES, "minilm", lambda v: v >= passes + 5) - passes
    settled_metric(server, WIDE, "minilm", lambda v: v == wide + ran)  # every one of them


def test_two_busy_models_keep_to_their_share(server):
    """While minilm and minilm_rerank both compute, passes that begin beside the other run on one thread."""
    before = {m: (metric(server, PASSES, m), metric(server, WIDE, m)) for m in ("minilm", "minilm_rerank")}
    stop = time.monotonic() + 4.0
    errors: list[BaseException] = []

    def loop(send, tag):
        i = 0
        try:
            while time.monotonic() < stop:
                send(server, [f"{tag} busy text number {i} " + "word " * (i % 40), f"{tag} second row {i}"])
                i += 1
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(send, tag)) for send, tag in
               ((_embed, "a"), (_embed, "b"), (_score, "c"), (_score, "d"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, [str(e) for e in errors]
    time.sleep(0.5)  # the backend sends its metrics every 100 ms
    for model, (passes, wide) in before.items():
        ran = metric(server, PASSES, model) - passes
        narrow = ran - (metric(server, WIDE, model) - wide)
        assert ran > 10 and narrow > 0, (model, ran, narrow)
