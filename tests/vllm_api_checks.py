"""kvferry against one vLLM version's real Python code (run by test_vllm_versions.py): the
connector class against this version's base class and factory, the plugin entry point,
compat on this version's objects, attention backends' KV heads, sleep mode refused, and
few large descriptors through cross-layer blocks.

test_vllm_versions.py starts pytest on these files once per supported version, with the
version's sources (fetched by .ci/setup) first on PYTHONPATH, so every vLLM object here is
that version's own. No engine starts and no compiled vLLM extension is needed."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import helpers_vllm_api
import pytest
import torch
import vllm
from helpers_vllm_api import (
    ABSTRACT,
    BS,
    NUM_BLOCKS,
    PROMPT,
    VERSION,
    kv_cache_config,
    request,
    scheduler,
    vllm_config,
)
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1 import base
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from kvferry.connectors import compat
from kvferry.connectors.connector import KvferryConnector
from kvferry.connectors.memory.backends import CpuBackend
from kvferry.connectors.transfer import layout
from kvferry.scripts.modelgen import SHAPES

_secret = helpers_vllm_api._secret
tiny = helpers_vllm_api.tiny


# -- the version and the class -----------------------------------------------------------------
def test_runs_the_expected_vllm():
    assert vllm.__version__ == os.environ["KVFERRY_EXPECT_VLLM"]
    if src := os.environ.get("KVFERRY_VLLM_SRC"):  # that version's sources, not the venv's
        assert Path(vllm.__file__).resolve().is_relative_to(Path(src).resolve())


def test_connector_implements_this_versions_base_class():
    assert set(base.KVConnectorBase_V1.__abstractmethods__) == ABSTRACT
    assert issubclass(KvferryConnector, base.KVConnectorBase_V1)
    assert not KvferryConnector.__abstractmethods__


def _kind(obj: Any) -> str:
    return type(obj).__name__ if isinstance(obj, property | classmethod | staticmethod) else "method"


def test_every_override_matches_the_base_signature():
    """vLLM calls these by position and keyword: ours must take whatever it passes."""
    checked = []
    for name, ours in vars(KvferryConnector).items():
        theirs = inspect.getattr_static(base.KVConnectorBase_V1, name, None)
        if theirs is None or (name.startswith("_") and name != "__init__"):
            continue
        assert _kind(ours) == _kind(theirs), name
        if isinstance(ours, property):
            checked.append(name)
            continue
        po = list(inspect.signature(getattr(KvferryConnector, name)).parameters.values())
        pb = list(inspect.signature(getattr(base.KVConnectorBase_V1, name)).parameters.values())
        var = any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in po)
        for i, p in enumerate(pb):
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                assert any(q.kind == p.kind for q in po), (name, p)
                continue
            assert var or (i < len(po) and po[i].name == p.name), (name, p.name)
        assert all(q.default is not q.empty or q.kind in (q.VAR_POSITIONAL, q.VAR_KEYWORD)
                   for q in po[len(pb):]), name
        checked.append(name)
    assert {"request_finished", "get_finished", "update_connector_output",
            "get_block_ids_with_load_errors", "register_kv_caches", "shutdown"} <= set(checked)
    # version-specific hooks kvferry implements exist exactly where compat says
    assert ("prefer_cross_layer_blocks" in checked) is compat.CROSS_LAYER_HOOKS is (VERSION < (0, 32))
    assert ("supports_sleep_mode" in checked) is compat.SLEEP_MODE_HOOK is (VERSION >= (0, 33))
    assert ("has_pending_block_frees" in checked) is (VERSION >= (0, 32))
    assert compat.LOGICAL_BHNC is (VERSION >= (0, 32))


# -- plugin and factory ------------------------------------------------------------------------
def test_plugin_entry_point_registers_with_this_versions_factory(monkeypatch):
    from importlib.metadata import entry_points

    import vllm.plugins

    from kvferry.connectors.plugin import register

    assert vllm.plugins.DEFAULT_PLUGINS_GROUP == "vllm.general_plugins"  # pyproject's group
    assert any(e.name == "kvferry" for e in entry_points(group="vllm.general_plugins"))
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.delitem(KVConnectorFactory._registry, "KvferryConnector", raising=False)
    vllm.plugins.load_general_plugins()  # what every vLLM process does at start
    assert KVConnectorFactory.get_connector_class_by_name("KvferryConnector") is KvferryConnector
    register()  # loaded again in the same process: no error
    ktc = KVTransferConfig(kv_connector="KvferryConnector", kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(ktc) is KvferryConnector


# -- compat on this version's objects ----------------------------------------------------------
def test_compat_reads_real_scheduler_objects(tiny):
    blocks = KVCacheBlocks(blocks=([KVCacheBlock(block_id=b) for b in (4, 9, 2)],))
    assert compat.request_blocks(blocks) == [4, 9, 2]
    assert compat.first_group(blocks.get_block_ids()) == [4, 9, 2]
    cached = CachedRequestData.make_empty()
    cached.req_ids, cached.resumed_req_ids = ["run", "res", "idle"], {"res"}
    cached.new_block_ids = [([5],), ([7, 8],), None]
    cached.num_computed_tokens = [16, 0, 5]
    new = NewRequestData(req_id="new", prompt_token_ids=PROMPT, mm_features=[],
                         sampling_params=SamplingParams(max_tokens=3), pooling_params=None,
                         block_ids=([1, 2, 3],), num_computed_tokens=32, lora_request=None)
    so = SchedulerOutput.make_empty()
    so.scheduled_new_reqs, so.scheduled_cached_reqs = [new], cached
    so.num_scheduled_tokens = {"run": 16, "res": 20, "new": 8}
    so.total_num_scheduled_tokens = 44
    so.preempted_req_ids = {"gone"}
    assert compat.step_progress(so) == {"run": (16, 16), "res": (0, 20), "new": (32, 8)}
    assert compat.grown_blocks(so) == {"run": ([5], False), "res": ([7, 8], True)}
    assert compat.preempted(so) == {"gone"} and compat.scheduled_tokens(so) == 44

    r = request("r", PROMPT, 5, {"do_remote_decode": True})
    r.append_output_token_ids(11)
    assert compat.all_tokens(r) == [*PROMPT, 11] and compat.max_tokens(r) == 5
    assert r.kv_transfer_params == {"do_remote_decode": True}
    assert {s.name for s in compat.FINISHED_OK} == {"FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED"}

    vc = vllm_config(tiny)
    assert compat.num_blocks(vc, kv_cache_config()) == NUM_BLOCKS
    assert compat.total_kv_heads(vc) == SHAPES["tiny"].num_key_value_heads == json.loads(
        (tiny / "config.json").read_text())["num_key_value_heads"]


def test_kv_heads_dim_of_this_versions_attention_backends():
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    # what each version's FlashAttention tensor is (read from its get_kv_cache_shape)
    want = {(0, 21): 3, (0, 24): 3, (0, 26): 1}.get(VERSION, 1)  # 0.32+: logical [B, H, N, C]
    got = compat.kv_heads_dim(None, {}, FlashAttentionBackend) if VERSION < (0, 32) else \
        compat.kv_heads_dim(None, {"l": None})
    assert got == want
    if VERSION < (0, 32):
        shape = FlashAttentionBackend.get_kv_cache_shape(num_blocks=10, block_size=16,
                                                         num_kv_heads=3, head_size=8)
        assert shape[want] == 3


# -- sleep mode ---------------------------------------------------------------------------------
def test_sleep_mode_is_refused(tiny):
    vc = vllm_config(tiny)
    if compat.SLEEP_MODE_HOOK:  # 0.33: vLLM asks the connector class and refuses the config
        ktc = vc.kv_transfer_config
        assert base.KVConnectorBase_V1.supports_sleep_mode(ktc) is True  # vLLM's default
        assert KvferryConnector.supports_sleep_mode(ktc) is False
        mc = vc.model_config
        mc.enable_sleep_mode = True  # set after ModelConfig's platform check (no GPU here)
        with pytest.raises(ValueError, match="KvferryConnector does not support sleep mode"):
            VllmConfig(device_config=DeviceConfig(device="cpu"), model_config=mc,
                       cache_config=CacheConfig(block_size=BS), kv_transfer_config=ktc)
    vc.model_config.enable_sleep_mode = True
    with pytest.raises(ValueError, match="does not support vLLM sleep mode"):
        scheduler(vc)  # vLLM's factory constructs the connector, whose __init__ refuses
    with pytest.raises(ValueError, match="does not support vLLM sleep mode"):
        KvferryConnector(vc, base.KVConnectorRole.WORKER, kv_cache_config())


# -- few, large descriptors: cross-layer blocks ------------------------------------------------
L, H, D = 4, 2, 8  # layers, KV heads, head size of the KV tensors built below
RUN_LOCAL, RUN_REMOTE = [3, 4, 5, 6], [10, 11, 12, 13]  # one contiguous run of 4 blocks


def _descriptors(kv: dict[str, torch.Tensor], heads_dim: int | None) -> tuple[int, int]:
    """(descriptors for one run of 4 blocks, KV heads located per block)."""
    lay = CpuBackend().describe(kv, NUM_BLOCKS, BS, heads_dim)
    loc, _ = layout.descriptors(lay, lay, RUN_LOCAL, RUN_REMOTE)
    return len(loc), lay.num_heads


def test_block_major_kv(tiny, monkeypatch):
    """One descriptor per run of blocks, on every version: 0.21-0.26 through the V1
    runner's cross-layer tensor, 0.32+ through the block-major layout kvferry asks for."""
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend as FA

    vc = vllm_config(tiny, {"hardware_backend": "cuda"})
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.float16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
    if VERSION < (0, 32):
        from vllm.config import set_current_vllm_config
        from vllm.v1.kv_cache_interface import KVCacheTensor
        from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin as M

        conn = KvferryConnector(vc, base.KVConnectorRole.WORKER, kv_cache_config())
        assert conn.prefer_cross_layer_blocks is True
        assert KvferryConnector.get_required_kvcache_layout(vc) is None  # NHD/HND only here
        monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", conn)
        with set_current_vllm_config(vc):  # the backends read the layout from it
            if "indexes_kv_by_block_stride" in {f.name for f in dataclasses.fields(spec)}:
                # 0.24+: the V1 runner records this per backend (FlashAttention: True)
                spec = dataclasses.replace(spec, indexes_kv_by_block_stride=FA.indexes_kv_by_block_stride())
            groups = [[SimpleNamespace(backend=FA, kv_cache_spec=spec)]]
            uniform_args = (groups, "auto") if "cache_dtype" in inspect.signature(
                M.use_uniform_kv_cache).parameters else (groups,)
            assert M.use_uniform_kv_cache(*uniform_args)  # vLLM honours our preference
            kvc = KVCacheConfig(
                num_blocks=NUM_BLOCKS, kv_cache_groups=[KVCacheGroupSpec(names, spec)],
                kv_cache_tensors=[KVCacheTensor(size=spec.page_size_bytes * NUM_BLOCKS,
                                                shared_by=[n]) for n in names])
            per_layer, cross, backend = M.allocate_uniform_kv_caches(
                kvc, groups, "auto", torch.device("cpu"), [BS])
            heads = compat.kv_heads_dim(vc, {}, backend, cross_layer=True)
        assert _descriptors({"all_layers": cross}, heads) == (1, H)
        # Without it (V2 runner, or prefer_cross_layer_blocks off) every layer is its own
        # tensor shaped as FlashAttention asks: one descriptor per layer and K/V plane.
        shape = FA.get_kv_cache_shape(NUM_BLOCKS, BS, H, D)
        sep = {n: torch.zeros(shape, dtype=torch.float16) for n in names}
        planes = 2 if VERSION < (0, 24) else 1  # 0.21: (2, B, N, H, D); later (B, ...)
        assert _descriptors(sep, compat.kv_heads_dim(vc, {}, FA)) == (L * planes, H)
        assert set(per_layer) == set(names)
        return

    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )
    from vllm.v1.worker.utils import allocate_kv_cache

    try:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    except ImportError:  # 0.33 moved it
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups

    def allocated(backend: Any, extra: dict[str, Any]) -> tuple[str, dict[str, torch.Tensor]]:
        cfg = vllm_config(tiny, extra)
        supported = [[x.name for x in get_supported_kv_cache_layouts([backend])]]
        chosen = resolve_kv_cache_layout(cfg, supported, [spec])  # the engine core's choice
        groups = [KVCacheGroupSpec(names, spec)]
        kvc = get_kv_cache_config_from_groups(cfg, groups, spec.page_size_bytes * L * NUM_BLOCKS)
        assert kvc.num_blocks == NUM_BLOCKS
        return chosen.name, allocate_kv_cache(kvc, torch.device("cpu"), chosen)

    assert KvferryConnector.get_required_kvcache_layout(vc) == compat.BLOCK_MAJOR_LAYOUT
    name, views = allocated(FA, {"hardware_backend": "cuda"})
    assert name == "BLHNC"  # FlashAttention accepts it: vLLM takes kvferry's request
    merged, heads = compat.block_major(views, compat.kv_heads_dim(vc, views))
    assert list(merged) == ["all_layers"] and _descriptors(merged, heads) == (1, H)
    (t,) = merged.values()
    for b in (0, 5):  # the merged block b is exactly every layer's block b, back to back
        starts = sorted(v[b].data_ptr() for v in views.values())
        assert starts[0] == t[b].data_ptr() and t[b].is_contiguous()
        assert starts == [t[b, i].data_ptr() for i in range(L)]
    assert _descriptors(views, 1)[0] == L * len(RUN_LOCAL)  # unmerged: per layer and block

    # CPU engines: no request (CPU attention reads LBHNC only), KV stays layer-major
    assert KvferryConnector.get_required_kvcache_layout(vllm_config(tiny)) is None
    name, views = allocated(CPUAttentionBackend, {})
    assert name == "LBHNC"
    assert compat.block_major(views, 1) == (views, 1)
    assert _descriptors(views, 1) == (L, H)
    cross_off = {"hardware_backend": "cuda", "cross_layer_blocks": False}
    assert KvferryConnector.get_required_kvcache_layout(vllm_config(tiny, cross_off)) is None


# -- detokenizer primed with the prompt's tail (connectors/detokenizer_window.py) ---------------
def test_detokenizer_window_on_this_versions_detokenizer(tiny, monkeypatch):
    from tokenizers import Tokenizer
    from vllm import SamplingParams
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    from kvferry.connectors import detokenizer_window as dw

    monkeypatch.setattr(FastIncrementalDetokenizer, "__init__", FastIncrementalDetokenizer.__init__)
    monkeypatch.setattr(dw, "_installed", None)
    tok = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    backend = SimpleNamespace(_tokenizer=tok)  # what __init__ reads of vLLM's tokenizer
    text = "ferry café 日本語 🚀 " * 12
    ids = tok.encode(text, add_special_tokens=False).ids

    def texts() -> list[str]:
        out = []
        for cut in range(40, len(ids) - 8):
            req = SimpleNamespace(request_id="r", prompt_token_ids=ids[:cut],
                                  sampling_params=SamplingParams(max_tokens=8))
            d = FastIncrementalDetokenizer(backend, req)
            d.update(ids[cut:cut + 8], stop_terminated=False)
            out.append(d.output_text if not tok.decode(ids[:cut]).endswith("\ufffd") else None)
        return out

    whole = texts()
    dw.install(dw.MIN_WINDOW)
    assert texts() == whole and sum(w is not None and w != "" for w in whole) > 40
