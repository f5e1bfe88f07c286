"""The adaptive scheduler's thread over a real pipeline (deterministic encoder): every request answered once."""

import dataclasses
import threading

import numpy as np
import pytest

from coalesce.errors import CancelledError, InvalidInputError, UnavailableError
from coalesce.metrics import InMemoryMetricFactory, PipelineMetrics, SchedulerMetrics
from coalesce.pipeline import EmbeddingPipeline
from coalesce.serving import AdaptiveScheduler, Submission, read_parameters, scheduler_config
from coalesce.settings import Settings
from coalesce.tokenizer import TextTokenizer
from tests.unit.test_pipeline import DIM, TableRuntime, enc


@pytest.fixture(scope="module")
def tokenizer(version_dir):
    return TextTokenizer(version_dir / "tokenizer.json", 256)


class Answers:
    """Collects answers; fails the test on a second answer to the same request."""

    def __init__(self):
        self.results = {}
        self.arrived = threading.Condition()

    def responder(self, key):
        def respond(result):
            with self.arrived:
                assert key not in self.results, f"request {key} answered twice"
                self.results[key] = result
                self.arrived.notify_all()
        return respond

    def wait(self, count, timeout_s=60):
        with self.arrived:
            assert self.arrived.wait_for(lambda: len(self.results) >= count, timeout_s), (
                f"only {len(self.results)} of {count} answers arrived")


def submit(scheduler, submissions):
    """What ``execute`` does: answers ready now go back at once, the rest come through ``respond`` later."""
    for sub, result in zip(submissions, scheduler.submit(submissions), strict=True):
        if result is not None:
            sub.respond(result)


def make_scheduler(tokenizer, runtime=None, cancel_check_share=0.0, **params):
    params = {"cost_model": "0.001,0.0001,0", "scheduling": "adaptive", **params}
    settings = Settings.from_parameters({k: str(v) for k, v in params.items()}, model_name="m",
                                        max_batch_size=64, embedding_dim=DIM)
    factory = InMemoryMetricFactory()
    pipeline = EmbeddingPipeline(settings, runtime or TableRuntime(), tokenizer,
                                 PipelineMetrics(factory, model="m", version="1"))
    config = dataclasses.replace(scheduler_config(settings), cancel_check_share=cancel_check_share,
                                 cancel_check_wait_s=60.0)
    scheduler = AdaptiveScheduler(pipeline, config, SchedulerMetrics(factory, model="m", version="1"))
    return scheduler, factory


def test_every_request_from_many_threads_gets_its_own_answer(tokenizer):
    scheduler, factory = make_scheduler(tokenizer, target_p99_ms=60_000)
    reference, _ = make_scheduler(tokenizer)
    answers = Answers()
    requests = {(t, i): [f"thread {t} text {i}", f"shared text {i % 3}"][: 1 + i % 2] for t in range(4)
                for i in range(25)}

    def client(t):
        for i in range(25):
            submit(scheduler, [Submission(rows=enc(requests[(t, i)]), respond=answers.responder((t, i)),
                                         tenant=f"tenant{t % 2}")])

    threads = [threading.Thread(target=client, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    answers.wait(len(requests))
    for key, texts in requests.items():
        expected = reference.pipeline.embed([enc(texts)])[0]
        assert np.array_equal(answers.results[key], expected)
    assert factory.value("coalesce_tenant_rows_total") == sum(len(t) for t in requests.values())
    assert factory.value("coalesce_tenant_rows_total", tenant="tenant0") > 0
    assert scheduler.cost.observed > 0
    assert factory.observations("coalesce_dispatch_rows")
    assert factory.value("coalesce_queue_requests") == 0
    scheduler.close()
    reference.close()


def test_bad_input_is_answered_at_once_and_neighbours_are_served(tokenizer):
    scheduler, _ = make_scheduler(tokenizer)
    answers = Answers()
    submit(scheduler, [Submission(rows=[b"\xff\xfe"], respond=answers.responder("bad")),
                      Submission(rows=enc(["fine"]), respond=answers.responder("good")),
                      Submission(rows=InvalidInputError("no TEXT"), respond=answers.responder("missing"))])
    answers.wait(3)
    assert isinstance(answers.results["bad"], InvalidInputError) and "not valid UTF-8" in str(answers.results["bad"])
    assert isinstance(answers.results["missing"], InvalidInputError)
    assert answers.results["good"].shape == (1, DIM)
    scheduler.close()


def test_cancelled_requests_are_never_computed(tokenizer):
    runtime = TableRuntime()
    scheduler, factory = make_scheduler(tokenizer, runtime)
    answers = Answers()
    submit(scheduler, [Submission(rows=enc(["cancel me please"]), respond=answers.responder("gone"),
                                 is_cancelled=lambda: True)])
    answers.wait(1)
    assert isinstance(answers.results["gone"], CancelledError)
    assert runtime.calls == []
    assert factory.value("coalesce_rejections_total", reason="cancelled") == 1
    assert factory.value("coalesce_tenant_rejections_total", reason="cancelled", tenant="default") == 1
    scheduler.close()


def test_young_requests_are_not_asked_whether_they_were_cancelled(tokenizer):
    # Asking is a round trip to the server; a request dispatched at once is computed unasked.
    asked = []
    scheduler, _ = make_scheduler(tokenizer, cancel_check_share=0.5, target_p99_ms=60_000)
    answers = Answers()
    submit(scheduler, [Submission(rows=enc(["fresh"]), respond=answers.responder("fresh"),
                                 is_cancelled=lambda: asked.append(1) or False)])
    answers.wait(1)
    assert answers.results["fresh"].shape == (1, DIM)
    assert asked == []
    scheduler.close()


def test_a_timeout_that_cannot_be_met_is_refused_at_once_with_a_reason(tokenizer):
    scheduler, factory = make_scheduler(tokenizer)
    answers = Answers()
    submit(scheduler, [Submission(rows=enc(["x " * 200]), respond=answers.responder("hurry"), timeout_s=1e-6)])
    answers.wait(1)
    error = answers.results["hurry"]
    assert isinstance(error, UnavailableError) and error.code == "UNAVAILABLE"
    assert "request refused: it cannot meet its deadline of 0 ms" in str(error) and "predicted answer in" in str(error)
    assert factory.value("coalesce_rejections_total", reason="deadline") == 1
    scheduler.close()


def test_queue_bound_and_tenant_rate_limit_refuse_with_their_reasons(tokenizer):
    scheduler, factory = make_scheduler(tokenizer, max_queue_rows=2, tenant_max_rows_per_s="free:1",
                                        target_p99_ms=60_000)
    answers = Answers()
    submit(scheduler, [Submission(rows=enc(["a", "b"]), respond=answers.responder("fits")),
                      Submission(rows=enc(["c"]), respond=answers.responder("full")),
                      Submission(rows=enc(["d"]), respond=answers.responder("free-1"), tenant="free"),
                      Submission(rows=enc(["e"]), respond=answers.responder("free-2"), tenant="free")])
    answers.wait(4)
    assert answers.results["fits"].shape == (2, DIM)
    full = str(answers.results["full"])
    assert "request refused: the queue is full" in full and "max_queue_rows" in full
    assert "tenant 'free' is over its rate limit (1 rows/s)" in str(answers.results["free-2"])
    assert factory.value("coalesce_rejections_total", reason="queue_full") >= 1
    assert factory.value("coalesce_rejections_total", reason="rate_limit") == 1
    scheduler.close()


def test_close_answers_what_is_queued(tokenizer):
    gate = threading.Event()

    class SlowRuntime(TableRuntime):
        def run(self, *args):
            gate.wait(10)
            return super().run(*args)

    scheduler, _ = make_scheduler(tokenizer, SlowRuntime(), target_p99_ms=60_000, max_dispatch_rows=1)
    answers = Answers()
    submit(scheduler, [Submission(rows=enc([f"row {i}"]), respond=answers.responder(i)) for i in range(5)])
    closer = threading.Thread(target=scheduler.close)
    closer.start()
    gate.set()
    closer.join(30)
    answers.wait(5)
    assert all(r.shape == (1, DIM) for r in answers.results.values())
    # After close, new work is refused rather than left unanswered.
    submit(scheduler, [Submission(rows=enc(["late"]), respond=answers.responder("late"))])
    answers.wait(6)
    assert "unloading" in str(answers.results["late"])


@pytest.mark.parametrize(("text", "expected"), [
    ("", ("default", 0)),
    ('{"tenant": "acme"}', ("acme", 0)),
    ('{"tenant": "acme", "priority_level": 2}', ("acme", 2)),
    ('{"priority_level": "3"}', ("default", 3)),
])
def test_read_parameters(text, expected):
    assert read_parameters(text) == expected


@pytest.mark.parametrize(("text", "fragment"), [
    ("not json", "not valid JSON"),
    ('{"tenant": 5}', "'tenant' must be a non-empty string"),
    ('{"tenant": ""}', "'tenant' must be a non-empty string"),
    ('{"priority_level": -1}', "'priority_level' must be an integer >= 0"),
    ('{"priority_level": "high"}', "'priority_level' must be an integer >= 0"),
    ('{"priority_level": true}', "'priority_level' must be an integer >= 0"),
])
def test_bad_parameters_are_invalid_arg(text, fragment):
    error = read_parameters(text)
    assert isinstance(error, InvalidInputError) and fragment in str(error)


def test_tritons_queue_timeout_comes_off_the_backends_share_of_the_target():
    from coalesce.serving import triton_queue_timeout_s

    config = {"dynamic_batching": {"default_queue_policy": {"timeout_action": "REJECT",
                                                            "default_timeout_microseconds": "50000"}}}
    assert triton_queue_timeout_s(config) == 0.05
    delay = {"dynamic_batching": {"default_queue_policy": {"timeout_action": "DELAY",
                                                           "default_timeout_microseconds": 9}}}
    assert triton_queue_timeout_s(delay) == 0
    assert triton_queue_timeout_s({}) == 0
    settings = Settings.from_parameters({"target_p99_ms": "200"}, model_name="m")
    assert scheduler_config(settings, triton_queue_timeout_s=0.05).target_s == pytest.approx(0.15)
    assert scheduler_config(settings, triton_queue_timeout_s=5.0).target_s == pytest.approx(0.02)


def test_an_idle_scheduler_answers_a_short_dispatch_inline(tokenizer):
    scheduler, factory = make_scheduler(tokenizer)
    reference, _ = make_scheduler(tokenizer)
    answers = Answers()
    sub = Submission(rows=enc(["quiet server"]), respond=answers.responder("inline"))
    [result] = scheduler.submit([sub])
    assert np.array_equal(result, reference.pipeline.embed([enc(["quiet server"])])[0])
    assert answers.results == {}  # answered from submit, not through the response sender
    assert factory.value("coalesce_tenant_rows_total") == 1
    scheduler.close()
    reference.close()


def test_a_long_dispatch_goes_to_the_scheduler_thread(tokenizer):
    # 50 ms predicted against a 200 ms target: more than an inline run may take.
    scheduler, _ = make_scheduler(tokenizer, cost_model="0.05,0,0", target_p99_ms=200)
    answers = Answers()
    assert scheduler.submit([Submission(rows=enc(["long"]), respond=answers.responder("long"))]) == [None]
    answers.wait(1)
    assert answers.results["long"].shape == (1, DIM)
    scheduler.close()


def test_while_a_dispatch_runs_new_requests_queue_and_are_answered_later(tokenizer):
    gate, started = threading.Event(), threading.Event()

    class GatedRuntime(TableRuntime):
        def run(self, *args):
            started.set()
            gate.wait(10)
            return super().run(*args)

    scheduler, _ = make_scheduler(tokenizer, GatedRuntime(), target_p99_ms=60_000)
    answers = Answers()
    first = threading.Thread(target=submit, args=(scheduler, [Submission(rows=enc(["first"]),
                                                                         respond=answers.responder("first"))]))
    first.start()
    assert started.wait(10)
    # The executor is taken (inline, in the first caller's thread): this one waits in the queue.
    assert scheduler.submit([Submission(rows=enc(["second"]), respond=answers.responder("second"))]) == [None]
    gate.set()
    first.join(10)
    answers.wait(2)
    assert answers.results["first"].shape == answers.results["second"].shape == (1, DIM)
    scheduler.close()
