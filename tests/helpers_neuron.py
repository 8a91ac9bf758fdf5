"""What the Neuron tests share (tests/test_neuron_{runtime,describe,registration,envcheck}.py):
a FAKE libnrt (tests/fakes/fake_libnrt.c) built once, started the way the framework would,
kvferry's binding of it, a private unstarted copy, and CPU stand-in KV tensors.

The fake is as strict as the real runtime where it matters: device VAs are not host
memory unless HBM is mapped (NEURON_RT_MAP_HBM=1 at runtime start), a non-HBM address has
no EFA rail (NRT_FAILURE), and a second nrt_init is refused. The "framework" (the test)
starts the runtime; kvferry must never do so. A test module takes a fixture by naming it
at module level (``nrt = helpers_neuron.nrt``)."""

from __future__ import annotations

import ctypes
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from fakes.nrt_runtime import FakeRuntime, build

from kvferry.neuron import libnrt
from kvferry.neuron.backend import ENV_MAP_HBM, ENV_STAGING
from kvferry.neuron.libnrt import NrtTensor

NB, BS, HEADS, DIM, ES = 8, 4, 2, 16, 2  # num_blocks, block_size, kv heads, head dim, bf16
BLOCK_BYTES = BS * HEADS * DIM * ES


@pytest.fixture(scope="session")
def fake_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("fake_nrt") / "libnrt.so.1")


@pytest.fixture
def runtime(fake_lib: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., FakeRuntime]]:
    """Start the fake runtime the way the framework would (``runtime(map_hbm=...)``) and
    point kvferry's libnrt at it; every test starts from a fresh runtime."""
    monkeypatch.setenv(libnrt.ENV_LIBNRT, str(fake_lib))
    monkeypatch.delenv(ENV_STAGING, raising=False)
    monkeypatch.setenv(ENV_MAP_HBM, "0")  # start() sets it as the worker does; undone after
    rt = FakeRuntime(fake_lib)

    def start(map_hbm: bool = False) -> FakeRuntime:
        rt.reset()
        libnrt.reset()
        rt.start(map_hbm=map_hbm)
        return rt

    yield start
    rt.reset()
    libnrt.reset()


@pytest.fixture
def nrt(runtime) -> libnrt.Libnrt:
    """kvferry's binding of a runtime the framework started (HBM not mapped)."""
    runtime()
    return libnrt.load()


@pytest.fixture
def private(fake_lib: Path, tmp_path: Path) -> tuple[FakeRuntime, libnrt.Libnrt]:
    """A private copy of the fake (own global state), not started, for lifecycle tests."""
    path = tmp_path / "libnrt_private.so.1"
    shutil.copy(fake_lib, path)
    return FakeRuntime(path), libnrt.Libnrt(str(path))


def kv_pair(lib: libnrt.Libnrt, vnc: int) -> tuple[NrtTensor, NrtTensor]:
    shape = (NB, BS, HEADS, DIM)
    return (NrtTensor.allocate(shape, ES, vnc, "k", lib), NrtTensor.allocate(shape, ES, vnc, "v", lib))


def fill(t: NrtTensor, seed: int) -> bytes:
    data = bytes((seed * 31 + i * 7) % 251 for i in range(t.nbytes))
    buf = ctypes.create_string_buffer(data, len(data))
    t.lib.tensor_write(t.handle, ctypes.addressof(buf), 0, len(data))
    return data


def read(t: NrtTensor) -> bytes:
    buf = ctypes.create_string_buffer(t.nbytes)
    t.lib.tensor_read(t.handle, ctypes.addressof(buf), 0, t.nbytes)
    return buf.raw


def hnd(num_blocks: int = NB, seed: int = 0) -> torch.Tensor:
    """A vllm-neuron per-layer KV tensor's shape and dtype, (2, N, H, 32, D) bf16 (a CPU
    stand-in: no Neuron device here)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, num_blocks, HEADS, 32, DIM, generator=g).to(torch.bfloat16)


@dataclass
class View:
    """A NeuronArray from some other framework: plain attributes, strides optional."""

    va: int
    shape: tuple[int, ...]
    itemsize: int
    vnc: int
    nbytes: int
    strides: tuple[int, ...] | None = None
