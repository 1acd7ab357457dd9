"""Device dispatch and the engine, on a CPU-only machine without habana_frameworks.

In-process tests only read or monkeypatch the environment; anything that imports
fastreduce fresh or joins a process group runs in a subprocess, so this pytest
process never initializes torch.distributed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fastreduce.backends import (BACKENDS, CheckedBackend, EagerBackend, detect_device, hpu,
                                 select_backend)

CPU = torch.device("cpu")

pytestmark = pytest.mark.timeout(60)


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (this venv), with extra environment variables."""
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                             "FASTREDUCE_DEVICE")}
    full_env.update(env)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


@pytest.fixture
def no_device_env(monkeypatch):
    monkeypatch.delenv("FASTREDUCE_DEVICE", raising=False)
    monkeypatch.delenv("PT_HPU_LAZY_MODE", raising=False)
    return monkeypatch


# ============================================================== select_backend

@pytest.mark.parametrize("use_graphs", [True, False])
def test_auto_on_cpu_is_eager(use_graphs) -> None:
    assert isinstance(select_backend("auto", CPU, use_graphs), EagerBackend)


@pytest.mark.parametrize("name, cls", [("eager", EagerBackend), ("checked", CheckedBackend)])
def test_device_independent_backends_work_on_cpu(name, cls) -> None:
    backend = select_backend(name, CPU)
    assert isinstance(backend, cls) and backend.name == name


@pytest.mark.parametrize("name", ["cuda", "hpu"])
def test_device_backend_on_cpu_is_rejected(name) -> None:
    with pytest.raises(ValueError, match=f"backend '{name}' needs gradients on a {name} device"):
        select_backend(name, CPU)


def test_unknown_backend_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        select_backend("tpu", CPU)
    assert set(BACKENDS) == {"auto", "eager", "cuda", "hpu", "checked"}


def test_eager_capture_is_the_function_itself() -> None:
    buf = torch.zeros(2)
    replay = EagerBackend().capture(lambda: buf.add_(1))
    replay()
    replay()
    assert buf.tolist() == [2.0, 2.0]


def test_checked_capture_then_replays_run_the_function() -> None:
    buf = torch.zeros(2)
    backend = CheckedBackend()
    replay = backend.capture(lambda: buf.add_(1))
    assert buf.tolist() == [0.0, 0.0]  # capture records only, as a real graph capture does
    replay()
    replay()
    assert buf.tolist() == [2.0, 2.0] and backend.replays == 2


# ============================================================== lazy device imports

def test_import_does_not_touch_device_stacks() -> None:
    run_python("""
        import sys
        import torch
        import fastreduce
        assert "habana_frameworks" not in sys.modules, "habana_frameworks imported"
        assert not torch.cuda.is_initialized(), "CUDA initialized"
        for mod in ("fastreduce.backends.cuda", "fastreduce.backends.hpu"):
            assert mod not in sys.modules, mod + " imported eagerly"
        # dynamo costs a second of every process that imports fastreduce and never compiles
        assert "torch._dynamo" not in sys.modules, "torch._dynamo imported by import fastreduce"
    """)


def test_gossip_forward_hook_is_eager_once_a_wrapper_exists() -> None:
    """DecentralizedDataParallel's forward closes the last step in a graph break where the
    wrapper is compiled: its method is ``torch.compiler.disable``-d by the first constructor
    (hooks.eager_methods), not at import."""
    run_python("""
        import torch, torch.distributed as dist, fastreduce
        from fastreduce.modes.gossip import DecentralizedDataParallel as D
        assert not hasattr(D.__dict__["_before_forward"], "_torchdynamo_disable")
        from fastreduce.launch import free_port
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        D(torch.nn.Linear(2, 2), lambda named: torch.optim.SGD([p for _, p in named], lr=0.1))
        fn = D.__dict__["_before_forward"]
        assert getattr(fn, "_torchdynamo_disable", False) and fn._fastreduce_eager, fn
        D(torch.nn.Linear(2, 2), lambda named: torch.optim.SGD([p for _, p in named], lr=0.1))
        assert D.__dict__["_before_forward"] is fn, "wrapped twice"
        dist.destroy_process_group()
    """)


# ============================================================== hpu helpers without habana

def test_habana_is_absent_here() -> None:
    with pytest.raises(ImportError):
        import habana_frameworks  # noqa: F401
    assert hpu.available() is False


@pytest.mark.parametrize("value, expect", [("1", True), ("0", False), (None, True)])
def test_lazy_mode_reads_env_without_habana(no_device_env, value, expect) -> None:
    if value is not None:
        no_device_env.setenv("PT_HPU_LAZY_MODE", value)
    assert hpu.lazy_mode() is expect


# ============================================================== detect_device

def test_detect_device_is_cpu_gloo_here(no_device_env) -> None:
    assert detect_device(0) == (CPU, "gloo")
    assert detect_device(3) == (CPU, "gloo")


def test_forced_cpu(no_device_env) -> None:
    no_device_env.setenv("FASTREDUCE_DEVICE", "cpu")
    assert detect_device(0) == (CPU, "gloo")


@pytest.mark.parametrize("device, needle", [
    ("hpu", "FASTREDUCE_DEVICE=hpu but no Gaudi device is available"),
    ("cuda", "FASTREDUCE_DEVICE=cuda but torch.cuda.is_available() is False"),
])
def test_forced_missing_device_is_a_clear_error(no_device_env, device, needle) -> None:
    no_device_env.setenv("FASTREDUCE_DEVICE", device)
    with pytest.raises(RuntimeError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        detect_device(0)


def test_forced_unknown_device_is_rejected(no_device_env) -> None:
    no_device_env.setenv("FASTREDUCE_DEVICE", "tpu")
    with pytest.raises(ValueError, match="use cpu, cuda or hpu"):
        detect_device(0)


# ============================================================== init_distributed

def test_init_distributed_world_of_one() -> None:
    proc = run_python("""
        import torch
        import torch.distributed as dist
        import fastreduce
        info = fastreduce.init_distributed()
        assert info == fastreduce.DistInfo(rank=0, world_size=1, local_rank=0,
                                           device=torch.device("cpu"), backend="gloo"), info
        assert dist.is_initialized() and dist.get_world_size() == 1
        assert fastreduce.init_distributed() == info  # a second call changes nothing
        # The reducer works in that world (and is a no-op there).
        model = torch.nn.Linear(3, 2)
        model(torch.randn(4, 3)).sum().backward()
        before = model.weight.grad.clone()
        fastreduce.all_reduce_gradients(model)
        assert torch.equal(model.weight.grad, before)
        dist.destroy_process_group()
        print("OK", info)
    """)
    assert "OK" in _result_lines(proc)


def test_init_distributed_honours_torchrun_env() -> None:
    """RANK/WORLD_SIZE/LOCAL_RANK as torchrun sets them (a world of one, rank 0)."""
    from fastreduce.launch import free_port

    proc = run_python("""
        import fastreduce
        info = fastreduce.init_distributed()
        print("OK", info.rank, info.world_size, info.local_rank, info.backend)
    """, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    assert _result_lines(proc)["OK"] == "0 1 0 gloo"


def _result_lines(proc: subprocess.CompletedProcess) -> dict[str, str]:
    """The script's own lines on stdout, by first word: torch 2.9's Gloo prints there too
    (``[Gloo] Rank 0 is connected to 0 peer ranks``)."""
    return {line.split(" ", 1)[0]: line.partition(" ")[2] for line in proc.stdout.splitlines()
            if not line.startswith("[Gloo]")}
