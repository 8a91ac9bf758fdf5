"""Memory backends (connectors/memory/): KV caches -> regions + planes, the wire form, the registry."""

from __future__ import annotations

import pytest
import torch

from kvferry.connectors.memory.backends import (
    DRAM,
    VRAM,
    CpuBackend,
    CudaBackend,
    KVLayout,
    Plane,
    Region,
    planes_of_array,
)
from kvferry.connectors.memory.registry import HARDWARE_BACKENDS, get_backend


def bytes_of_block(t: torch.Tensor, plane: Plane, block: int) -> bytes:
    """Read the bytes a plane says block ``block`` occupies, straight from t's storage."""
    storage = t.untyped_storage()
    off = plane.block_addr(block) - storage.data_ptr()
    raw = torch.frombuffer(bytearray(bytes(storage)), dtype=torch.uint8)
    return bytes(raw[off:off + plane.block_bytes].tolist())


# -- planes_of_array ------------------------------------------------------------------------
def test_kv_first_layout_gives_two_dense_planes():
    # (2, N, bs, heads, dim) float16
    shape, es = (2, 10, 4, 2, 8), 2
    strides = [10 * 64 * es, 64 * es, 16 * es, 8 * es, es]
    ps = planes_of_array(3, 1000, shape, strides, es, block_dim=1)
    bb = 64 * es
    assert [(p.region, p.base, p.stride, p.block_bytes, p.num_blocks) for p in ps] == [
        (3, 1000, bb, bb, 10), (3, 1000 + 10 * bb, bb, bb, 10)]
    assert ps[1].block_addr(9) == 1000 + 19 * bb


def test_blocks_first_layout_gives_one_plane_holding_k_and_v():
    # (N, 2, bs, heads, dim) float32
    shape, es = (6, 2, 4, 2, 8), 4
    strides = [2 * 64 * es, 64 * es, 16 * es, 8 * es, es]
    (p,) = planes_of_array(0, 0, shape, strides, es, block_dim=0)
    assert (p.region, p.base, p.stride, p.block_bytes, p.num_blocks) == (0, 0, 128 * es, 128 * es, 6)


def test_strided_view_of_blocks_is_one_plane_with_larger_stride():
    # every other block of a bigger dense buffer: stride 2 blocks, block still contiguous
    es = 4
    shape, strides = (5, 4, 8), [2 * 32 * es, 8 * es, es]
    (p,) = planes_of_array(0, 64, shape, strides, es, block_dim=0)
    assert (p.stride, p.block_bytes, p.num_blocks) == (256, 128, 5)
    assert p.block_addr(4) == 64 + 4 * 256


def test_outer_dims_multiply_into_planes_in_row_major_order():
    es = 1
    shape = (2, 3, 4, 5)  # (kv, layer-ish, blocks, inner)
    strides = [3 * 4 * 5, 4 * 5, 5, 1]
    ps = planes_of_array(0, 0, shape, strides, es, block_dim=2)
    assert [p.base for p in ps] == [0, 20, 40, 60, 80, 100]
    assert all(p.stride == 5 and p.block_bytes == 5 and p.num_blocks == 4 for p in ps)


def test_size_one_inner_dims_may_have_any_stride():
    es = 2
    shape, strides = (4, 1, 8), [8 * es, 12345, es]
    (p,) = planes_of_array(0, 0, shape, strides, es, block_dim=0)
    assert p.block_bytes == 16


def test_permuted_inner_dims_are_one_byte_range():
    # HND stored as NHD: inner dims transposed in memory but densely packed
    es = 2
    shape, strides = (4, 8, 2), [16 * es, 1 * es, 8 * es]
    (p,) = planes_of_array(0, 0, shape, strides, es, block_dim=0)
    assert (p.stride, p.block_bytes) == (32, 32)


@pytest.mark.parametrize("shape,strides", [
    ((4, 8, 2), [32, 4, 1]),       # gap between rows
    ((4, 8), [16, 2]),             # every other element
    ((4, 8, 2), [16, 2, 8]),       # permuted with overlap: strides 2 and 8 for sizes 8 and 2
    ((4, 2, 2), [16, 1, 1]),       # aliased dims
])
def test_non_contiguous_block_raises(shape, strides):
    with pytest.raises(ValueError, match="not contiguous"):
        planes_of_array(0, 0, shape, strides, 1, block_dim=0)


# -- TorchMemoryBackend on real CPU tensors ---------------------------------------------------
def test_describe_kv_first_cpu_tensors_addresses_match_torch():
    n = 6
    caches = {f"layer{i}": torch.randn(2, n, 4, 2, 8) for i in range(3)}
    lay = CpuBackend().describe(caches, n, block_size=4)
    assert len(lay.regions) == 3 and len(lay.planes) == 6
    assert lay.num_blocks == n and lay.block_size == 4
    for i, (name, t) in enumerate(caches.items()):
        r = lay.regions[i]
        assert r == Region(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes(), 0, DRAM)
        for kv in range(2):
            p = lay.planes[2 * i + kv]
            assert p.region == i and p.block_bytes == 64 * 4 and p.num_blocks == n
            for b in (0, 3, n - 1):
                assert p.block_addr(b) == t[kv, b].data_ptr(), name
                assert bytes_of_block(t, p, b) == t[kv, b].contiguous().numpy().tobytes()


def test_describe_blocks_first_layout():
    n = 5
    t = torch.randn(n, 2, 4, 8, dtype=torch.bfloat16)
    lay = CpuBackend().describe({"l": t}, n, 4)
    (p,) = lay.planes
    assert p.stride == p.block_bytes == 2 * 32 * 2
    assert p.block_addr(2) == t[2].data_ptr()
    assert bytes_of_block(t, p, 2) == bytes(t[2].contiguous().view(torch.uint8).flatten().tolist())


def test_layers_sharing_one_storage_are_one_region():
    n = 4
    buf = torch.zeros(3, 2, n, 16)  # one allocation, three layer views
    caches = {f"l{i}": buf[i] for i in range(3)}
    lay = CpuBackend().describe(caches, n, 16)
    assert lay.regions == (Region(buf.data_ptr(), buf.untyped_storage().nbytes(), 0, DRAM),)
    assert len(lay.planes) == 6 and {p.region for p in lay.planes} == {0}
    assert [p.base for p in lay.planes] == [buf[i, kv].data_ptr() for i in range(3) for kv in range(2)]
    # every block of every plane lies inside the single region
    r = lay.regions[0]
    for p in lay.planes:
        assert r.addr <= p.block_addr(0) and p.block_addr(n - 1) + p.block_bytes <= r.addr + r.length


def test_view_with_storage_offset_keeps_region_at_storage_start():
    n = 4
    buf = torch.zeros(100 + 2 * n * 8)
    t = buf[100:].view(2, n, 8)
    lay = CpuBackend().describe({"l": t}, n, 8)
    assert lay.regions[0].addr == buf.data_ptr() and lay.planes[0].base == buf.data_ptr() + 400


def test_non_contiguous_cache_tensor_raises():
    n = 4
    t = torch.zeros(2, n, 8, 6)[..., :3]  # head_dim sliced: gaps inside each block
    with pytest.raises(ValueError, match="not contiguous"):
        CpuBackend().describe({"l": t}, n, 8)


def test_transposed_inner_cache_is_accepted_and_addresses_match():
    n = 5
    t = torch.randn(2, n, 8, 3).transpose(2, 3)  # (2, n, 3, 8) with permuted inner strides
    lay = CpuBackend().describe({"l": t}, n, 3)
    assert [p.block_addr(4) for p in lay.planes] == [t[0, 4].data_ptr(), t[1, 4].data_ptr()]
    assert all(p.block_bytes == 24 * 4 for p in lay.planes)


def test_no_dimension_of_num_blocks_raises():
    with pytest.raises(ValueError, match="num_blocks=7"):
        CpuBackend().describe({"l": torch.zeros(2, 6, 8)}, 7, 8)


def test_wrong_device_raises():
    with pytest.raises(ValueError, match="cpu"):
        CudaBackend().describe({"l": torch.zeros(2, 4, 8)}, 4, 8)


def test_ambiguous_block_dim_is_refused():
    """(2, 2, ...) with num_blocks == 2: K/V-first and block-first look alike; never guess."""
    with pytest.raises(ValueError, match="ambiguous"):
        CpuBackend().describe({"l": torch.zeros(2, 2, 4, 8)}, 2, 4)


def test_empty_caches_give_empty_layout():
    lay = CpuBackend().describe({}, 8, 16)
    assert lay.regions == () and lay.planes == () and lay.signature() == (16, ())


# -- KVLayout --------------------------------------------------------------------------------
def test_layout_wire_round_trip_through_msgpack():
    import msgspec

    n = 6
    lay = CpuBackend().describe({"a": torch.zeros(2, n, 8), "b": torch.zeros(n, 2, 8)}, n, 16)
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(lay.to_wire()))
    assert KVLayout.from_wire(wire) == lay
    assert KVLayout.from_wire(wire).signature() == lay.signature()


def test_layout_wire_round_trip_vram_and_device_id():
    lay = KVLayout((Region(2**47, 4096, 3, VRAM),), (Plane(0, 2**47, 512, 256, 8),), 8, 32)
    assert KVLayout.from_wire(lay.to_wire()) == lay


def test_signature_ignores_addresses_but_not_shapes():
    a = KVLayout((Region(0, 100, 0, DRAM),), (Plane(0, 0, 10, 10, 10),), 10, 16)
    b = KVLayout((Region(5000, 900, 1, DRAM),), (Plane(0, 5000, 20, 10, 90),), 90, 16)
    assert a.signature() == b.signature()
    assert a.signature() != KVLayout(a.regions, a.planes, 10, 32).signature()


@pytest.mark.parametrize("bad", [-1, 10, 11])
def test_block_addr_range_checked(bad):
    with pytest.raises(IndexError):
        Plane(0, 0, 10, 10, 10).block_addr(bad)


# -- get_backend -----------------------------------------------------------------------------
def test_get_backend_known_names():
    assert HARDWARE_BACKENDS == ("cpu", "cuda", "neuron")
    cpu, cuda = get_backend("cpu"), get_backend("cuda")
    assert isinstance(cpu, CpuBackend) and cpu.mem_type == DRAM and cpu.default_nixl_backends == ("UCX",)
    assert isinstance(cuda, CudaBackend) and cuda.mem_type == VRAM


@pytest.mark.parametrize("name", ["", "CPU", "tpu", "neuron "])
def test_get_backend_unknown_name_lists_choices(name):
    with pytest.raises(ValueError, match="unknown hardware backend") as e:
        get_backend(name)
    assert all(b in str(e.value) for b in HARDWARE_BACKENDS)


@pytest.mark.parametrize(("shape", "perm", "heads_dim", "want"), [
    ((7, 3, 4, 16), None, 1, (1, 3, 4 * 16 * 4)),  # CPU attention: heads outermost
    ((2, 7, 4, 3, 8), None, 3, (4, 3, 8 * 4)),  # NHD: tokens outside heads
    ((2, 7, 4, 3, 8), (0, 1, 3, 2, 4), 3, (1, 3, 4 * 8 * 4)),  # HND stride order, NHD view
])
def test_describe_locates_the_heads_in_memory_order(shape, perm, heads_dim, want):
    t = torch.zeros(shape)
    if perm is not None:  # allocate in memory order ``perm``, hand out the logical view
        t = torch.zeros([shape[i] for i in perm]).permute(*[perm.index(i) for i in range(len(perm))])
    lay = CpuBackend().describe({"l": t}, 7, 4, heads_dim)
    assert {p.heads for p in lay.planes} == {want} and lay.num_heads == 3
    assert KVLayout.from_wire(lay.to_wire()) == lay
    assert CpuBackend().describe({"l": t}, 7, 4).head_signature() is None


def test_torch_backends_register_once_and_leave_heads_to_vllm():
    """The hooks the connector calls around registration: a torch backend registers its
    layout once (no other way to expose the KV) and leaves the heads dim to vLLM."""
    lay = CpuBackend().describe({"l": torch.zeros(2, 7, 16)}, 7, 4)
    calls = []
    assert CpuBackend().register_with(lay, lambda x: calls.append(x) or "worker") == "worker"
    assert calls == [lay]
    assert CpuBackend().kv_heads_dim({"l": torch.zeros(2, 7, 4, 3, 8)}) is None


def test_registry_imports_a_backend_only_when_selected() -> None:
    """Naming neuron as "module:attr" keeps connectors.memory free of kvferry.neuron: a CPU
    engine never loads it (and the packages import no cycle)."""
    import subprocess
    import sys

    code = ("import sys; from kvferry.connectors.memory.registry import get_backend; "
            "get_backend('cpu'); print('kvferry.neuron.backend' in sys.modules); "
            "get_backend('neuron'); print('kvferry.neuron.backend' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]
