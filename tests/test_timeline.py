"""Timeline marks: parsing, per-transfer gaps, and the scheduler's D-side marks."""

from __future__ import annotations

import logging

import pytest

from kvferry.connectors.protocol import timeline
from kvferry.connectors.scheduling.scheduler import TransferScheduler


def test_parse_joins_processes_and_keeps_first_mark() -> None:
    lines = [
        "INFO 12-01 [push_worker.py:1] kvferry-timeline t1 write_start 100.000000",
        "router: kvferry-timeline t1 dispatched 99.900000",
        "kvferry-timeline t1 write_start 100.500000",  # a repeat does not move the mark
        "noise kvferry-timeline",
        "kvferry-timeline t2 kv_in 7.25",
    ]
    assert timeline.parse(lines) == {"t1": {"write_start": 100.0, "dispatched": 99.9},
                                     "t2": {"kv_in": 7.25}}


def test_summarize_medians_of_consecutive_events() -> None:
    marks = {
        "a": {"dispatched": 0.0, "prefill_end": 0.100, "write_start": 0.104, "write_done": 0.109,
              "kv_in": 0.110, "p_answered": 0.102, "d_first_byte": 0.130},
        "b": {"dispatched": 1.0, "prefill_end": 1.100, "write_start": 1.106, "write_done": 1.111,
              "kv_in": 1.113, "p_answered": 1.103, "d_first_byte": 1.140},
        "c": {"prefill_end": 2.0, "write_start": 2.010},  # partial: only its own gaps count
    }
    s = timeline.summarize(marks)
    assert s["write_start->p_answered"] == pytest.approx(-2.5)
    assert s["prefill_end->write_start"] == pytest.approx(6.0)  # median of 4, 6, 10
    assert s["p_answered->d_first_byte"] == pytest.approx(32.5)
    assert s["prefill_end->kv_in"] == pytest.approx(11.5)
    assert "registered->prefill_end" not in s
    assert s["transfers"] == 3


def test_mark_is_silent_unless_enabled(monkeypatch: pytest.MonkeyPatch,
                                       caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("kvferry.test.timeline")
    caplog.set_level(logging.INFO, logger=log.name)
    monkeypatch.setattr(timeline, "ENABLED", False)
    timeline.mark(log, "t1", "kv_in", 5.0)
    assert not caplog.records
    monkeypatch.setattr(timeline, "ENABLED", True)
    timeline.mark(log, "t1", "kv_in", 5.0)
    timeline.mark(log, "", "kv_in", 5.0)  # no transfer id: nothing to join on
    assert [r.getMessage() for r in caplog.records] == ["kvferry-timeline t1 kv_in 5.000000"]


def test_decode_scheduler_marks_kv_seen_then_scheduled(monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(timeline, "ENABLED", True)
    caplog.set_level(logging.INFO)
    d = TransferScheduler("D0", "10.0.0.2", 5700, 16)
    prompt = list(range(40))
    params = {"do_remote_prefill": True, "push": True, "transfer_id": "tx",
              "remote_host": "10.0.0.1", "remote_port": 5600}
    for req in ("r1", "r2"):
        assert d.matched_tokens(req, prompt, {**params, "transfer_id": f"tx-{req}"}, 0) == (40, True)
        d.after_alloc(req, [1, 2, 3], 40)
    d.worker_done(set(), {"r1", "r2"})
    d.note_scheduled({"r1": (39, 1), "other": (0, 5)})
    d.finished("r2", False, [], None, prompt)  # aborted before its first step: forgotten
    assert not d.landed
    got = timeline.parse(r.getMessage() for r in caplog.records)
    assert set(got["tx-r1"]) == {"kv_seen", "scheduled"}
    assert set(got["tx-r2"]) == {"kv_seen"}
    # Its first token: marked once, after the step that produced it was processed.
    d.push.note_outputs({"r1": 0}.get)  # the step is still running
    assert d.push.stepping == {"r1": "tx-r1"}
    d.push.note_outputs({"r1": 1}.get)
    d.push.note_outputs({"r1": 2}.get)
    assert not d.push.stepping
    got = timeline.parse(r.getMessage() for r in caplog.records)
    assert set(got["tx-r1"]) == {"kv_seen", "scheduled", "d_token_out"}
    assert got["tx-r1"]["d_token_out"] >= got["tx-r1"]["scheduled"]


def test_first_token_mark_forgets_requests_that_ended(monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(timeline, "ENABLED", True)
    caplog.set_level(logging.INFO)
    d = TransferScheduler("D0", "10.0.0.2", 5700, 16)
    prompt = list(range(40))
    for req in ("r1", "r2"):
        params = {"do_remote_prefill": True, "push": True, "transfer_id": f"tx-{req}",
                  "remote_host": "10.0.0.1", "remote_port": 5600}
        assert d.matched_tokens(req, prompt, params, 0) == (40, True)
        d.after_alloc(req, [1, 2, 3], 40)
    d.worker_done(set(), {"r1", "r2"})
    d.note_scheduled({"r1": (39, 1), "r2": (39, 1)})
    d.finished("r1", False, [], None, prompt)  # aborted in its first step
    d.push.note_outputs({}.get)  # r2 left vLLM's scheduler without a token
    assert not d.push.stepping
    got = timeline.parse(r.getMessage() for r in caplog.records)
    assert "d_token_out" not in got["tx-r1"] and "d_token_out" not in got["tx-r2"]

