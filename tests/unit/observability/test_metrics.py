"""Buffered metrics: recorded in process, sent to the real factory only on a flush; the pipeline's families."""

import threading

from coalesce.observability.metrics import MAX_PENDING_OBSERVATIONS, BufferedMetricFactory, InMemoryMetricFactory


def test_nothing_reaches_the_target_before_a_flush_and_everything_after():
    target = InMemoryMetricFactory()
    factory = BufferedMetricFactory(target, interval_s=0)
    counter = factory.counter("c_total", "c", {"model": "m"})
    gauge = factory.gauge("g", "g", {"model": "m"})
    histogram = factory.histogram("h_seconds", "h", {"model": "m"}, (0.1, 1.0))
    for _ in range(5):
        counter.increment(2)
        histogram.observe(0.5)
    gauge.set(3)
    gauge.set(7)
    assert target.value("c_total") == 0 and target.value("g") == 0 and target.observations("h_seconds") == []
    factory.flush()
    assert target.value("c_total") == 10
    assert target.value("g") == 7
    assert target.observations("h_seconds") == [0.5] * 5
    factory.flush()  # nothing new: nothing sent again
    assert target.value("c_total") == 10 and len(target.observations("h_seconds")) == 5



def test_close_without_flush_stops_the_thread_and_sends_nothing():
    """What a failed model load does: the flusher thread ends, and nothing more reaches the server."""
    target = InMemoryMetricFactory()
    factory = BufferedMetricFactory(target, interval_s=3600)
    factory.counter("c_total", "c", {}).increment(5)
    flusher = factory._thread
    assert flusher is not None and flusher.is_alive()
    factory.close(flush=False)
    assert not flusher.is_alive() and target.value("c_total") == 0

def test_increments_from_many_threads_are_all_counted():
    target = InMemoryMetricFactory()
    factory = BufferedMetricFactory(target, interval_s=0.01)
    counter = factory.counter("c_total", "c", {})

    def work():
        for _ in range(2000):
            counter.increment(1)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    factory.close()
    assert target.value("c_total") == 8000


def test_a_flood_of_observations_is_bounded_and_the_excess_counted():
    target = InMemoryMetricFactory()
    factory = BufferedMetricFactory(target, interval_s=0)
    histogram = factory.histogram("h_seconds", "h", {}, (1.0,))
    for _ in range(MAX_PENDING_OBSERVATIONS + 3):
        histogram.observe(0.5)
    factory.flush()
    assert len(target.observations("h_seconds")) == MAX_PENDING_OBSERVATIONS
    assert target.value("coalesce_metric_observations_dropped_total") == 3


def test_a_failing_send_is_reported_once_per_interval_and_does_not_stop_the_others():
    class Broken:
        def increment(self, value):
            raise RuntimeError("server gone")

    class Target(InMemoryMetricFactory):
        def counter(self, name, description, labels):
            return Broken() if name == "broken_total" else super().counter(name, description, labels)

    target, errors = Target(), []
    factory = BufferedMetricFactory(target, interval_s=0, on_error=errors.append)
    broken, fine = factory.counter("broken_total", "b", {}), factory.counter("fine_total", "f", {})
    for _ in range(3):
        broken.increment(1)
        fine.increment(1)
        factory.flush()
    assert target.value("fine_total") == 3
    assert [str(e) for e in errors] == ["server gone"]


def test_pipeline_metrics_are_labelled_by_model_version_and_stage():
    from coalesce.observability.metrics import STAGES, PipelineMetrics

    assert STAGES == ("read", "prepare", "plan", "infer", "split", "scatter")
    factory = InMemoryMetricFactory()
    metrics = PipelineMetrics(factory, model="m", version="2")
    for stage in STAGES:
        metrics.stage_seconds[stage].observe(0.001)
    labels = {dict(ls)["stage"]: dict(ls) for (name, ls) in factory.histograms if name == "coalesce_stage_seconds"}
    assert labels == {stage: {"model": "m", "version": "2", "stage": stage} for stage in STAGES}
    metrics.rows.increment(3)
    assert factory.value("coalesce_rows_total", model="m", version="2") == 3
    assert factory.value("coalesce_rows_total", model="other") == 0
