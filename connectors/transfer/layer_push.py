"""Layer-wise push, P: WRITE each layer of a prompt's KV as soon as the forward computing
its last chunk has written that layer, so the copy overlaps the rest of the forward.

The engine thread records a fence per layer in ``save_kv_layer`` (`LayerFence`: a CUDA
event behind that layer's attention; None on CPU, whose forward runs synchronously); the
transfer thread posts, at each poll, one WRITE per D rank covering every layer whose fence
has passed (their planes only, runs of blocks merged as usual). Earlier chunks' KV is
complete already, so a layer's WRITE takes all of the prompt's blocks for that layer.

D is told (`messages.Wrote`, one per D rank, exactly as for a whole-request WRITE) only
when every layer's WRITE is complete *and* the request's `Gate` opened: the whole forward
is done and a later engine step has begun, whose metadata would have named the request if
vLLM preempted it (early push's rule, push_write.py). A preempted request's layers may
already have landed in D's blocks: D is rejected and keeps those blocks quarantined, as
after any failed WRITE, and never reads them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvferry.connectors.protocol import timeline
from kvferry.connectors.protocol.step import PushSend
from kvferry.connectors.protocol.tp_map import Segment
from kvferry.connectors.transfer.transport import Peer, Transfer, Transport

log = logging.getLogger("vllm." + __name__)

_NO_FENCE = object()  # save_kv_layer has not reported this layer yet


@dataclass
class LayerFence:
    """Engine step ``step`` has written layer ``layer``'s KV once ``fence`` passes
    (``.query()`` -> bool; None: already written)."""

    step: int
    layer: int
    fence: Any


def _passed(fence: Any) -> bool:
    return fence is None or bool(fence.query())


@dataclass
class Ready:
    """Early push: prompts completed by engine step ``step``, once ``fence`` passes."""

    items: list[PushSend]
    fence: Any  # .query() -> bool, or None (already complete)
    step: int

    def forward_done(self) -> bool:
        return _passed(self.fence)

    def done(self, steps_begun: int) -> bool:
        return steps_begun > self.step and self.forward_done()


@dataclass
class Gate:
    """A push prompt whose last chunk engine step ``step`` computes, written layer by
    layer. ``opened``: the forward is done, a later step began and its metadata was read
    without a preemption of this request (set by the writer after draining its inbox)."""

    item: PushSend
    step: int
    since: float  # monotonic: a gate whose forward never reports is dropped in time
    ready: Ready | None = None  # the forward's own fence, from wait_for_save
    opened: bool = False

    def forward_done(self) -> bool:
        return self.ready is not None and self.ready.forward_done()

    def may_open(self, steps_begun: int) -> bool:
        return self.ready is not None and self.ready.done(steps_begun)


class Fences:
    """The layer fences ``save_kv_layer`` recorded, per engine step."""

    def __init__(self) -> None:
        self._by_step: dict[int, dict[int, Any]] = {}

    def add(self, f: LayerFence) -> None:
        self._by_step.setdefault(f.step, {})[f.layer] = f.fence

    def passed(self, step: int, layers: Sequence[int]) -> list[int]:
        """Those of ``layers`` whose fence in step ``step`` was recorded and has passed."""
        fences = self._by_step.get(step, {})
        return [la for la in layers if (f := fences.get(la, _NO_FENCE)) is not _NO_FENCE
                and _passed(f)]

    def keep_only(self, steps: set[int]) -> None:
        for s in [s for s in self._by_step if s not in steps]:
            del self._by_step[s]

    def __len__(self) -> int:
        return len(self._by_step)


@dataclass
class LayeredWrite:
    """One request's WRITE to every D rank it goes to, posted in batches of layers."""

    gate: Gate
    targets: list[tuple[Peer, Sequence[Segment] | None]]  # D rank's peer, head segments
    src: tuple[int, ...]
    dest: tuple[int, ...]
    note: bytes  # the Wrote notification, sent to every target on commit
    pending: list[int] = field(default_factory=list)  # layers not posted yet
    posted_early: int = 0  # layers posted before the whole forward was done
    batches: int = 0

    def post(self, transport: Transport, fences: Fences) -> list[Transfer]:
        """Post every pending layer that is written now (all of them once the forward is
        done); the new transfers, one per target. Raises if a post fails (the caller
        releases what was posted and fails the WRITE)."""
        if not self.pending:
            return []
        whole = self.gate.forward_done()
        ready = list(self.pending) if whole else fences.passed(self.gate.step, self.pending)
        if not ready:
            return []
        planes = sorted(p for la in ready for p in transport.layout.layers[la])
        new: list[Transfer] = []
        try:
            for peer, segs in self.targets:
                new.append(transport.start("WRITE", peer, self.src, self.dest, b"",
                                           seg=None if segs is None else (segs, True),
                                           planes=planes))
        except Exception:
            for x in new:
                transport.release(x)
            raise
        done = set(ready)
        self.pending = [la for la in self.pending if la not in done]
        self.posted_early += 0 if whole else len(ready)
        self.batches += 1
        tid = self.gate.item.transfer_id
        if self.batches == 1:
            timeline.mark(log, tid, "first_layer_posted")
        if not self.pending:
            timeline.mark(log, tid, "last_layer_posted")
        return new

    def committable(self) -> bool:
        """Every layer posted and the gate open: once the transfers are complete, D may
        be told."""
        return not self.pending and self.gate.opened

    def commit(self, transport: Transport) -> None:
        """Every layer's WRITE completed (NIXL flushes each transfer to its target before
        reporting it done): tell each D rank, as a whole-request WRITE's notification."""
        for peer, _ in self.targets:
            transport.notify(peer, self.note)
