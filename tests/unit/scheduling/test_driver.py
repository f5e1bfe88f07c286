"""The adaptive scheduler's thread over a real pipeline (deterministic fake runtimes): every request answered once."""

import dataclasses
import threading

import numpy as np
import pytest

from coalesce.core.errors import CancelledError, CoalesceError, InvalidInputError, UnavailableError
from coalesce.observability.metrics import SchedulerMetrics
from coalesce.scheduling.driver import (
    AdaptiveScheduler,
    Submission,
    read_parameters,
    scheduler_config,
    triton_queue_timeout_s,
)
from coalesce.settings import ModelSettings
from tests.conftest import model_config
from tests.unit.fakes import (
    DIM,
    RAGGED_CONFIG,
    EncoderRuntime,
    RaggedRuntime,
    answers,
    embedding_pipeline,
    make_pipeline,
    ragged_request,
    texts,
)


class HeldRuntime(EncoderRuntime):
    """Holds every pass at ``gate`` (after setting ``started``), so a test can queue requests behind it."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.started = threading.Event(), threading.Event()

    def compute(self, feeds):
        self.started.set()
        self.gate.wait(10)
        return super().compute(feeds)


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


def text_request(*values):
    return {"TEXT": texts(*values)}


def schedule(pipeline, factory, config, cancel_check_share=0.0):
    settings = ModelSettings.from_model_config(config)
    scheduling = dataclasses.replace(scheduler_config(settings), cancel_check_share=cancel_check_share,
                                     cancel_check_wait_s=60.0)
    return AdaptiveScheduler(pipeline, scheduling, SchedulerMetrics(factory, model="m", version="1")), factory


def make_scheduler(runtime=None, cancel_check_share=0.0, **parameters):
    parameters = {"scheduling": "adaptive", **parameters}
    pipeline, factory = embedding_pipeline(runtime, **parameters)
    return schedule(pipeline, factory, model_config("minilm", **parameters), cancel_check_share)


def reference(*values):
    pipeline, _ = embedding_pipeline()
    return answers(pipeline, text_request(*values))[0]["EMBEDDING"]


def test_every_request_from_many_threads_gets_its_own_answer():
    scheduler, factory = make_scheduler(target_p99_ms=60_000)
    answered = Answers()
    requests = {(t, i): [f"thread {t} text {i}", f"shared text {i % 3}"][: 1 + i % 2] for t in range(4)
                for i in range(25)}

    def client(t):
        for i in range(25):
            submit(scheduler, [Submission(tensors=text_request(*requests[(t, i)]),
                                          respond=answered.responder((t, i)), tenant=f"tenant{t % 2}")])

    threads = [threading.Thread(target=client, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    answered.wait(len(requests))
    pipeline, _ = embedding_pipeline()
    for key, values in requests.items():
        assert np.array_equal(answered.results[key]["EMBEDDING"], answers(pipeline, text_request(*values))[0]
                              ["EMBEDDING"])
    assert factory.value("coalesce_tenant_rows_total") == sum(len(t) for t in requests.values())
    assert factory.value("coalesce_tenant_rows_total", tenant="tenant0") == sum(
        len(v) for (t, _), v in requests.items() if t % 2 == 0)
    assert scheduler.cost.observed > 0
    assert sum(factory.observations("coalesce_dispatch_rows")) == sum(len(t) for t in requests.values())
    assert factory.value("coalesce_queue_requests") == 0
    scheduler.close()


@pytest.mark.parametrize(("tensors", "message"), [
    (text_request(b"\xff\xfe"), "input 'TEXT' row 0 is not valid UTF-8: byte 0xff at offset 0 (invalid start byte)"),
    ({"TEXT": np.empty((0, 1), dtype=np.object_)},
     "input 'TEXT' has no rows: send at least one text (shape [N, 1], N >= 1)"),
    ({}, "request has no input 'TEXT'"),
    ({"TEXT": texts("a", "b").reshape(1, 2)}, "input 'TEXT' has shape [1, 2], expected [N, 1]"),
    (InvalidInputError("request parameters must be a JSON object"), "request parameters must be a JSON object"),
], ids=["non_utf8", "empty", "missing", "shape", "parameters"])
def test_bad_input_is_answered_at_once_and_neighbours_are_served(tensors, message):
    scheduler, factory = make_scheduler()
    answered = Answers()
    bad = Submission(tensors=tensors, respond=answered.responder("bad"))
    good = Submission(tensors=text_request("fine"), respond=answered.responder("good"))
    ready = scheduler.submit([bad, good])
    assert isinstance(ready[0], InvalidInputError)  # from submit itself, never queued
    for sub, result in zip([bad, good], ready, strict=True):
        if result is not None:
            sub.respond(result)
    answered.wait(2)
    error = answered.results["bad"]
    assert isinstance(error, InvalidInputError) and error.code == "INVALID_ARG"
    assert str(error) == message
    assert np.array_equal(answered.results["good"]["EMBEDDING"], reference("fine"))
    # Read once, as one stage, for both; only the good row was computed and counted for its tenant.
    assert len(factory.observations("coalesce_stage_seconds", stage="read")) == 1
    assert factory.value("coalesce_tenant_rows_total", tenant="default") == 1
    assert factory.value("coalesce_rows_total") == 1
    scheduler.close()


def test_a_dispatch_that_raises_still_answers_every_request():
    class Broken(EncoderRuntime):
        def compute(self, feeds):
            raise ValueError("not a CoalesceError")

    scheduler, factory = make_scheduler(Broken(), target_p99_ms=60_000)
    answered = Answers()
    submit(scheduler, [Submission(tensors=text_request("one"), respond=answered.responder("one")),
                       Submission(tensors=text_request("two", "three"), respond=answered.responder("two"))])
    answered.wait(2)
    for key in ("one", "two"):
        error = answered.results[key]
        assert type(error) is CoalesceError and error.code == "INTERNAL"
        assert str(error) == "internal error: not a CoalesceError"
    assert factory.value("coalesce_tenant_failures_total", tenant="default") == 2
    scheduler.close()


def test_cancelled_requests_are_never_computed():
    runtime = EncoderRuntime()
    scheduler, factory = make_scheduler(runtime)
    answered = Answers()
    submit(scheduler, [Submission(tensors=text_request("cancel me please"), respond=answered.responder("gone"),
                                  is_cancelled=lambda: True)])
    answered.wait(1)
    assert isinstance(answered.results["gone"], CancelledError)
    assert str(answered.results["gone"]) == "request was cancelled before it was computed"
    assert runtime.feeds == []
    assert factory.value("coalesce_rejections_total", reason="cancelled") == 1
    assert factory.value("coalesce_tenant_rejections_total", reason="cancelled", tenant="default") == 1
    scheduler.close()


def test_young_requests_are_not_asked_whether_they_were_cancelled():
    # Asking is a round trip to the server; a request dispatched at once is computed unasked.
    asked = []
    scheduler, _ = make_scheduler(cancel_check_share=0.5, target_p99_ms=60_000)
    answered = Answers()
    submit(scheduler, [Submission(tensors=text_request("fresh"), respond=answered.responder("fresh"),
                                  is_cancelled=lambda: asked.append(1) or False)])
    answered.wait(1)
    assert answered.results["fresh"]["EMBEDDING"].shape == (1, DIM)
    assert asked == []
    scheduler.close()


def test_a_timeout_that_cannot_be_met_is_refused_at_once_with_a_reason():
    scheduler, factory = make_scheduler()
    answered = Answers()
    submit(scheduler, [Submission(tensors=text_request("x " * 200), respond=answered.responder("hurry"),
                                  timeout_s=1e-6)])
    answered.wait(1)
    error = answered.results["hurry"]
    assert isinstance(error, UnavailableError) and error.code == "UNAVAILABLE"
    assert str(error).startswith("request refused: it cannot meet its deadline of 0 ms: 0 request(s) with 0 row(s) "
                                 "queued, predicted answer in ")
    assert factory.value("coalesce_rejections_total", reason="deadline") == 1
    scheduler.close()


def test_queue_bound_and_tenant_rate_limit_refuse_with_their_reasons():
    scheduler, factory = make_scheduler(max_queue_rows=2, tenant_max_rows_per_s="free:1", target_p99_ms=60_000)
    answered = Answers()
    submit(scheduler, [Submission(tensors=text_request("a", "b"), respond=answered.responder("fits")),
                       Submission(tensors=text_request("c"), respond=answered.responder("full")),
                       Submission(tensors=text_request("d"), respond=answered.responder("free-1"), tenant="free"),
                       Submission(tensors=text_request("e"), respond=answered.responder("free-2"), tenant="free")])
    answered.wait(4)
    assert answered.results["fits"]["EMBEDDING"].shape == (2, DIM)
    assert str(answered.results["full"]) == ("request refused: the queue is full (2 rows queued, limit 2 (parameter "
                                             "'max_queue_rows')); retry later")
    assert str(answered.results["free-2"]) == ("request refused: tenant 'free' is over its rate limit (1 rows/s); "
                                               "retry later")
    assert factory.value("coalesce_rejections_total", reason="queue_full") >= 1
    assert factory.value("coalesce_rejections_total", reason="rate_limit") == 1
    scheduler.close()


def test_close_answers_what_is_queued_and_returns():
    held = HeldRuntime()
    gate, started = held.gate, held.started

    scheduler, _ = make_scheduler(held, target_p99_ms=60_000, max_dispatch_rows=1)
    answered = Answers()
    submitter = threading.Thread(target=submit, args=(scheduler, [
        Submission(tensors=text_request(f"row {i}"), respond=answered.responder(i)) for i in range(5)]))
    submitter.start()
    assert started.wait(10)  # one dispatch runs (held at the gate), four wait in the queue
    closer = threading.Thread(target=scheduler.close)
    closer.start()
    gate.set()
    closer.join(30)
    assert not closer.is_alive(), "close() did not return"
    submitter.join(30)
    answered.wait(5)
    assert all(r["EMBEDDING"].shape == (1, DIM) for r in answered.results.values())
    # After close, new work is refused rather than left unanswered.
    submit(scheduler, [Submission(tensors=text_request("late"), respond=answered.responder("late"))])
    answered.wait(6)
    assert isinstance(answered.results["late"], UnavailableError)
    assert str(answered.results["late"]) == "model is unloading"


@pytest.mark.parametrize(("text", "expected"), [
    ("", ("default", 0)),
    ('{"tenant": "acme"}', ("acme", 0)),
    ('{"tenant": "acme", "priority_level": 2}', ("acme", 2)),
    ('{"priority_level": "3"}', ("default", 3)),
])
def test_read_parameters(text, expected):
    assert read_parameters(text) == expected


@pytest.mark.parametrize(("text", "message"), [
    ("not json", "request parameters are not valid JSON: 'not json'"),
    ("[1]", "request parameters must be a JSON object"),
    ('{"tenant": 5}', "request parameter 'tenant' must be a non-empty string of at most 128 characters, got 5"),
    ('{"tenant": ""}', "request parameter 'tenant' must be a non-empty string of at most 128 characters, got ''"),
    ('{"priority_level": -1}', "request parameter 'priority_level' must be an integer >= 0 (1 is the highest level), "
                               "got -1"),
    ('{"priority_level": "high"}', "request parameter 'priority_level' must be an integer >= 0 (1 is the highest "
                                   "level), got 'high'"),
    ('{"priority_level": true}', "request parameter 'priority_level' must be an integer >= 0 (1 is the highest "
                                 "level), got True"),
])
def test_bad_parameters_are_invalid_arg(text, message):
    error = read_parameters(text)
    assert isinstance(error, InvalidInputError) and str(error) == message


def test_tritons_queue_timeout_comes_off_the_backends_share_of_the_target():
    config = {"dynamic_batching": {"default_queue_policy": {"timeout_action": "REJECT",
                                                            "default_timeout_microseconds": "50000"}}}
    assert triton_queue_timeout_s(config) == 0.05
    delay = {"dynamic_batching": {"default_queue_policy": {"timeout_action": "DELAY",
                                                           "default_timeout_microseconds": 9}}}
    assert triton_queue_timeout_s(delay) == 0
    assert triton_queue_timeout_s({}) == 0
    settings = ModelSettings.from_parameters({"target_p99_ms": "200"}, model_name="m")
    assert scheduler_config(settings, triton_queue_timeout_s=0.05).target_s == pytest.approx(0.15)
    assert scheduler_config(settings, triton_queue_timeout_s=5.0).target_s == pytest.approx(0.02)
    assert scheduler_config(settings, triton_queue_timeout_s=0.05).inline_share == 0.0
    assert scheduler_config(settings).inline_share > 0


def test_an_idle_scheduler_answers_a_short_dispatch_inline():
    scheduler, factory = make_scheduler()
    answered = Answers()
    sub = Submission(tensors=text_request("quiet server"), respond=answered.responder("inline"))
    [result] = scheduler.submit([sub])
    assert np.array_equal(result["EMBEDDING"], reference("quiet server"))
    assert answered.results == {}  # answered from submit, not through the response sender
    assert factory.value("coalesce_tenant_rows_total") == 1
    scheduler.close()


def test_a_long_dispatch_goes_to_the_scheduler_thread():
    # 50 ms predicted against a 200 ms target: more than an inline run may take.
    scheduler, _ = make_scheduler(cost_model="0.05,0,0", target_p99_ms=200)
    answered = Answers()
    assert scheduler.submit([Submission(tensors=text_request("long"), respond=answered.responder("long"))]) == [None]
    answered.wait(1)
    assert answered.results["long"]["EMBEDDING"].shape == (1, DIM)
    scheduler.close()


def test_while_a_dispatch_runs_new_requests_queue_and_are_answered_later():
    held = HeldRuntime()
    gate, started = held.gate, held.started

    scheduler, _ = make_scheduler(held, target_p99_ms=60_000)
    answered = Answers()
    first = threading.Thread(target=submit, args=(scheduler, [
        Submission(tensors=text_request("first"), respond=answered.responder("first"))]))
    first.start()
    assert started.wait(10)
    # The executor is taken (inline, in the first caller's thread): this one waits in the queue.
    assert scheduler.submit([Submission(tensors=text_request("second"), respond=answered.responder("second"))]) == [
        None]
    gate.set()
    first.join(10)
    answered.wait(2)
    assert answered.results["first"]["EMBEDDING"].shape == answered.results["second"]["EMBEDDING"].shape == (1, DIM)
    scheduler.close()


def test_tensor_rows_of_every_length_are_scheduled_and_answered():
    config = {**RAGGED_CONFIG, "parameters": {**RAGGED_CONFIG["parameters"],
                                              "scheduling": {"string_value": "adaptive"},
                                              "target_p99_ms": {"string_value": "60000"}}}
    pipeline, factory = make_pipeline(config, None, RaggedRuntime())
    scheduler, _ = schedule(pipeline, factory, config)
    answered = Answers()
    requests = {i: ragged_request(1 + i % 3, 1 + (5 * i) % 17, i, mask=i % 2 == 0) for i in range(12)}
    submit(scheduler, [Submission(tensors=r, respond=answered.responder(i)) for i, r in requests.items()])
    answered.wait(len(requests))
    reference_pipeline, _ = make_pipeline(RAGGED_CONFIG, None, pipeline.runtime)
    for i, request in requests.items():
        (alone,) = answers(reference_pipeline, request)
        for output in ("y", "total"):
            assert np.array_equal(answered.results[i][output], alone[output])
    assert factory.value("coalesce_tenant_rows_total") == sum(len(r["x"]) for r in requests.values())
    scheduler.close()


def thread_scheduler(runtime=None, **parameters):
    """A scheduler whose every dispatch runs on its own thread (never inline in ``submit``)."""
    parameters = {"scheduling": "adaptive", "target_p99_ms": 60_000, **parameters}
    pipeline, factory = embedding_pipeline(runtime, **parameters)
    settings = ModelSettings.from_model_config(model_config("minilm", **parameters))
    config = dataclasses.replace(scheduler_config(settings), inline_share=0.0, cancel_check_share=0.0,
                                 cancel_check_wait_s=60.0)
    return AdaptiveScheduler(pipeline, config, SchedulerMetrics(factory, model="m", version="1")), factory


def test_queue_bound_in_bytes_refuses_saying_how_many_bytes_it_holds():
    held = HeldRuntime()
    gate, started = held.gate, held.started

    scheduler, factory = thread_scheduler(held, max_queue_bytes=250, max_dispatch_rows=1)
    answered = Answers()
    submit(scheduler, [Submission(tensors=text_request("x" * 10), respond=answered.responder("running"))])
    assert started.wait(10)  # the executor is held: what follows stays queued
    submit(scheduler, [Submission(tensors=text_request("a" * 100), respond=answered.responder(i)) for i in (1, 2)])
    submit(scheduler, [Submission(tensors=text_request("b" * 100), respond=answered.responder("over"))])
    answered.wait(1)
    error = answered.results["over"]
    assert isinstance(error, UnavailableError) and error.code == "UNAVAILABLE"
    assert str(error) == ("request refused: queue holds 200 bytes, and this request's 100 would pass the limit of "
                          "250 (parameter 'max_queue_bytes'); retry later")
    assert factory.value("coalesce_rejections_total", reason="queue_full") == 1
    assert scheduler.queue.size_bytes == 200
    gate.set()
    answered.wait(4)
    assert all(answered.results[k]["EMBEDDING"].shape == (1, DIM) for k in ("running", 1, 2))
    assert scheduler.queue.size_bytes == 0
    scheduler.close()


def test_the_adaptive_path_refuses_an_oversized_request_before_reading_it():
    scheduler, _ = thread_scheduler(max_request_bytes=64)
    answered = Answers()
    submit(scheduler, [Submission(tensors=text_request(b"\xff" * 65), respond=answered.responder("big")),
                       Submission(tensors=text_request("small"), respond=answered.responder("small"))])
    answered.wait(2)
    assert str(answered.results["big"]).startswith("request is 65 bytes, over the model's limit of 64 bytes")
    assert answered.results["small"]["EMBEDDING"].shape == (1, DIM)
    scheduler.close()


def test_a_dispatch_whose_runtime_raises_answers_internal_and_later_requests_are_served():
    failed = []

    def once(feeds):
        if not failed:
            failed.append(True)
            return True
        return False

    class BrokenOnce(EncoderRuntime):
        def run(self, feeds, outputs):
            if once(feeds):
                raise ZeroDivisionError("a bug in a runtime")  # not a CoalesceError: escapes the pipeline
            return super().run(feeds, outputs)

    scheduler, _ = thread_scheduler(BrokenOnce())
    answered = Answers()
    submit(scheduler, [Submission(tensors=text_request("first"), respond=answered.responder("first"))])
    answered.wait(1)
    error = answered.results["first"]
    assert isinstance(error, CoalesceError) and error.code == "INTERNAL"
    submit(scheduler, [Submission(tensors=text_request(f"later {i}"), respond=answered.responder(i))
                       for i in range(3)])
    answered.wait(4)
    assert all(answered.results[i]["EMBEDDING"].shape == (1, DIM) for i in range(3))
    scheduler.close()


def test_a_failure_outside_the_pipeline_restarts_the_thread_and_answers_what_it_held():
    held = HeldRuntime()
    gate, started = held.gate, held.started

    scheduler, factory = thread_scheduler(held, max_dispatch_rows=1)
    observe = scheduler.metrics.actual_seconds.observe
    broken = []

    def observe_once(value):  # a fault after the dispatch ran, before its answers went out
        if not broken:
            broken.append(value)
            raise RuntimeError("metrics broke")
        observe(value)

    scheduler.metrics.actual_seconds.observe = observe_once
    answered = Answers()
    submit(scheduler, [Submission(tensors=text_request("taken"), respond=answered.responder("taken"))])
    assert started.wait(10)
    submit(scheduler, [Submission(tensors=text_request(f"queued {i}"), respond=answered.responder(i))
                       for i in range(2)])
    gate.set()
    answered.wait(3)
    # The dispatch's own answer went out before the fault; the queued requests got INTERNAL, none hangs.
    assert answered.results["taken"]["EMBEDDING"].shape == (1, DIM)
    for i in range(2):
        error = answered.results[i]
        assert isinstance(error, CoalesceError) and error.code == "INTERNAL"
        assert "the backend's scheduler failed while this request was queued (RuntimeError: metrics broke)" in str(
            error)
    assert scheduler.restarts == 1
    assert factory.value("coalesce_scheduler_restarts_total") == 1
    assert scheduler.queue.size_bytes == 0 and len(scheduler.queue) == 0
    submit(scheduler, [Submission(tensors=text_request(f"after {i}"), respond=answered.responder(("after", i)))
                       for i in range(3)])
    answered.wait(6)
    assert all(answered.results[("after", i)]["EMBEDDING"].shape == (1, DIM) for i in range(3))
    scheduler.close()


def test_a_policy_failure_answers_the_taken_dispatch_with_internal():
    scheduler, factory = thread_scheduler()
    decide = scheduler.queue.decide
    broken = []

    def decide_once(now):
        if not broken and len(scheduler.queue):
            broken.append(now)
            raise ValueError("policy bug")
        return decide(now)

    scheduler.queue.decide = decide_once
    answered = Answers()
    submit(scheduler, [Submission(tensors=text_request("a"), respond=answered.responder("a"))])
    answered.wait(1)
    assert answered.results["a"].code == "INTERNAL" and "ValueError: policy bug" in str(answered.results["a"])
    submit(scheduler, [Submission(tensors=text_request("b"), respond=answered.responder("b"))])
    answered.wait(2)
    assert answered.results["b"]["EMBEDDING"].shape == (1, DIM)
    assert scheduler.restarts == 1 and factory.value("coalesce_scheduler_restarts_total") == 1
    scheduler.close()


def test_an_inline_dispatch_that_fails_answers_its_requests_with_internal():
    scheduler, _ = make_scheduler(target_p99_ms=60_000)  # idle, so submit runs the dispatch inline
    original = scheduler._run

    def run_and_break(dispatch, started, deliver):
        raise KeyError("inline break")

    scheduler._run = run_and_break
    answered = Answers()
    submit(scheduler, [Submission(tensors=text_request("x"), respond=answered.responder("x"))])
    answered.wait(1)
    assert answered.results["x"].code == "INTERNAL" and "KeyError: 'inline break'" in str(answered.results["x"])
    scheduler._run = original
    submit(scheduler, [Submission(tensors=text_request("y"), respond=answered.responder("y"))])
    answered.wait(2)
    assert answered.results["y"]["EMBEDDING"].shape == (1, DIM)
    scheduler.close()
