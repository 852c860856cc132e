"""omni-core's fast sleep path for plain vLLM workers (vLLM >= 0.26).

vLLM 0.26 resolves the sleep mechanism by name through `SleepModeBackendFactory`
(`ModelConfig.sleep_mode_backend`, default "cumem"), and third parties register theirs from
a `vllm.general_plugins` entry point, which vLLM runs in every process it starts. omni-core
declares one (pyproject.toml):

    [project.entry-points."vllm.general_plugins"]
    omni_core_fast = "omni_core.vllm_plugin:register"

so with omni-core installed, a vLLM user selects the backend by its name, `omni_fast`,
in `ModelConfig.sleep_mode_backend`. vLLM 0.26 has that field but no engine argument or
command-line flag for it, so the plugin also reads OMNI_CORE_VLLM_SLEEP_BACKEND=omni_fast
from the environment of vLLM's processes (children inherit it) and then answers for every
model config that kept the default ("cumem"). Nothing else changes: the worker's
`sleep(level)` / `wake_up(tags)` land in `OmniFastSleepBackend.suspend` / `resume`, which
run `omni_core.workers.backends.fast_path.FastPath` over the worker's own CuMemAllocator
(weights offloaded into one pre-registered host arena at link speed, the rest released).

The arena is laid out when the worker's `kv_cache` pool closes (the weights are final by
then and no CUDA graph is being captured), once, synchronously, logged with its cost; set
OMNI_CORE_VLLM_PREPARE=first-sleep to defer it to the first suspend instead (no pinned host
memory until the first sleep, which then pays for it). `prepare()` does it on demand.

The process joins its GPU's node ledger (`omni_core.workers.device_ledger`, shared with every
omni-core engine of the user on the host): it registers its pools' resident bytes as holder
"stage vllm rank <device index>" and announces each change, and each resume takes the device's
incoming lock first, waiting up to OMNI_CORE_VLLM_WAKE_WAIT_S (default 60; 0: take its chance
without the lock), so omni-core's waiting wakes and vLLM's run one at a time on the GPU, and a
refusal on either side names the other's holder. Without NVML (no GPU UUID) it stays out.

Importing this module does not import vLLM: `register` imports what it needs, and the
adapter class is built on first access (`OmniFastSleepBackend`, PEP 562).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from contextlib import contextmanager
from typing import Any

import torch

log = logging.getLogger("omni_core.vllm_plugin")

BACKEND_NAME = "omni_fast"
ENTRY_POINT_GROUP = "vllm.general_plugins"
ENV_PREPARE = "OMNI_CORE_VLLM_PREPARE"  # "load" (default) | "first-sleep"
ENV_SELECT = "OMNI_CORE_VLLM_SLEEP_BACKEND"  # "omni_fast": selected without an engine argument
ENV_WAKE_WAIT = "OMNI_CORE_VLLM_WAKE_WAIT_S"  # seconds a resume waits for the device's incoming lock
DEFAULT_WAKE_WAIT_S = 60.0
MAX_WAKE_WAIT_S = 3600.0
LEDGER_STAGE = "vllm"  # the holder name other engines' refusals give this process
VLLM_DEFAULT_BACKEND = "cumem"
SLEEP_MODULE = "vllm.device_allocator.sleep_mode_backend"
CUMEM_MODULE = "vllm.device_allocator.cumem"
OFFLOAD_TAG = "weights"  # vLLM's level 1: offload weights, discard the rest

_path: Any = None
_path_lock = threading.Lock()
_member: Any = None  # the process's LedgerMember; False: none on this device (made on first use)
_member_lock = threading.Lock()


def register() -> None:
    """The entry point: make `omni_fast` known to vLLM's SleepModeBackendFactory. Safe to
    call more than once (vLLM may load plugins several times per process)."""
    try:
        import importlib

        factory = importlib.import_module(SLEEP_MODULE).SleepModeBackendFactory
    except (ImportError, AttributeError) as exc:  # vLLM < 0.26, or no vLLM: nothing to plug into
        log.debug("omni-core: no SleepModeBackendFactory to register %r with (%s)", BACKEND_NAME, exc)
        return
    with contextlib.suppress(ValueError):  # already registered in this process
        factory.register_backend(BACKEND_NAME, __name__, "OmniFastSleepBackend")
    _install_env_selection(factory)
    _install_prepare_hook()


def _chosen_by_env() -> bool:
    chosen = os.environ.get(ENV_SELECT, "")
    if chosen not in ("", BACKEND_NAME, VLLM_DEFAULT_BACKEND):
        raise ValueError(
            f"{ENV_SELECT}={chosen!r}: the omni-core plugin selects only {BACKEND_NAME!r} "
            f"(or {VLLM_DEFAULT_BACKEND!r}, vLLM's own); unset it or fix the name"
        )
    return chosen == BACKEND_NAME


class _Selection:
    """What SleepModeBackendFactory.create_backend reads of a model config: the name."""

    def __init__(self, sleep_mode_backend: str) -> None:
        self.sleep_mode_backend = sleep_mode_backend


def _install_env_selection(factory: Any) -> None:
    """Make OMNI_CORE_VLLM_SLEEP_BACKEND=omni_fast select this backend for model configs
    that kept vLLM's default. A wrapper around SleepModeBackendFactory.create_backend,
    installed once; an explicit non-default choice in the config is left alone."""
    original = factory.create_backend
    if getattr(original, "_omni_core_env_selection", False):
        return

    def create_backend(model_config: Any) -> Any:
        if _chosen_by_env() and getattr(model_config, "sleep_mode_backend", None) == VLLM_DEFAULT_BACKEND:
            # The factory's own path (is_supported, logging) under our name; the config
            # object itself is not mutated.
            return original(_Selection(BACKEND_NAME))
        return original(model_config)

    create_backend._omni_core_env_selection = True  # type: ignore[attr-defined]
    factory.create_backend = staticmethod(create_backend)


def shared_path() -> Any:
    """The process's FastPath over vLLM's CuMemAllocator singleton (made on first use)."""
    global _path
    with _path_lock:
        if _path is None:
            import importlib

            from omni_core.workers.backends.fast_path import FastPath

            cumem = importlib.import_module(CUMEM_MODULE)
            device = torch.device("cuda", torch.cuda.current_device())
            _path = FastPath(cumem.CuMemAllocator.get_instance(), cumem, device)
        return _path


def prepare(*, background: bool = False) -> None:
    """Lay out and register the host arena for the current weights now; the pools are final
    then, so the node ledger hears of them."""
    shared_path().prepare((OFFLOAD_TAG,), background=background)
    announce()


def ledger_member() -> Any:
    """The process's place in its GPU's node ledger, or None (no CUDA, no NVML)."""
    global _member
    path = shared_path()
    with _member_lock:
        if _member is None:
            _member = _make_member(path.device) or False
        return _member or None


def _make_member(device: torch.device) -> Any:
    if device.type != "cuda":
        return None
    from omni_core.workers.accounting import ProcessMemory
    from omni_core.workers.device_ledger import LedgerMember, gpu_ledger_directory

    try:
        memory = ProcessMemory(device)
        if memory.physical is None:
            log.info("omni-core: %s stays out of the node ledger (%s)", device, memory.nvml_problem)
            return None
        directory = gpu_ledger_directory(memory.physical.uuid)
        return LedgerMember(directory, memory.total_bytes(), LEDGER_STAGE, device.index or 0, wake_wait_s())
    except Exception as exc:  # the sleep path works without it; only the names are lost
        log.warning("omni-core: %s stays out of the node ledger: %s", device, exc)
        return None


def wake_wait_s() -> float:
    """OMNI_CORE_VLLM_WAKE_WAIT_S as seconds; the default, with a warning, when it is not a number
    in 0..3600 (an operator's typo must not stop the worker)."""
    raw = os.environ.get(ENV_WAKE_WAIT, "")
    if not raw:
        return DEFAULT_WAKE_WAIT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 <= value <= MAX_WAKE_WAIT_S:  # NaN fails it too
        log.warning(
            "omni-core: %s=%r is not seconds in 0..%g; using %g",
            ENV_WAKE_WAIT,
            raw[:32],
            MAX_WAKE_WAIT_S,
            DEFAULT_WAKE_WAIT_S,
        )
        return DEFAULT_WAKE_WAIT_S
    return value


def resident_bytes(path: Any) -> int:
    """The bytes the pools have mapped now."""
    from omni_core.workers.backends.copy_plan import nbytes_of

    return sum(nbytes_of(data) for ptr, data in path.allocations() if not path.is_asleep(ptr, data))


def announce() -> None:
    """Tell the node ledger what the pools hold now (nothing without a ledger)."""
    member = ledger_member()
    if member is not None:
        member.announce(resident_bytes(shared_path()))


def _selected() -> bool:
    try:
        from vllm.config import get_current_vllm_config_or_none
    except Exception:  # vLLM without its config module's dependencies: not a worker
        return False
    config = get_current_vllm_config_or_none()
    model = getattr(config, "model_config", None)
    chosen = getattr(model, "sleep_mode_backend", None)
    return chosen == BACKEND_NAME or (chosen == VLLM_DEFAULT_BACKEND and _chosen_by_env())


def _install_prepare_hook() -> None:
    """Prepare the arena when the worker's kv_cache pool closes, if this backend is the one
    selected. A wrapper around CuMemAllocator.use_memory_pool, installed once."""
    if os.environ.get(ENV_PREPARE, "load") == "first-sleep":
        return
    try:
        import importlib

        cls = importlib.import_module(CUMEM_MODULE).CuMemAllocator
    except Exception as exc:  # no CUDA build of vLLM here (an API server process, say)
        log.debug("omni-core: CuMemAllocator unavailable, arena prepared at first sleep (%s)", exc)
        return
    original = cls.use_memory_pool
    if getattr(original, "_omni_core_prepare_hook", False):
        return

    @contextmanager
    def use_memory_pool(self: Any, tag: str | None = None):
        with original(self, tag):
            yield
        if tag == "kv_cache" and _selected():
            try:
                prepare()
            except Exception:  # the first suspend prepares it instead, and fails there if it must
                log.exception("omni-core: preparing the host arena after KV-cache allocation failed")

    use_memory_pool._omni_core_prepare_hook = True  # type: ignore[attr-defined]
    use_memory_pool.__doc__ = original.__doc__
    cls.use_memory_pool = use_memory_pool


def _make_backend_class() -> type:
    import importlib

    base = importlib.import_module(SLEEP_MODULE).SleepModeBackend

    class OmniFastSleepBackend(base):  # type: ignore[misc, valid-type]
        """vLLM sleep-mode backend on omni-core's FastPath: the cumem semantics (same
        allocations, addresses, tags; level 1 offloads weights and discards the rest,
        level 2 discards everything), with the host copy in a pre-registered arena."""

        def __init__(self) -> None:
            super().__init__()
            self.path = shared_path()
            announce()  # registered from the first backend on: the pools as they are

        def suspend(self, level: int = 1) -> None:
            self._state = "SUSPENDED"
            on_cuda = self.path.device.type == "cuda"
            if on_cuda:
                torch.cuda.synchronize(self.path.device)
            tags = {data.tag for _, data in self.path.allocations()}
            offload = {OFFLOAD_TAG} & tags if level == 1 else set()
            self.path.sleep(offload, tags - offload)
            if on_cuda:
                torch.cuda.empty_cache()
            announce()

        def resume(self, tags: list[str] | None = None) -> None:
            """Wake `tags` once the device's incoming lock is ours: WakeRefused, naming the wake
            holding it, before anything is mapped when it is not within the wait."""
            from omni_core.workers.memory_gate import WakeRefused

            member = ledger_member()
            incoming = member.incoming() if member is not None else contextlib.nullcontext()
            self._state = "RESUMING"
            try:
                with incoming:
                    self.path.wake(tags)
            except WakeRefused:
                self._state = "SUSPENDED"  # nothing was mapped
                raise
            self._state = "RUNNING"
            announce()

        @classmethod
        def is_supported(cls) -> bool:
            from omni_core.workers.backends.cumem import cumem_unavailable_reason

            return torch.cuda.is_available() and cumem_unavailable_reason(torch.device("cuda")) is None

        @classmethod
        def preserves_communicators(cls) -> bool:
            return True  # NCCL buffers live outside CuMemAllocator's pools, as with "cumem"

    OmniFastSleepBackend.__module__ = __name__
    return OmniFastSleepBackend


def __getattr__(name: str) -> Any:
    if name == "OmniFastSleepBackend":
        cls = _make_backend_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
