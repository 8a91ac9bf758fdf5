"""Neuron path, describing KV: NRT tensors and vllm-neuron's torch tensors become the
regions kvferry registers; bad input is refused with a clear error; config and env.

Against a FAKE libnrt (tests/fakes/fake_libnrt.c) and CPU stand-in tensors; the fake is as
strict as the real runtime where it matters (tests/helpers_neuron.py)."""

from __future__ import annotations

import ctypes

import helpers_neuron
import pytest
import torch
from helpers_neuron import BLOCK_BYTES, BS, DIM, ES, HEADS, NB, View, hnd, kv_pair

from kvferry.connectors.config import ConnectorConfig
from kvferry.connectors.memory.backends import VRAM
from kvferry.connectors.memory.registry import get_backend
from kvferry.neuron import libnrt
from kvferry.neuron.arrays import NeuronArray
from kvferry.neuron.backend import ENV_STAGING, NeuronBackend
from kvferry.neuron.libnrt import NrtTensor

fake_lib = helpers_neuron.fake_lib
runtime = helpers_neuron.runtime
nrt = helpers_neuron.nrt
private = helpers_neuron.private


# -- describe -------------------------------------------------------------------------------
def test_get_backend_neuron_is_lazy_import() -> None:
    b = get_backend("neuron")
    assert isinstance(b, NeuronBackend)
    assert (b.name, b.mem_type, b.default_nixl_backends) == ("neuron", VRAM, ("LIBFABRIC",))
    assert b.may_stage and b.copy is None  # auto may end host-staged; default copies


def test_describe_kv_pairs(nrt: libnrt.Libnrt) -> None:
    caches = {"layer.0": kv_pair(nrt, 0), "layer.1": kv_pair(nrt, 5)}
    b = NeuronBackend(staging="device")
    layout = b.describe(caches, NB, BS)
    assert b.mode == "device" and b.nixl_backends == ("LIBFABRIC",)
    tensors = [t for kv in caches.values() for t in kv]
    assert [r.addr for r in layout.regions] == [t.va for t in tensors]
    assert all(r.length == NB * BLOCK_BYTES and r.mem_type == VRAM for r in layout.regions)
    assert [r.device_id for r in layout.regions] == [0, 0, 5, 5]
    assert [p.region for p in layout.planes] == [0, 1, 2, 3]  # L0.K, L0.V, L1.K, L1.V
    for p, t in zip(layout.planes, tensors, strict=True):
        assert (p.base, p.stride, p.block_bytes, p.num_blocks) == (t.va, BLOCK_BYTES, BLOCK_BYTES, NB)
        assert p.block_addr(3) == t.va + 3 * BLOCK_BYTES
    assert layout.signature()[0] == BS
    assert [nbytes for nbytes, _fmt in layout.signature()[1]] == [BLOCK_BYTES] * 4


def test_torch_tensors_describe_like_vllm_neuron_hands_them() -> None:
    """Point 2: one HND tensor per layer, as vllm-neuron's runner registers them; the
    addresses are data_ptr() (what upstream's NixlConnector registers)."""
    caches = {"l0": hnd(seed=1), "l1": hnd(seed=2)}
    b = NeuronBackend(staging="device")
    heads_dim = b.kv_heads_dim(caches)
    layout = b.describe(caches, NB, 32, heads_dim)
    block = HEADS * 32 * DIM * ES
    assert heads_dim == 2 and layout.num_heads == HEADS
    assert [r.addr for r in layout.regions] == [t.data_ptr() for t in caches.values()]
    assert all(r.mem_type == VRAM and r.length == 2 * NB * block for r in layout.regions)
    assert [(p.base, p.stride, p.block_bytes) for p in layout.planes] == [
        (t[kv].data_ptr(), block, block) for t in caches.values() for kv in (0, 1)]
    p = layout.planes[3]  # l1's V plane, block 5: exactly the tensor's bytes
    want = caches["l1"][1, 5].contiguous().view(torch.uint8).numpy().tobytes()
    assert ctypes.string_at(p.block_addr(5), p.block_bytes) == want


def test_raw_handle_is_size_only(nrt: libnrt.Libnrt) -> None:
    h = nrt.tensor_allocate(NB * 256, vnc=1)
    b = NeuronBackend(staging="device", default_vnc=1)
    layout = b.describe({"l0": (ctypes.c_void_p(h), ctypes.c_void_p(h))}, NB, BS)
    assert len(layout.regions) == 1 and layout.regions[0].device_id == 1  # same memory twice
    assert [(p.stride, p.block_bytes) for p in layout.planes] == [(256, 256), (256, 256)]
    nrt.tensor_free(h)


def test_protocol_objects_and_shared_allocation(nrt: libnrt.Libnrt) -> None:
    nbytes = 2 * NB * BLOCK_BYTES
    t = NrtTensor.allocate((nbytes,), 1, vnc=4, lib=nrt)
    half = NB * BLOCK_BYTES
    combined = View(t.va, (2, NB, BS, HEADS, DIM), ES, 4, nbytes)
    k = View(t.va, (NB, BS, HEADS, DIM), ES, 4, half)
    v = View(t.va + half, (NB, BS, HEADS, DIM), ES, 4, half)
    assert isinstance(k, NeuronArray)
    b = NeuronBackend(staging="device")
    lay = b.describe({"a": combined, "b": (k, v)}, NB, BS)
    assert len(lay.regions) == 1 and lay.regions[0].length == nbytes
    assert [p.base for p in lay.planes] == [t.va, t.va + half, t.va, t.va + half]
    # (num_blocks, kv_heads, block_size, head_dim) with a padded block stride
    padded = View(t.va, (NB // 2, HEADS, BS, DIM), ES, 4, nbytes,
                  strides=(2 * BLOCK_BYTES, BS * DIM * ES, DIM * ES, ES))
    lay = NeuronBackend(staging="device").describe({"p": padded}, NB // 2, BS)
    assert (lay.planes[0].stride, lay.planes[0].block_bytes) == (2 * BLOCK_BYTES, BLOCK_BYTES)
    t.free()


def test_describe_errors(nrt: libnrt.Libnrt) -> None:
    b = NeuronBackend(staging="device")
    with pytest.raises(TypeError, match="not a Neuron KV array"):
        b.describe({"l": object()}, NB, BS)
    with pytest.raises(TypeError, match="torch tensor on meta"):
        b.describe({"l": torch.empty(2, NB, 4, device="meta")}, NB, BS)
    k, v = kv_pair(nrt, 0)
    with pytest.raises(ValueError, match="num_blocks=7"):
        b.describe({"l": (k, v)}, 7, BS)
    with pytest.raises(ValueError, match=r"\(K, V\) pair"):
        b.describe({"l": (k, v, k)}, NB, BS)
    with pytest.raises(ValueError, match="allocation"):
        b.describe({"l": View(k.va, (NB * 2, BS, HEADS, DIM), ES, 0, k.nbytes)}, NB * 2, BS)
    with pytest.raises(ValueError, match="ambiguous"):
        b.describe({"l": torch.zeros(2, 2, 4)}, 2, BS)
    with pytest.raises(ValueError, match="neuron_staging"):
        NeuronBackend(staging="gpu")
    with pytest.raises(ValueError, match="neuron_staging"):
        NeuronBackend().configure({"neuron_staging": "sometimes"})


def test_configure_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_STAGING, "host")
    assert NeuronBackend().staging_mode == "host"
    b = NeuronBackend().configure({"neuron_staging": "mapped", "nixl_backends": ["UCX"]})
    assert (b.staging_mode, b.forced_backends, b.may_stage) == ("mapped", ("UCX",), False)
    assert ConnectorConfig.from_extra({"neuron_staging": "mapped"}).neuron_staging == "mapped"
