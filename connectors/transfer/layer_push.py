"""How P posts a push WRITE, chosen once per request: whole (`WholeWrite`), or layer-wise
(`LayeredWrite`).

Layer-wise push, P: WRITE each layer of a prompt's KV as soon as the forward computing
its last chunk has written that layer, so the copy overlaps the rest of the forward.

The engine thread records a fence per layer in ``save_kv_layer`` (`LayerFence`: a CUDA
event behind that layer's attention; None on CPU, whose forward runs synchronously); the
transfer thread posts, at each poll, one WRITE per D rank covering every layer whose fence
has passed (their planes only, runs of blocks merged as usual). Earlier chunks' KV is
complete already, so a layer's WRITE takes all of the prompt's blocks for that layer.

D is told (`messages.Wrote`, one per D rank, exactly as for a whole-request WRITE) only
when every layer's WRITE is complete *and* the request's `Gate` opened: the whole forward
is done and a later engine step has begun, whose metadata would have named the request if
vLLM preempted it (early push's rule, protocol/push_sender.py). A preempted request's layers may
already have landed in D's blocks: D is rejected and keeps those blocks quarantined, as
after any failed WRITE, and never reads them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvferry.connectors.memory.backends import KVLayout
from kvferry.connectors.protocol import timeline
from kvferry.connectors.protocol.push_sender import Gate
from kvferry.connectors.protocol.step import PushSend
from kvferry.connectors.protocol.tp_map import Segment
from kvferry.connectors.transfer.stats import Stats
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


class Forwards:
    """Early and layer-wise push: the whole-forward fences handed over, per engine step."""

    def __init__(self) -> None:
        self._by_step: dict[int, list[Ready]] = {}

    def add(self, r: Ready) -> None:
        self._by_step.setdefault(r.step, []).append(r)

    def passed(self) -> set[int]:
        """The steps whose forward is complete on the device."""
        return {s for s, rs in self._by_step.items() if all(r.forward_done() for r in rs)}

    def keep_only(self, steps: set[int]) -> None:
        self._by_step = {s: rs for s, rs in self._by_step.items() if s in steps}

    def __len__(self) -> int:
        return len(self._by_step)


def layerwise_possible(layout: KVLayout, backends: Sequence[str]) -> bool:
    """Layer-wise push needs the layout's planes per layer, and UCX alone, whose transfers
    complete only once flushed to the target (the Wrote notification goes out after them,
    on its own)."""
    return len(layout.layers) > 1 and set(backends) == {"UCX"}


@dataclass
class WholeWrite:
    """One request's WRITE to every D rank it goes to, posted at once, each transfer with
    D's notification after its data (the forward is complete: nothing to wait for)."""

    targets: list[tuple[Peer, Sequence[Segment] | None]]  # D rank's peer, head segments
    src: tuple[int, ...]
    dest: tuple[int, ...]
    note: bytes  # the Wrote notification, sent by each transfer once its data landed
    fence_step: int | None = None  # no layer fences needed

    def start(self, transport: Transport) -> list[Transfer]:
        """Post every target's WRITE; if one fails, release those posted (NIXL aborts them;
        nothing was reported to D) and raise."""
        xfers: list[Transfer] = []
        try:
            for peer, segs in self.targets:
                xfers.append(transport.start("WRITE", peer, self.src, self.dest, self.note,
                                             seg=None if segs is None else (segs, True)))
        except Exception:
            for x in xfers:
                transport.release(x)
            raise
        return xfers

    def post(self, transport: Transport, fences: Fences) -> list[Transfer]:
        return []  # all posted at start

    def committable(self) -> bool:
        return True

    def commit(self, transport: Transport, stats: Stats) -> None:
        """Each transfer carried its own notification: nothing left to tell D."""


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

    @property
    def fence_step(self) -> int | None:
        """The step whose layer fences are still needed (None: every layer posted)."""
        return self.gate.step if self.pending else None

    def start(self, transport: Transport) -> list[Transfer]:
        return []  # layers are posted as their fences pass (`post`)

    def post(self, transport: Transport, fences: Fences) -> list[Transfer]:
        """Post every pending layer that is written now (all of them once the forward is
        done); the new transfers, one per target. Raises if a post fails (the caller
        releases what was posted and fails the WRITE)."""
        if not self.pending:
            return []
        whole = self.gate.forward_done
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

    def commit(self, transport: Transport, stats: Stats) -> None:
        """Every layer's WRITE completed (NIXL flushes each transfer to its target before
        reporting it done): tell each D rank, as a whole-request WRITE's notification.
        Counted first: once D is told, the count already says so."""
        stats.add("layered_writes")
        stats.add("layers_posted_early", self.posted_early)
        stats.add("layer_batches", self.batches)
        for peer, _ in self.targets:
            transport.notify(peer, self.note)


Posting = WholeWrite | LayeredWrite


def posting_for(gate: Gate | None, targets: list[tuple[Peer, Sequence[Segment] | None]],
                src: tuple[int, ...], dest: tuple[int, ...], note: bytes,
                num_layers: int) -> Posting:
    """How one request's WRITE is posted, chosen once when it starts: layer by layer if
    matched while its last chunk's forward runs (``gate``, from `PushSender`), else whole."""
    if gate is None:
        return WholeWrite(targets, src, dest, note)
    return LayeredWrite(gate, targets, src, dest, note, pending=list(range(num_layers)))
