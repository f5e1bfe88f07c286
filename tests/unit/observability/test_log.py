"""The one logging wrapper: every line prefixed with the model, at the sink's matching level."""

import logging

from coalesce.observability.log import Logger
from tests.unit.fakes import ListSink


def test_every_level_goes_to_the_sink_with_the_models_prefix():
    sink = ListSink()
    logger = Logger("minilm", sink)
    logger.info("a")
    logger.warning("b")
    logger.error("c")
    logger.verbose("d")
    assert sink.lines == [("info", "coalesce[minilm] a"), ("warn", "coalesce[minilm] b"),
                          ("error", "coalesce[minilm] c"), ("verbose", "coalesce[minilm] d")]


def test_without_triton_lines_go_to_the_standard_logger(caplog):
    with caplog.at_level(logging.DEBUG, logger="coalesce"):
        logger = Logger("m")
        logger.warning("careful")
        logger.verbose("details")
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("coalesce", logging.WARNING, "coalesce[m] careful"), ("coalesce", logging.DEBUG, "coalesce[m] details")]
