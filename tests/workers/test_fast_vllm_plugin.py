"""The vLLM plugin: `omni_fast` registered with SleepModeBackendFactory from the
vllm.general_plugins entry point, and suspend/resume through the factory.

On CPU (CI) vLLM is absent: a stand-in of vLLM 0.26's sleep_mode_backend module (the same
registry and factory logic) and the CuMemAllocator stand-in of test_cumem_versions take
its place. On the device machine the real vLLM 0.26 files run:

    source .device/setup.sh && python3 -m pytest -m gpu tests/workers/test_fast_vllm_plugin.py
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
import types
from abc import ABC, abstractmethod
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch

from omni_core import vllm_plugin
from omni_core.workers.backends.fast_path import FastPath

from .test_cumem_versions import GARBAGE, KV, FakeCumemModule, W, content
from .test_fast_backend import DeferredOps

ROOT = Path(__file__).resolve().parents[2]
EP_NAME, EP_VALUE = "omni_core_fast", "omni_core.vllm_plugin:register"


def _real_vllm_factory():
    try:
        return importlib.import_module(vllm_plugin.SLEEP_MODULE)
    except Exception:
        return None


# ---------------------------------------------------------------------- stand-ins (CPU)


def fake_sleep_module() -> types.ModuleType:
    """vLLM 0.26's SleepModeBackend / SleepModeBackendFactory, reduced to what they do."""
    mod = types.ModuleType(vllm_plugin.SLEEP_MODULE)

    class SleepModeBackend(ABC):
        def __init__(self) -> None:
            self._state = "RUNNING"

        @abstractmethod
        def suspend(self, level: int = 1) -> None: ...

        @abstractmethod
        def resume(self, tags=None) -> None: ...

        def state(self):
            return self._state

        @classmethod
        def is_supported(cls) -> bool:
            return True

    class SleepModeBackendFactory:
        _registry: ClassVar[dict] = {}

        @classmethod
        def register_backend(cls, name, module_path, class_name):
            if name in cls._registry:
                raise ValueError(f"Sleep-mode backend '{name}' is already registered.")
            cls._registry[name] = lambda: getattr(importlib.import_module(module_path), class_name)

        @classmethod
        def get_backend_class(cls, name):
            if name not in cls._registry:
                raise ValueError(f"Unsupported sleep-mode backend '{name}'.")
            return cls._registry[name]()

        @classmethod
        def create_backend(cls, model_config):
            backend_cls = cls.get_backend_class(model_config.sleep_mode_backend)
            if not backend_cls.is_supported():
                raise ValueError(f"Sleep-mode backend '{model_config.sleep_mode_backend}' is not supported")
            return backend_cls()

    SleepModeBackendFactory.register_backend("cumem", "builtins", "object")
    mod.SleepModeBackend = SleepModeBackend
    mod.SleepModeBackendFactory = SleepModeBackendFactory
    return mod


@pytest.fixture
def fake_vllm(monkeypatch):
    if _real_vllm_factory() is not None:
        pytest.skip("vLLM is installed: the real factory is tested instead")
    sleep_mod = fake_sleep_module()
    cumem = FakeCumemModule("0.26")
    cumem_mod = types.ModuleType(vllm_plugin.CUMEM_MODULE)
    cumem_mod.CuMemAllocator = cumem.CuMemAllocator
    cumem.CuMemAllocator.use_memory_pool = type(cumem.CuMemAllocator.get_instance()).use_memory_pool
    config_mod = types.ModuleType("vllm.config")
    config_mod.get_current_vllm_config_or_none = lambda: None
    for name, mod in {
        "vllm": types.ModuleType("vllm"),
        "vllm.device_allocator": types.ModuleType("x"),
        vllm_plugin.SLEEP_MODULE: sleep_mod,
        vllm_plugin.CUMEM_MODULE: cumem_mod,
        "vllm.config": config_mod,
    }.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.delitem(vars(vllm_plugin), "OmniFastSleepBackend", raising=False)
    path = FastPath(
        cumem.CuMemAllocator.get_instance(), cumem, torch.device("cpu"), ops=DeferredOps(cumem), chunk_bytes=5000
    )
    monkeypatch.setattr(vllm_plugin, "_path", path)
    return SimpleNamespace(sleep=sleep_mod, cumem=cumem, config=config_mod, path=path)


def test_entry_point_is_declared_and_installed():
    text = (ROOT / "pyproject.toml").read_text()
    assert f'[project.entry-points."{vllm_plugin.ENTRY_POINT_GROUP}"]\n{EP_NAME} = "{EP_VALUE}"' in text
    installed = {ep.name: ep for ep in importlib.metadata.entry_points(group=vllm_plugin.ENTRY_POINT_GROUP)}
    assert EP_NAME in installed, "omni-core's installed metadata lacks the entry point: reinstall (scripts/setup.sh)"
    assert installed[EP_NAME].value == EP_VALUE and installed[EP_NAME].load() is vllm_plugin.register


def test_register_without_vllm_is_a_quiet_no_op(monkeypatch):
    if _real_vllm_factory() is not None:
        pytest.skip("vLLM is installed")
    monkeypatch.setitem(sys.modules, vllm_plugin.SLEEP_MODULE, None)  # import fails
    vllm_plugin.register()
    assert "torch" in sys.modules  # and nothing raised


def test_importing_the_plugin_does_not_import_vllm():
    import subprocess

    code = "import sys, omni_core.vllm_plugin; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_registration_through_the_factory(fake_vllm):
    vllm_plugin.register()
    vllm_plugin.register()  # a second load (vLLM loads plugins per process, maybe more than once)
    factory = fake_vllm.sleep.SleepModeBackendFactory
    cls = factory.get_backend_class(vllm_plugin.BACKEND_NAME)
    assert issubclass(cls, fake_vllm.sleep.SleepModeBackend) and cls.__name__ == "OmniFastSleepBackend"
    assert cls.preserves_communicators()
    # the real is_supported needs CUDA and vLLM's extension; without them the factory refuses
    with pytest.raises(ValueError, match="not supported"):
        factory.create_backend(SimpleNamespace(sleep_mode_backend=vllm_plugin.BACKEND_NAME))


def test_environment_selects_omni_fast_where_the_config_kept_the_default(fake_vllm, monkeypatch):
    # vLLM 0.26 has ModelConfig.sleep_mode_backend but no engine argument for it.
    vllm_plugin.register()
    vllm_plugin.register()  # the wrapper is installed once, not nested
    factory = fake_vllm.sleep.SleepModeBackendFactory
    default = SimpleNamespace(sleep_mode_backend=vllm_plugin.VLLM_DEFAULT_BACKEND)
    monkeypatch.delenv(vllm_plugin.ENV_SELECT, raising=False)
    with pytest.raises(AttributeError, match="is_supported"):  # the stand-in's "cumem" (builtins.object)
        factory.create_backend(default)
    monkeypatch.setenv(vllm_plugin.ENV_SELECT, vllm_plugin.BACKEND_NAME)
    with pytest.raises(ValueError, match="'omni_fast' is not supported"):  # the factory's own check, our name
        factory.create_backend(default)
    with pytest.raises(ValueError, match="Unsupported sleep-mode backend 'other'"):
        factory.create_backend(SimpleNamespace(sleep_mode_backend="other"))  # an explicit choice is kept
    monkeypatch.setattr(vllm_plugin.OmniFastSleepBackend, "is_supported", classmethod(lambda cls: True))
    assert type(factory.create_backend(default)).__name__ == "OmniFastSleepBackend"
    assert default.sleep_mode_backend == vllm_plugin.VLLM_DEFAULT_BACKEND  # the config is not mutated
    monkeypatch.setenv(vllm_plugin.ENV_SELECT, "omni_fats")
    with pytest.raises(ValueError, match="omni_fats"):
        factory.create_backend(default)


def test_suspend_resume_through_the_factory(fake_vllm, monkeypatch):
    vllm_plugin.register()
    factory = fake_vllm.sleep.SleepModeBackendFactory
    cls = factory.get_backend_class(vllm_plugin.BACKEND_NAME)
    monkeypatch.setattr(cls, "is_supported", classmethod(lambda c: True))
    allocator = fake_vllm.cumem.CuMemAllocator.get_instance()
    with allocator.use_memory_pool(W):
        weights = [allocator.malloc(n, 0x11) for n in (4096, 8192)]
    with allocator.use_memory_pool(KV):
        kv = [allocator.malloc(16384, 0x22)]
    backend = factory.create_backend(SimpleNamespace(sleep_mode_backend=vllm_plugin.BACKEND_NAME))
    memory = fake_vllm.cumem.memory
    backend.suspend(level=1)
    assert memory == {} and backend.state() == "SUSPENDED"
    backend.resume(["weights"])
    assert set(memory) == set(weights) and content(fake_vllm.cumem, weights) == {0x11}
    backend.resume(["kv_cache"])
    assert content(fake_vllm.cumem, kv) == {GARBAGE} and backend.state() == "RUNNING"
    backend.suspend(level=2)
    assert memory == {}
    backend.resume()
    assert content(fake_vllm.cumem, weights) == {GARBAGE}


def test_plain_vllm_joins_the_node_ledger_and_its_resume_takes_its_turn(fake_vllm, monkeypatch, tmp_path):
    from omni_core.workers.device_ledger import LedgerMember, one_incoming_wake
    from omni_core.workers.memory_gate import WakeRefused
    from omni_core.workers.simulated_device import SimulatedDevice

    directory = str(tmp_path / "GPU-0")
    monkeypatch.setattr(vllm_plugin, "_member", LedgerMember(directory, 1 << 20, vllm_plugin.LEDGER_STAGE, 0, 0.05))
    vllm_plugin.register()
    factory = fake_vllm.sleep.SleepModeBackendFactory
    monkeypatch.setattr(
        factory.get_backend_class(vllm_plugin.BACKEND_NAME), "is_supported", classmethod(lambda c: True)
    )
    allocator = fake_vllm.cumem.CuMemAllocator.get_instance()
    with allocator.use_memory_pool(W):
        weights = [allocator.malloc(n, 0x11) for n in (4096, 8192)]
    with allocator.use_memory_pool(KV):
        allocator.malloc(16384, 0x22)
    ledger = SimulatedDevice(directory, 1 << 20)

    def held() -> list[tuple[str, int]]:
        return [(h.label, h.nbytes) for h in ledger.holders().holders]

    backend = factory.create_backend(SimpleNamespace(sleep_mode_backend=vllm_plugin.BACKEND_NAME))
    assert held() == [("stage vllm rank 0", 4096 + 8192 + 16384)]  # registered with what its pools hold
    backend.suspend(level=1)
    assert held() == [("stage vllm rank 0", 0)]
    with one_incoming_wake(directory, "stage talker rank 0, pid 77 (engine pid 7)", 1.0):  # an omni-core wake
        with pytest.raises(WakeRefused, match=r"incoming lock \(stage talker rank 0, pid 77 \(engine pid 7\)\)"):
            backend.resume(["weights"])
        assert fake_vllm.cumem.memory == {} and backend.state() == "SUSPENDED"  # refused before any map
    backend.resume(["weights"])
    assert content(fake_vllm.cumem, weights) == {0x11} and backend.state() == "RUNNING"
    assert held() == [("stage vllm rank 0", 4096 + 8192)]


def test_the_wake_wait_of_plain_vllm_is_read_from_the_environment(monkeypatch, caplog):
    monkeypatch.delenv(vllm_plugin.ENV_WAKE_WAIT, raising=False)
    assert vllm_plugin.wake_wait_s() == vllm_plugin.DEFAULT_WAKE_WAIT_S
    monkeypatch.setenv(vllm_plugin.ENV_WAKE_WAIT, "2.5")
    assert vllm_plugin.wake_wait_s() == 2.5
    for typo in ("soon", "nan", "-1", "1e9"):
        monkeypatch.setenv(vllm_plugin.ENV_WAKE_WAIT, typo)
        assert vllm_plugin.wake_wait_s() == vllm_plugin.DEFAULT_WAKE_WAIT_S
    assert sum(vllm_plugin.ENV_WAKE_WAIT in r.message for r in caplog.records) == 4


def test_prepare_hook_runs_when_the_kv_pool_closes_and_only_when_selected(fake_vllm, monkeypatch):
    calls = []
    monkeypatch.setattr(vllm_plugin, "prepare", lambda **kw: calls.append(kw))
    cls = fake_vllm.cumem.CuMemAllocator
    original = cls.use_memory_pool
    vllm_plugin.register()
    wrapped = cls.use_memory_pool
    assert wrapped is not original
    vllm_plugin._install_prepare_hook()  # idempotent: one wrapper
    assert cls.use_memory_pool is wrapped
    allocator = cls.get_instance()
    with cls.use_memory_pool(allocator, "kv_cache"):
        pass
    assert calls == []  # another backend selected (no current config)
    selected = SimpleNamespace(model_config=SimpleNamespace(sleep_mode_backend=vllm_plugin.BACKEND_NAME))
    monkeypatch.setattr(fake_vllm.config, "get_current_vllm_config_or_none", lambda: selected)
    with cls.use_memory_pool(allocator, "weights"):
        pass
    assert calls == []
    with cls.use_memory_pool(allocator, "kv_cache"):
        pass
    assert calls == [{}]


# ---------------------------------------------------------------------- the real thing (GPU)


def _gpu_problem() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    from omni_core.workers.backends import cumem_unavailable_reason

    reason = cumem_unavailable_reason(torch.device("cuda"))
    if reason is None and _real_vllm_factory() is None:
        reason = f"{vllm_plugin.SLEEP_MODULE} is missing (vLLM < 0.26)"
    if reason is None and _pools_made_in_this_process():
        # vLLM's CuMemAllocator keeps one pool per tag per process; a second pool under a tag
        # aborts the interpreter inside torch (seen on an H100), so each GPU test needs a fresh one.
        reason = "another test made CuMemAllocator pools in this process: run this test alone (-k)"
    return reason


def _pools_made_in_this_process() -> bool:
    cumem = importlib.import_module(vllm_plugin.CUMEM_MODULE)
    return bool(cumem.CuMemAllocator.get_instance().allocator_and_pools)


def _make_entry_point_visible(tmp_path) -> None:
    """On the device omni-core runs from PYTHONPATH, not installed: give importlib.metadata
    a dist-info with the entry point exactly as pyproject.toml declares it."""
    if any(ep.name == EP_NAME for ep in importlib.metadata.entry_points(group=vllm_plugin.ENTRY_POINT_GROUP)):
        return
    import tomllib  # Python >= 3.11, as on the device

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    group = declared[vllm_plugin.ENTRY_POINT_GROUP]
    info = tmp_path / "omni_core-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: omni-core\nVersion: 0.1.0\n")
    lines = "".join(f"{name} = {value}\n" for name, value in group.items())
    (info / "entry_points.txt").write_text(f"[{vllm_plugin.ENTRY_POINT_GROUP}]\n{lines}")
    sys.path.insert(0, str(tmp_path))


@pytest.mark.gpu
def test_gpu_plugin_through_vllm_plugin_loader_and_factory(tmp_path):
    problem = _gpu_problem()
    if problem is not None:
        pytest.skip(f"needs CUDA and vLLM >= 0.26's allocator: {problem}")
    _make_entry_point_visible(tmp_path)
    import vllm.plugins

    vllm.plugins.plugins_loaded = False
    vllm.plugins.load_general_plugins()  # what every vLLM process does at start-up
    sleep_mod = importlib.import_module(vllm_plugin.SLEEP_MODULE)
    factory = sleep_mod.SleepModeBackendFactory
    assert issubclass(factory.get_backend_class(vllm_plugin.BACKEND_NAME), sleep_mod.SleepModeBackend)

    cumem = importlib.import_module(vllm_plugin.CUMEM_MODULE)
    allocator = cumem.CuMemAllocator.get_instance()
    MiB = 1 << 20
    sizes = [3 * MiB // 2] * 40 + [256 * 1024] * 100 + [64 * MiB] * 8 + [700 * MiB]  # many small, a few large
    gens = []
    with allocator.use_memory_pool(tag="weights"):
        weights = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
    for i, w in enumerate(weights):
        gens.append(torch.Generator(device="cuda").manual_seed(i))
        w.random_(0, 256, generator=gens[-1])
    reference = [w.clone() for w in weights]  # outside the pools: stays resident
    with allocator.use_memory_pool(tag="kv_cache"):
        kv = torch.ones(512 * MiB, dtype=torch.uint8, device="cuda")
    vllm_plugin.prepare()
    backend = factory.create_backend(SimpleNamespace(sleep_mode_backend=vllm_plugin.BACKEND_NAME))
    assert type(backend).__name__ == "OmniFastSleepBackend"
    pool_bytes = allocator.get_current_usage()
    for level in (1, 1, 2):
        free_before = torch.cuda.mem_get_info()[0]
        backend.suspend(level=level)
        freed = torch.cuda.mem_get_info()[0] - free_before
        assert freed >= 0.99 * pool_bytes, (level, freed, pool_bytes)
        assert backend.state() == "SUSPENDED"
        backend.resume(["weights"])
        backend.resume(["kv_cache"])
        assert backend.state() == "RUNNING"
        kv.fill_(3)  # mapped again and writable
        if level == 1:
            assert all(torch.equal(w, r) for w, r in zip(weights, reference, strict=True))
    # vLLM's own bookkeeping stayed coherent: its stock wake_up restores our suspend
    for w, r in zip(weights, reference, strict=True):
        w.copy_(r)  # level 2 above left garbage
    backend.suspend(level=1)
    allocator.wake_up()
    assert all(torch.equal(w, r) for w, r in zip(weights, reference, strict=True))
    stats = backend.path.stats
    assert backend.path.arena_bytes() == sum(d.handle[1] for _, d in backend.path.allocations(["weights"]))
    print(f"plugin: arena {stats.arena_bytes} B prepared in {stats.arena_prepare_s:.3f} s; last {stats.last}")


@pytest.mark.gpu
def test_gpu_plugin_registers_in_the_node_ledger_and_takes_its_turn(tmp_path, monkeypatch):
    problem = _gpu_problem()
    if problem is not None:
        pytest.skip(f"needs CUDA and vLLM >= 0.26's allocator: {problem}")
    from omni_core.workers.accounting import ProcessMemory
    from omni_core.workers.device_ledger import gpu_ledger_directory, one_incoming_wake
    from omni_core.workers.ledger_files import ENV_LEDGER_DIR
    from omni_core.workers.memory_gate import WakeRefused
    from omni_core.workers.simulated_device import SimulatedDevice

    monkeypatch.setenv(ENV_LEDGER_DIR, str(tmp_path / "ledgers"))
    monkeypatch.setenv(vllm_plugin.ENV_WAKE_WAIT, "0.2")
    monkeypatch.setattr(vllm_plugin, "_member", None)  # joined afresh, under the test's ledger
    memory = ProcessMemory("cuda:0")
    if memory.physical is None:
        pytest.skip(f"NVML cannot name the GPU: {memory.nvml_problem}")
    directory = gpu_ledger_directory(memory.physical.uuid)
    ledger = SimulatedDevice(directory, memory.total_bytes())
    vllm_plugin.register()
    sleep_mod = importlib.import_module(vllm_plugin.SLEEP_MODULE)
    allocator = importlib.import_module(vllm_plugin.CUMEM_MODULE).CuMemAllocator.get_instance()
    with allocator.use_memory_pool(tag="weights"):
        weights = torch.full((64 << 20,), 7, dtype=torch.uint8, device="cuda")
    vllm_plugin.prepare()  # the arena, as the kv_cache pool's close does in a vLLM worker
    backend = sleep_mod.SleepModeBackendFactory.create_backend(
        SimpleNamespace(sleep_mode_backend=vllm_plugin.BACKEND_NAME)
    )

    def held() -> list[int]:
        return [h.nbytes for h in ledger.holders().holders if h.label == "stage vllm rank 0"]

    assert held() == [vllm_plugin.resident_bytes(backend.path)] and held()[0] >= 64 << 20
    backend.suspend(level=1)
    assert held() == [0]
    free_asleep = torch.cuda.mem_get_info()[0]
    with one_incoming_wake(directory, "stage talker rank 0, pid 4242 (engine pid 4240)", 5.0):
        with pytest.raises(WakeRefused, match=r"stage talker rank 0, pid 4242 \(engine pid 4240\)"):
            backend.resume(["weights"])
        assert backend.state() == "SUSPENDED" and torch.cuda.mem_get_info()[0] >= free_asleep - (8 << 20)
    backend.resume(["weights"])
    assert int(weights[-1]) == 7 and held()[0] >= 64 << 20
