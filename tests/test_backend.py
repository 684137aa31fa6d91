"""The device backend seam: backend selection and the compile policy on every machine, and on
CUDA real graphs against eager on the default pair (CPU runs of the graph path are in
tests/test_graphs.py)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from engine.checkpoint import load_checkpoint
from engine.core import Engine
from engine.device.backend import Backend, CpuBackend, CudaBackend, NpuBackend, backend_for
from engine.device.resolve import DeviceError, resolve_device
from engine.drafters.draft_model import DraftModelDrafter
from engine.request import Request
from engine.sampling import SamplingParams
from tests.conftest import DEFAULT_DRAFT, DEFAULT_TARGET

# ---- backend selection -------------------------------------------------------------------


def test_cpu_backend_runs_eagerly_and_accounts_no_memory():
    backend = backend_for("cpu")
    assert type(backend) is CpuBackend and backend.name == "cpu"
    assert backend.device == torch.device("cpu") and backend.default_dtype == torch.float32
    assert not backend.supports_graphs and backend.allows_compile
    backend.synchronize()
    assert backend.memory_allocated() == 0 and backend.memory_reserved() == 0
    assert backend.graph_pool() is None
    with pytest.raises(NotImplementedError, match="no graphs"):
        backend.capture(lambda: None)
    assert backend_for(torch.device("cpu")).name == "cpu"


def test_npu_without_torch_npu_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu now raises ImportError
    with pytest.raises(DeviceError, match="torch_npu"):
        backend_for("npu")


def fake_torch_npu(available: bool, count: int) -> types.ModuleType:
    """A torch_npu that imports and answers only what resolve_device asks of it."""
    module = types.ModuleType("torch_npu")
    module.npu = types.SimpleNamespace(is_available=lambda: available, device_count=lambda: count)
    return module


def test_npu_with_no_usable_npu_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu(available=False, count=0))
    with pytest.raises(DeviceError, match="finds no usable NPU"):
        resolve_device("npu")


def test_a_device_index_the_host_lacks_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu(available=True, count=2))
    with pytest.raises(DeviceError, match=r"'npu:2' requested but this host has 2 NPU device\(s\)"):
        resolve_device("npu:2")
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        with pytest.raises(DeviceError, match=f"has {count} CUDA device"):
            resolve_device(f"cuda:{count}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where CUDA is absent")
def test_cuda_without_cuda_is_a_clear_error():
    with pytest.raises(DeviceError, match="CUDA is not available"):
        backend_for("cuda")


def test_compile_is_never_allowed_on_npu():
    assert NpuBackend.allows_compile is False
    assert CudaBackend.allows_compile and Backend.allows_compile

    class NoCompile(Backend):
        allows_compile = False

    def fn(x):
        return x + 1

    assert NoCompile(torch.device("cpu")).maybe_compile(fn) is fn


# ---- CUDA ----------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
CUDA_STEPS = (0, 1, 3, 5, 7)


@pytest.fixture(scope="module")
def default_pair_cuda():
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a CUDA device")
    # float32: graph and eager attention differ only in kernel choice and key count, so greedy
    # ties cannot flip the comparison; bfloat16 is timed in bench/graphs.py.
    return load_checkpoint(DEFAULT_TARGET, "cuda", "float32"), load_checkpoint(DEFAULT_DRAFT, "cuda", "float32")


def code_requests(target, count: int, max_tokens: int) -> list[Request]:
    from tools.corpus import code_prompts

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return [Request(tuple(target.tokenizer.encode(p).ids[-200:]), params) for p in code_prompts(count, seed=3)]


def cuda_engine(target, draft, batch_size: int, k: int, graphs: bool) -> Engine:
    drafter = DraftModelDrafter(draft, batch_size, 512)
    return Engine(target, drafter, batch_size, 512, [k], graphs=graphs)


@needs_cuda
def test_cuda_backend_is_selected_with_graphs():
    backend = backend_for("cuda")
    assert isinstance(backend, CudaBackend) and backend.supports_graphs and backend.allows_compile
    assert backend.default_dtype == torch.bfloat16
    assert backend.graph_pool() is backend.graph_pool()  # one pool for every capture
    assert not torch.backends.cuda.cudnn_sdp_enabled()  # a plan per attention shape: see CudaBackend
    backend.synchronize()


@needs_cuda
@pytest.mark.parametrize("batch_size", [1, 4])
def test_cuda_graphs_greedy_equals_eager_for_every_k(default_pair_cuda, batch_size):
    target, draft = default_pair_cuda
    for k in CUDA_STEPS:
        results = []
        for graphs in (False, True):
            engine = cuda_engine(target, draft, batch_size, k, graphs)
            requests = code_requests(target, batch_size, 64)
            outputs = engine.run_until_done(requests)
            results.append([outputs[r.id] for r in requests])
            if graphs:
                assert engine.graph_runner.replays > 0 and engine.states[k].graphs.graphs
        assert results[1] == results[0], f"k={k} batch={batch_size}"


@needs_cuda
@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_cuda_feature_drafters_through_graphs_equal_eager(default_pair_cuda, kind):
    """The shipped EAGLE-3 head and DFlash drafter: chain steps or blocks replayed from graphs
    (k switched every round) give the eager engine's output, past the drafters' 256-position
    window (200-token prompts and 96 new tokens)."""
    from engine.drafters.dflash import DFlashDrafter
    from engine.drafters.eagle3 import Eagle3Drafter
    from engine.model.dflash import load_dflash
    from engine.model.eagle3 import load_eagle3

    target, _ = default_pair_cuda
    models = DEFAULT_TARGET.parent
    results = []
    for graphs in (False, True):
        if kind == "eagle3":
            drafter = Eagle3Drafter(load_eagle3(models / "eagle3", target.model), target.model, 4, 512)
        else:
            drafter = DFlashDrafter(load_dflash(models / "dflash", target.model), target.model, 4, 512)
        engine = Engine(target, drafter, 4, 512, CUDA_STEPS, graphs=graphs)
        requests = code_requests(target, 4, 96)
        outputs = {r.id: [] for r in requests}
        for request in requests:
            engine.add_request(request)
        ks = iter(CUDA_STEPS * 100)
        while engine.has_work:
            for out in engine.step(next(ks)).outputs:
                outputs[out.request_id].extend(out.new_tokens)
        results.append([outputs[r.id] for r in requests])
        if graphs:  # an EAGLE-3 head's greedy chains and extends replay; its step graphs serve sampled ones
            replayed = drafter.graphs.replays if kind == "dflash" else drafter.chain_graphs[5].replays
            assert replayed > 0 and sum(g.replays for g in drafter.extend_graphs.values()) > 0
    assert results[1] == results[0]


@needs_cuda
def test_cuda_switching_state_captures_nothing(default_pair_cuda):
    target, draft = default_pair_cuda
    engine = Engine(target, DraftModelDrafter(draft, 4, 512), 4, 512, CUDA_STEPS)
    captured = engine.graph_captures
    assert captured > 0
    for request in code_requests(target, 4, 48):
        engine.add_request(request)
    ks = iter(CUDA_STEPS * 100)
    while engine.has_work:
        engine.step(next(ks))
    assert engine.graph_captures == captured
    assert engine.graph_runner.replays > 0 and engine.drafter.graph_runner.replays > 0
