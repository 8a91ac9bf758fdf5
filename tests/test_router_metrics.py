"""The router's metric families look each label set up once (`metrics._Memo`, issue 33):
what /metrics shows must be what the library's own lookup would have shown."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvferry.router.metrics import RouterMetrics


def _samples(m: RouterMetrics, name: str) -> dict[tuple, float]:
    return {tuple(sorted(s.labels.items())): s.value
            for fam in text_string_to_metric_families(m.render().decode())
            for s in fam.samples if s.name == name}


def test_memoized_children_count_and_forget_removed_label_sets() -> None:
    m = RouterMetrics()
    for _ in range(3):
        m.errors.labels(endpoint="completions", leg="decode", kind="timeout").inc()
    m.errors.labels(leg="decode", endpoint="completions", kind="timeout").inc()  # other order
    m.in_flight.labels(role="decode", upstream="d0").set(5)
    assert m.errors.labels(endpoint="completions", leg="decode", kind="timeout") is \
        m.errors.labels(endpoint="completions", leg="decode", kind="timeout")
    assert _samples(m, "kvferry_router_errors_total") == {
        (("endpoint", "completions"), ("kind", "timeout"), ("leg", "decode")): 4.0}
    m.in_flight.remove("decode", "d0")  # an engine left the fleet
    assert _samples(m, "kvferry_router_upstream_in_flight") == {}
    m.in_flight.labels(role="decode", upstream="d0").set(1)  # a fresh child, exported again
    assert _samples(m, "kvferry_router_upstream_in_flight") == {
        (("role", "decode"), ("upstream", "d0")): 1.0}
