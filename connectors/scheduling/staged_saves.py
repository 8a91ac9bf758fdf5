"""Pull with host staging, P side: which blocks must reach the host mirror each step.

D's READ is one-sided: it copies P's registered memory, which under host staging is the
pinned DRAM mirror, not the device KV. So the mirror must hold a request's prompt KV
before P publishes the offer (`TransferScheduler.finished`, right after the step whose
forward computed the prompt). The scheduler tracks the blocks of P-role pull requests
here and, each step, lists the blocks that step's forward writes (`StepMeta.save`); the
worker copies them device -> host in ``wait_for_save``, after the forward and before the
step's output (and so the offer) reaches the scheduler.

Positions, not whole requests: a step that computes tokens ``[computed, computed + n)``
writes blocks ``computed // bs`` up to ``ceil((computed + n) / bs)``, so chunked prefill
stages each block about once instead of the whole request every chunk. A request's
first staged step starts at block 0: prefix-cache hits are on the device but their
mirror blocks may hold whatever the previous owner of the block left there.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass
class _Saving:
    blocks: list[int]
    staged: int = 0  # leading blocks already full and copied to the mirror


class SaveTracker:
    """P with host staging: the blocks each step's forward writes, to be copied to the host
    mirror before the offer over them is published."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._reqs: dict[str, _Saving] = {}

    def allocated(self, req_id: str, block_ids: Sequence[int]) -> None:
        """All blocks of the request after (re)allocation: a resumed request starts over."""
        self._reqs[req_id] = _Saving(list(block_ids))

    def grew(self, grown: Mapping[str, tuple[Sequence[int], bool]]) -> None:
        """Blocks vLLM added to running requests (chunked prefill): ``(ids, replace)``."""
        for req_id, (ids, replace) in grown.items():
            s = self._reqs.get(req_id)
            if s is None:
                continue
            if replace:
                self._reqs[req_id] = _Saving(list(ids))
            else:
                s.blocks.extend(ids)

    def step(self, progress: Mapping[str, tuple[int, int]]) -> list[int]:
        """Blocks written by this step: ``progress`` maps req id -> (computed, scheduled)."""
        out: list[int] = []
        for req_id, (computed, n) in progress.items():
            s = self._reqs.get(req_id)
            if s is None or n <= 0:
                continue
            end = computed + n
            hi = min(len(s.blocks), -(-end // self.block_size))
            lo = min(s.staged, computed // self.block_size)
            out += s.blocks[lo:hi]
            s.staged = max(s.staged, min(hi, end // self.block_size))
        return out

    def drop(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self._reqs.pop(req_id, None)
