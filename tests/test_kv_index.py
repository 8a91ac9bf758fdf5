"""router/fleet/kv_index.py (pure) and router/fleet/kv_events.py's subscriber, fed by vLLM's own
ZmqEventPublisher and event classes over real ZMQ."""

from __future__ import annotations

import asyncio
import time

import pytest
from helpers_http import OPERATOR, free_port

from kvferry.router.fleet.kv_events import KvEventSubscriber, decode_batch, prompt_tokens
from kvferry.router.fleet.kv_index import EngineIndex, PrefixIndex, chain, choose
from kvferry.router.metrics import RouterMetrics

BS = 4
TOKS = list(range(100, 124))  # 6 blocks


def stored(hashes, parent, tokens, **kw) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": BS, "lora_id": None, "medium": "GPU",
            "lora_name": None, **kw}


def test_chain_matches_blocks_stored_in_pieces():
    idx = PrefixIndex()
    # vLLM stores a prompt's blocks over several steps, each event naming its parent.
    idx.apply("p", [stored([b"h0", b"h1"], None, TOKS[:8])])
    idx.apply("p", [stored([b"h2", b"h3"], b"h1", TOKS[8:16])])
    assert idx.matched_tokens("p", TOKS) == 16
    assert idx.matched_tokens("p", TOKS[:10]) == 8  # only full blocks of the request
    other = list(TOKS)
    other[5] += 1
    assert idx.matched_tokens("p", other) == 4  # diverges in block 1
    assert idx.matched_tokens("q", TOKS) == 0  # another engine
    # A parent the index never saw (events missed): that chain cannot be followed.
    idx.apply("p", [stored([b"x1"], b"unknown", TOKS[16:20])])
    assert idx.matched_tokens("p", TOKS) == 16


def test_removals_clears_and_filters():
    idx = PrefixIndex()
    idx.apply("p", [stored([b"h0", b"h1", b"h2"], None, TOKS[:12])])
    idx.apply("p", [{"type": "BlockRemoved", "block_hashes": [b"h1"], "medium": "GPU"}])
    assert idx.matched_tokens("p", TOKS) == 4  # the chain breaks at the evicted block
    idx.apply("p", [{"type": "AllBlocksCleared"}])
    assert idx.matched_tokens("p", TOKS) == 0 and len(idx.engine("p")) == 0
    # Blocks holding other KV for the same tokens never count.
    for odd in ({"lora_name": "adapter"}, {"extra_keys": [("salt",)]}, {"group_idx": 1},
                {"medium": "CPU"}):
        idx.apply("r", [stored([b"a0"], None, TOKS[:4], **odd)])
        assert idx.matched_tokens("r", TOKS) == 0, odd
    idx.apply("r", [stored([b"a0"], None, TOKS[:4], extra_keys=[None], group_idx=0)])
    assert idx.matched_tokens("r", TOKS) == 4
    # Junk is ignored, not an error.
    assert idx.apply("r", [None, {"type": "BlockStored"}, {"type": "Nope"},
                           stored([b"z"], None, [1])]) == 0


def test_the_same_block_stored_twice_counts_once_and_shared_hashes_are_refcounted():
    idx = EngineIndex()
    idx.stored([b"h0"], None, TOKS[:4], BS)
    idx.stored([b"h0"], None, TOKS[:4], BS)  # re-stored (a prefix-cache reuse event)
    assert len(idx) == 1
    idx.stored([b"g0"], None, TOKS[:4], BS)  # another physical block, same tokens
    idx.removed([b"h0"])
    assert idx.matched_blocks(chain(TOKS, BS)) == 1  # still held by g0
    idx.removed([b"g0"])
    assert idx.matched_blocks(chain(TOKS, BS)) == 0


def test_bounded_by_lru():
    idx = EngineIndex(max_blocks=3)
    idx.stored([b"h0", b"h1", b"h2"], None, TOKS[:12], BS)
    idx.stored([b"k0"], None, [7, 7, 7, 7], BS)
    assert len(idx) == 3 and idx.matched_blocks(chain(TOKS, BS)) == 0  # h0 aged out first
    assert idx.matched_blocks(chain([7, 7, 7, 7], BS)) == 1


def test_choice_weighs_held_tokens_with_load():
    # 1000-token prompt; A holds 800 of it, B none.
    assert choose({"A": 0, "B": 0}, {"A": 800, "B": 0}, 1000, 100.0) == "A"
    assert choose({"A": 5, "B": 0}, {"A": 800, "B": 0}, 1000, 100.0) == "A"  # 700 < 1000
    assert choose({"A": 9, "B": 0}, {"A": 800, "B": 0}, 1000, 100.0) == "B"  # 1100 > 1000
    assert choose({"A": 0, "B": 0}, {"A": 0, "B": 0}, 1000, 100.0) is None  # nobody holds any
    assert choose({"A": 1, "B": 1}, {"A": 400, "B": 400}, 1000, 0.0) in ("A", "B")
    assert choose({"A": 0, "B": 0}, {"A": 400, "B": 600}, 1000, 0.0) == "B"
    assert choose({}, {}, 10, 1.0) is None


def test_prompt_tokens_and_batches():
    assert prompt_tokens({"prompt": [1, 2]}) == [1, 2]
    for odd in ({"prompt": "text"}, {"prompt": [True]}, {"messages": []}, {"prompt": []}):
        assert prompt_tokens(odd) is None
    assert decode_batch(b"\xc1") is None and decode_batch(b"\x93\x01\x02\x03") is None


def test_subscriber_reads_vllm_s_own_publisher():
    """vLLM's ZmqEventPublisher and event classes (vllm/distributed/kv_events.py) on one
    side, the router's subscriber on the other, over real ZMQ on loopback."""
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    port = free_port()
    pub = kv_events.ZmqEventPublisher(0, endpoint=f"tcp://*:{port}")  # binds, as engines do
    index, metrics = PrefixIndex(), RouterMetrics()

    def batch(*events):
        return kv_events.KVEventBatch(ts=time.time(), events=list(events))

    block = kv_events.BlockStored(block_hashes=[b"\x01" * 32, b"\x02" * 32],
                                  parent_block_hash=None, token_ids=TOKS[:8], block_size=BS,
                                  lora_id=None, medium="GPU", lora_name=None, group_idx=0)

    async def go() -> None:
        sub = KvEventSubscriber(index, metrics, {"http://p": "prefill-0"})
        task = asyncio.create_task(sub.run({"http://p": f"tcp://127.0.0.1:{port}"}))
        try:
            end = time.monotonic() + 10
            while index.matched_tokens("http://p", TOKS) < 8:  # slow joiner: resend
                assert time.monotonic() < end, "no event arrived"
                pub.publish(batch(block))
                await asyncio.sleep(0.1)
            pub.publish(batch(kv_events.BlockRemoved(block_hashes=[b"\x02" * 32], medium="GPU")))
            while index.matched_tokens("http://p", TOKS) != 4:
                assert time.monotonic() < end, "removal not applied"
                await asyncio.sleep(0.02)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            sub.close()

    try:
        asyncio.run(go())
    finally:
        pub.shutdown()
    assert metrics.registry.get_sample_value("kvferry_router_kv_index_blocks",
                                             {"prefill": "prefill-0"}) == 1


def test_a_restarted_engine_starts_empty_and_gaps_are_counted():
    index, metrics = PrefixIndex(), RouterMetrics()
    sub = KvEventSubscriber(index, metrics, {"p": "prefill-0"})
    import msgspec

    def frame(seq: int, *events: dict) -> list[bytes]:
        return [b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode([1.0, list(events), None])]

    sub.handle("p", frame(0, stored([b"h0"], None, TOKS[:4])))
    sub.handle("p", frame(3, stored([b"h1"], b"h0", TOKS[4:8])))
    assert index.matched_tokens("p", TOKS) == 8
    assert metrics.registry.get_sample_value("kvferry_router_kv_events_total",
                                             {"prefill": "prefill-0", "result": "gap"}) == 2
    sub.handle("p", frame(0))  # sequence restarted: a new engine process
    assert index.matched_tokens("p", TOKS) == 0
    sub.handle("p", [b"only one frame"])
    assert metrics.registry.get_sample_value("kvferry_router_kv_events_total",
                                             {"prefill": "prefill-0", "result": "malformed"}) == 1
    sub.close()


def test_router_sends_token_prompts_to_the_prefill_holding_them():
    """The app's subscription and choice: two FAKE prefill engines, each with a real vLLM
    ZmqEventPublisher announcing what it holds; a FAKE decode engine."""
    from contextlib import ExitStack

    import httpx
    from helpers_http import FakeEngine, serve

    from kvferry.router.api.app import create_app
    from kvferry.router.settings import RouterSettings

    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    params = {"do_remote_prefill": True, "remote_block_ids": [1], "remote_engine_id": "p",
              "remote_host": "127.0.0.1", "remote_port": 1}
    ps = [FakeEngine(f"p{i}", kv_params=params) for i in range(2)]
    d = FakeEngine("d0")
    ports = [free_port(), free_port()]
    pubs = [kv_events.ZmqEventPublisher(0, endpoint=f"tcp://*:{p}") for p in ports]
    toks = list(range(1000, 1000 + 8 * BS))
    with ExitStack() as es:
        for pub in pubs:
            es.callback(pub.shutdown)
        purls = [es.enter_context(serve(p.app())) for p in ps]
        durl = es.enter_context(serve(d.app()))
        with pytest.raises(ValueError, match="KV event endpoint"):
            RouterSettings(prefill_urls=purls, decode_urls=[durl],
                           prefill_kv_events=["tcp://127.0.0.1:1"])
        app = create_app(RouterSettings(
            prefill_urls=purls, decode_urls=[durl], health_interval_s=0, kv_aware_load_tokens=8,
            prefill_kv_events=[f"tcp://127.0.0.1:{p}" for p in ports]))
        url = es.enter_context(serve(app))
        index = app.state.kv_index
        block = kv_events.BlockStored(block_hashes=[bytes([i]) * 32 for i in range(6)],
                                      parent_block_hash=None, token_ids=toks[:6 * BS],
                                      block_size=BS, lora_id=None, medium="GPU",
                                      lora_name=None, group_idx=0)
        end = time.monotonic() + 10
        while index.matched_tokens(purls[1], toks) < 6 * BS:  # slow joiner: resend
            assert time.monotonic() < end, "the router never learnt what p1 holds"
            pubs[1].publish(kv_events.KVEventBatch(ts=time.time(), events=[block]))
            time.sleep(0.1)

        def send(prompt) -> str:
            r = httpx.post(url + "/v1/completions", timeout=10, headers=OPERATOR,
                           json={"model": "tiny", "prompt": prompt, "max_tokens": 2})
            assert r.status_code == 200, r.text
            return r.headers["x-kvferry-prefill"]

        assert [send(toks) for _ in range(3)] == [purls[1]] * 3  # not round-robin
        assert {send(list(range(5, 5 + 8 * BS))) for _ in range(2)} == set(purls)  # no match
        assert send("a text prompt") in purls
        # Load counts: p1 lacks 8 of the 32 tokens, p0 all 32; each request in flight
        # weighs 8 tokens (kv_aware_load_tokens).
        app.state.pools["prefill"].get(purls[1]).in_flight = 2
        assert send(toks) == purls[1]  # 8 lacking + 16 for its load < 32 for p0
        app.state.pools["prefill"].get(purls[1]).in_flight = 4
        assert send(toks) == purls[0]  # 8 + 32 > 32
        app.state.pools["prefill"].get(purls[1]).in_flight = 0
        reg = app.state.metrics.registry
        assert reg.get_sample_value("kvferry_router_kv_aware_choices_total",
                                    {"result": "match"}) == 5
