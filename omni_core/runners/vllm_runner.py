"""A real vLLM engine as an omni-core stage: vLLM's model runner, KV cache and sampler in
the rank process, the lifecycle in omni-core's hands.

    StageSpec("thinker", runner="vllm", backend="fast", gpu_memory_fraction=0.4,
              runner_args={"model": "/models/qwen2-1.5b", "max_model_len": 2048})

Integration point: `vllm.LLM` with its engine core in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the `uni` executor; `external_launcher` when the stage
has several ranks, so each rank is one tensor-parallel shard formed from the torchrun-style
variables the launcher sets), and our own `worker_cls` (`vllm_worker.OmniVllmWorker`). Why:

- the rank process stays the one process that owns the GPU memory: vLLM's `Worker` is
  constructed here, so NVML's per-PID figure is this stage's, and the omni-core backend's
  allocator (vLLM's `CuMemAllocator` singleton under `cumem` and `fast`) is the one vLLM
  allocates through;
- the worker class is vLLM's documented extension point (`--worker-cls`) and the narrowest
  seam: it overrides only where memory is allocated (`_maybe_get_memory_pool_context`,
  answered by the omni-core backend's `pool(tag)`) and how much KV cache fits
  (`determine_available_memory`, process-scoped: the stage's fraction minus this process's
  own use, as vLLM-Omni's `OmniGPUWorkerBase`), and keeps vLLM's loading, profiling,
  KV-cache layout, scheduling and sampling;
- `LLM.sleep/wake_up` are not used: omni-core's backend sleeps and wakes the pools, with
  what vLLM's own sleep does around it done here: the prefix cache reset before a sleep
  (its blocks would point into released memory), every buffer saved for level 2
  (`buffers_to_save`, as `Worker.sleep(level=2)`), `post_kv_cache_wake_up` after the KV
  cache is mapped again, and reloads through `model_runner.reload_weights(weights_path=)`;
- weight updates (P-17: IPC buckets, a broadcast, shared memory) go through the same vLLM call
  with the tensors as an iterator (`reload_weights(weights_iterator=)`): vLLM's own
  `model.load_weights` and its layer-wise reload, so fused (qkv, gate_up), tensor-parallel
  and quantized layouts are written as vLLM writes them when it loads, into the same
  allocations. The names, shapes and dtypes an update may carry are the checkpoint's.

The runner needs an allocator backend (`cumem` or `fast`): vLLM's tensors must keep their
addresses across a sleep, which the portable backend does not promise.

Requests use the same payload as the `transformers` runner (runners/generation.py).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import torch

from omni_core.fsm.tags import COMM_TAG, CUDA_GRAPH_TAG, KV_CACHE_TAG, WEIGHTS_TAG
from omni_core.protocol import AddAdapter
from omni_core.runners.base import DerivedCache, MemoryBudget, ModelRunner, OpenPool, RunnerArgumentError
from omni_core.runners.generation import GenerationRequest, is_int, parse_each, parse_generation
from omni_core.runners.lora import check_peft_dir, lora_specs, peft_alpha, write_peft_dir
from omni_core.runners.weights import (
    SAFETENSORS_DTYPES,
    HeaderEntry,
    ReloadReport,
    opened_without_links,
    read_headers,
    resolved,
)

log = logging.getLogger("omni_core.runners.vllm")

WORKER_CLS = "omni_core.runners.vllm_worker.OmniVllmWorker"
DEFAULT_MAX_MODEL_LEN = 2048
# vLLM's ShardedStateLoader.DEFAULT_PATTERN: what its save_sharded_state writes, per rank.
SHARDED_PATTERN = "model-rank-{rank}-part-{part}.safetensors"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".safetensors.index.json")  # not copied beside a save
MAX_PROBLEMS = 5
PREFIX_KV_CACHE = "prefix_kv"  # vLLM's cached prefix blocks (DerivedCache)
DEFAULT_MAX_NUM_SEQS = 8
MAX_NUM_SEQS_LIMIT = 1024
# Arguments the runner sets itself: a user value would break the lifecycle's ownership.
OWNED_ENGINE_ARGS = frozenset(
    {
        "model",
        "tokenizer",
        "worker_cls",
        "enable_sleep_mode",
        "gpu_memory_utilization",
        "kv_cache_memory_bytes",
        "tensor_parallel_size",
        "distributed_executor_backend",
        "load_format",
        "max_model_len",
        "max_num_seqs",
        "dtype",
        "seed",
        "enforce_eager",
    }
)
ALLOCATOR_BACKENDS = ("cumem", "fast")
VLLM_TAGS = (WEIGHTS_TAG, KV_CACHE_TAG, CUDA_GRAPH_TAG, COMM_TAG)
# vLLM's own opt-ins for the memory beyond its weights and KV cache (vLLM 0.34; 0.26 has none):
# its CUDA graphs captured into the CuMemAllocator's "cudagraph" pool, offloaded at a sleep and
# restored in place at a wake; its NCCL communicators suspended (ncclCommSuspend) and resumed.
TAG_ENGINE_ARGS: dict[str, dict[str, Any]] = {
    CUDA_GRAPH_TAG: {"enable_sleep_mode": True, "sleep_mode_offload_cudagraph": True},
    COMM_TAG: {"enable_sleep_mode": True, "enable_nccl_comm_suspend": True},
}


def _engine_arg_names() -> frozenset[str]:
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    return frozenset(f.name for f in dataclasses.fields(EngineArgs))


def tag_engine_args(tags: frozenset[str], names: Callable[[], frozenset[str]] = _engine_arg_names) -> dict[str, Any]:
    """The engine arguments the stage's tags `cuda_graph` and `comm` ask of vLLM; refused,
    naming them, where this vLLM lacks them (the stage then drops the tags)."""
    wanted: dict[str, Any] = {}
    for tag in sorted(tags & TAG_ENGINE_ARGS.keys()):
        wanted.update(TAG_ENGINE_ARGS[tag])
    missing = sorted(set(wanted) - names()) if wanted else []
    if missing:
        raise ValueError(
            f"this vLLM has no engine args {missing}, which the tags {sorted(tags & TAG_ENGINE_ARGS.keys())} need "
            "(vLLM's own graph-pool offload and communicator suspend, vLLM >= 0.34); drop those tags from the stage"
        )
    return wanted


LOAD_FORMATS = ("safetensors", "dummy")  # vLLM's names: the checkpoint's weights, or random ones


def _check_options(
    load_format: str, max_num_seqs: int, gpu_memory_utilization: float, engine_args: Mapping[str, Any] | None
) -> None:
    """The runner's arguments that need no checkpoint, checked before anything is read."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format must be one of {list(LOAD_FORMATS)}, got {load_format!r}: 'dummy' reads no "
            "weights (vLLM's random ones), for a rollout whose trainer sends them"
        )
    if not is_int(max_num_seqs) or not 1 <= max_num_seqs <= MAX_NUM_SEQS_LIMIT:
        raise ValueError(f"max_num_seqs must be an int in 1..{MAX_NUM_SEQS_LIMIT}, got {max_num_seqs!r}")
    if not isinstance(gpu_memory_utilization, float) or not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be a float in (0, 1], got {gpu_memory_utilization!r}")
    owned = sorted(set(engine_args or {}) & OWNED_ENGINE_ARGS)
    if owned:
        raise ValueError(
            f"engine_args {owned} are set by the vllm runner itself; use the runner's own "
            "arguments (model, dtype, max_model_len, max_num_seqs, seed, enforce_eager) or the "
            "stage's (ranks, gpu_memory_fraction, backend)"
        )


@dataclass
class _Binding:
    """What the worker class needs from the runner. vLLM constructs its worker by class
    path with vLLM's own arguments, so the runner hands these over through this one slot
    for the duration of the engine's construction (same process, same thread)."""

    open_pool: OpenPool
    budget: MemoryBudget | None
    worker: Any = None  # the OmniVllmWorker, set by its __init__
    kv_cache_bytes: int | None = None  # what determine_available_memory granted


_binding: _Binding | None = None


def current_binding() -> _Binding:
    if _binding is None:
        raise RuntimeError(
            "OmniVllmWorker is constructed by VllmRunner.load (runner='vllm'); it cannot be used as "
            "a plain vLLM worker_cls outside an omni-core rank"
        )
    return _binding


@contextmanager
def _bound(binding: _Binding) -> Iterator[None]:
    global _binding
    _binding = binding
    try:
        yield
    finally:
        _binding = None


def kv_cache_bytes(budget: MemoryBudget, torch_memory_stats: Mapping[str, int]) -> int:
    """The KV cache a rank may allocate after vLLM's profiling run: what its fraction still
    allows this process (NVML, its own pid) minus the activation peak that torch's cache
    has already given back (the profile's peak must fit again at serving time, and memory
    released since the peak is no longer counted as this process's)."""
    released_bytes = max(
        0,
        torch_memory_stats.get("reserved_bytes.all.peak", 0) - torch_memory_stats.get("reserved_bytes.all.current", 0),
    )
    return max(0, budget.available_bytes() - released_bytes)


def compare_checkpoints(own: Mapping[str, HeaderEntry], other: Mapping[str, HeaderEntry], source: str) -> None:
    """Refuse a reload source whose tensors differ from the loaded checkpoint's in name,
    shape or dtype, naming the first difference (vLLM's reload would stop half-way)."""
    for name in sorted(own):
        if name not in other:
            raise RunnerArgumentError(
                f"reload source {source!r} has no tensor {name!r} (the loaded checkpoint "
                "has it); give a checkpoint of the same architecture"
            )
        mine, theirs = own[name], other[name]
        if (mine.shape, mine.dtype) != (theirs.shape, theirs.dtype):
            raise RunnerArgumentError(
                f"reload source {source!r}: tensor {name!r} is "
                f"{theirs.dtype}{list(theirs.shape)}, the loaded model's is "
                f"{mine.dtype}{list(mine.shape)}"
            )
    extra = sorted(set(other) - set(own))
    if extra:
        raise RunnerArgumentError(
            f"reload source {source!r} has tensor {extra[0]!r} that the loaded checkpoint "
            f"does not ({len(extra)} such); give a checkpoint of the same architecture"
        )


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    finish_reason: str  # vLLM's: "stop", "length", "abort"


class VllmEngine:
    """The seam to vLLM: all the runner asks of `vllm.LLM`, nothing else (CPU tests put a
    recorded stand-in here; the GPU tests run this)."""

    def __init__(self, engine_kwargs: dict[str, Any]) -> None:
        from vllm import LLM

        self._llm = LLM(**engine_kwargs)

    def tokenizer(self) -> Any:
        return self._llm.get_tokenizer()

    def generate(
        self, rows: list[list[int]], sampling_params: Sequence[dict[str, Any]], lora: LoraSlot | None = None
    ) -> list[Completion]:
        """One completion per row, each row under its own SamplingParams: every request of a
        rank's batch goes into vLLM's engine in one call, so its scheduler batches them all
        into each step (continuous batching, prefix caching) as plain vLLM does; with `lora`,
        every row through that adapter (vLLM's LoRARequest)."""
        from vllm import SamplingParams

        outputs = self._llm.generate(
            [{"prompt_token_ids": row} for row in rows],
            [SamplingParams(**params) for params in sampling_params],
            use_tqdm=False,
            lora_request=self._request(lora) if lora is not None else None,
        )
        return [Completion(list(o.outputs[0].token_ids), str(o.outputs[0].finish_reason)) for o in outputs]

    # The engine loop behind `generate`, driven by the rank (continuous batching): vLLM's
    # LLMEngine adds a request to its scheduler at once and each step decodes every running one.
    def add_request(self, request_id: str, row: list[int], sampling_params: dict[str, Any]) -> str:
        from vllm import SamplingParams

        # vLLM returns its internal id (ours plus a random suffix); its outputs and aborts use ours.
        self._llm.llm_engine.add_request(request_id, {"prompt_token_ids": row}, SamplingParams(**sampling_params))
        return request_id

    def step(self) -> list[tuple[str, Completion]]:
        """One engine step; the requests it finished."""
        done = []
        for output in self._llm.llm_engine.step():
            if output.finished:
                first = output.outputs[0]
                done.append((str(output.request_id), Completion(list(first.token_ids), str(first.finish_reason))))
        return done

    def abort(self, request_ids: list[str]) -> None:
        self._llm.llm_engine.abort_request(request_ids)

    def has_unfinished(self) -> bool:
        return bool(self._llm.llm_engine.has_unfinished_requests())

    def reset_prefix_cache(self) -> bool:
        return bool(self._llm.reset_prefix_cache())

    # vLLM's own LoRA (enable_lora): its add_lora, remove_lora, pin_lora, list_loras.
    @staticmethod
    def _request(lora: LoraSlot) -> Any:
        from vllm.lora.request import LoRARequest

        return LoRARequest(lora.name, lora.lora_int_id, lora.path)

    def add_lora(self, lora: LoraSlot) -> bool:
        return bool(self._llm.llm_engine.add_lora(self._request(lora)))

    def remove_lora(self, lora_int_id: int) -> bool:
        return bool(self._llm.llm_engine.remove_lora(lora_int_id))

    def pin_lora(self, lora_int_id: int) -> bool:
        return bool(self._llm.llm_engine.pin_lora(lora_int_id))

    def list_loras(self) -> set[int]:
        return set(self._llm.llm_engine.list_loras())


@dataclass
class _EngineRequests:
    """The requests in vLLM's engine by the rank's key, and each row's vLLM id to its key."""

    by_key: dict[str, _Running] = field(default_factory=dict)
    row_keys: dict[str, str] = field(default_factory=dict)


@dataclass
class _Running:
    """A request in vLLM's engine between steps: its rows' request ids, and what finished."""

    request: GenerationRequest
    row_ids: list[str]
    finished: dict[str, Completion]


@dataclass(frozen=True)
class LoraSlot:
    """An adapter as vLLM's LoRARequest names it."""

    name: str
    lora_int_id: int
    path: str


class VllmRunner(ModelRunner):
    execute_writes_weights = False  # inference: requests read the weights only
    engine_factory: Any = VllmEngine  # (engine_kwargs) -> a VllmEngine

    def __init__(
        self,
        device: torch.device,
        *,
        model: str,
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        gpu_memory_utilization: float = 0.9,
        seed: int = 0,
        enforce_eager: bool = True,
        attention_backend: str | None = None,
        engine_args: Mapping[str, Any] | None = None,
        load_format: str = "safetensors",
    ) -> None:
        super().__init__(device)
        _check_options(load_format, max_num_seqs, gpu_memory_utilization, engine_args)
        self.model_dir = Path(model).expanduser()
        config_path = self.model_dir / "config.json"
        if not config_path.is_file():
            raise ValueError(
                f"model={model!r} is not a checkpoint directory (no config.json); give a local "
                "directory, e.g. one written by `omni-core models make qwen2 tiny DIR`"
            )
        self.config = json.loads(config_path.read_text())
        positions = int(self.config.get("max_position_embeddings") or DEFAULT_MAX_MODEL_LEN)
        if max_model_len is None:
            max_model_len = min(positions, DEFAULT_MAX_MODEL_LEN)
        if not is_int(max_model_len) or not 2 <= max_model_len <= positions:
            raise ValueError(
                f"max_model_len must be an int in 2..{positions} (max_position_embeddings), got {max_model_len!r}"
            )
        self.max_model_len, self.max_num_seqs = max_model_len, max_num_seqs
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.engine_kwargs: dict[str, Any] = {
            "model": str(self.model_dir),
            "tokenizer": str(self.model_dir),
            "dtype": dtype,
            "max_model_len": max_model_len,
            "max_num_seqs": max_num_seqs,
            "seed": seed,
            "enforce_eager": enforce_eager,
            "load_format": load_format,
            "worker_cls": WORKER_CLS,
            "gpu_memory_utilization": gpu_memory_utilization,
            "tensor_parallel_size": self.world_size,
            "distributed_executor_backend": "external_launcher" if self.world_size > 1 else "uni",
            **dict(engine_args or {}),
        }
        if attention_backend is not None:
            self.engine_kwargs["attention_config"] = {"backend": attention_backend}
        # vLLM's load_format "dummy" reads no checkpoint: the rank says Hello NEEDS_RELOAD until an update.
        self.dummy_weights = load_format == "dummy"
        self.llm: Any = None
        self.held: frozenset[str] = frozenset()  # the runner's own tags: `comm` when the stage has it
        self.worker: Any = None
        self.tokenizer: Any = None
        self.kv_cache_bytes: int | None = None
        self.own_headers = read_headers(self.model_dir)
        self.last_reload: ReloadReport | None = None
        # P-20: adapters in vLLM's LoRA slots (engine_args enable_lora, max_loras: at most vLLM's).
        self.loras: dict[str, LoraSlot] = {}
        self._running = _EngineRequests()  # continuous batching: the requests in vLLM's engine
        self._lora_root: Path | None = None  # refits' directories (write_adapter), removed at close

    # ------------------------------------------------------------------ allocation

    def load(self, open_pool: OpenPool, tags: Iterable[str], budget: MemoryBudget | None) -> None:
        tags = list(tags)
        if not {WEIGHTS_TAG, KV_CACHE_TAG} <= set(tags) or set(tags) - set(VLLM_TAGS):
            raise ValueError(
                f"the vllm runner allocates the tags {[WEIGHTS_TAG, KV_CACHE_TAG]} (vLLM's pools), and "
                f"optionally {[CUDA_GRAPH_TAG, COMM_TAG]} (vLLM's graph pool and communicators); the stage has {tags}"
            )
        self.held = frozenset(tags) & {COMM_TAG}
        backend_name = getattr(getattr(open_pool, "__self__", None), "name", None)
        if backend_name is not None and backend_name not in ALLOCATOR_BACKENDS:
            raise ValueError(
                f"the vllm runner needs an allocator backend {list(ALLOCATOR_BACKENDS)} (vLLM's tensors "
                f"must keep their addresses across a sleep); the stage has backend={backend_name!r}"
            )
        kwargs = {**self.engine_kwargs, **tag_engine_args(frozenset(tags))}
        if budget is not None:
            # vLLM checks at start-up that this much of the device is free; the KV cache is
            # then sized by OmniVllmWorker from this process's own use, not device-wide.
            kwargs["gpu_memory_utilization"] = budget.fraction
        # The engine core in this process: the rank process owns the memory and the lifecycle.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        binding = _Binding(open_pool, budget)
        started = time.perf_counter()
        with _bound(binding):
            self.llm = self.engine_factory(kwargs)
        if binding.worker is None:
            raise RuntimeError(
                f"vLLM did not construct {WORKER_CLS} in this process; the vllm runner needs the "
                "in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0)"
            )
        self.worker, self.kv_cache_bytes = binding.worker, binding.kv_cache_bytes
        self.tokenizer = self.llm.tokenizer()
        log.info(
            "vllm engine for %s ready in %.1f s: KV cache %s bytes, %s ranks",
            self.model_dir,
            time.perf_counter() - started,
            self.kv_cache_bytes,
            self.world_size,
        )

    def load_weights(self) -> None:
        raise NotImplementedError("the vllm runner allocates weights and KV cache together in load()")

    def allocate_caches(self) -> None:
        raise NotImplementedError("the vllm runner allocates weights and KV cache together in load()")

    def tensors(self, tag: str) -> list[torch.Tensor]:
        # Allocator backends (the only ones this runner accepts) see allocations themselves.
        if tag in (WEIGHTS_TAG, KV_CACHE_TAG):
            return []
        raise ValueError(f"the vllm runner has no tag {tag!r}; it has {[WEIGHTS_TAG, KV_CACHE_TAG]}")

    def _model(self) -> torch.nn.Module:
        if self.worker is None:
            raise RuntimeError("the vllm engine is not loaded")
        return self.worker.model_runner.get_model()

    def buffers_to_save(self) -> dict[str, torch.Tensor]:
        # As vLLM's Worker.sleep(level=2): every buffer, since reload_weights restores
        # parameters only. The backend copies those whose pool is discarded.
        return dict(self._model().named_buffers()) if self.worker is not None else {}

    def before_sleep(self, offload: frozenset[str], discard: frozenset[str]) -> None:
        # Cached prefix blocks would point into a KV cache that is about to be released.
        if KV_CACHE_TAG in offload | discard:
            self.reset_prefix_cache()
        if COMM_TAG in (offload | discard) & self.held:
            from vllm.distributed.parallel_state import suspend_device_comms

            suspend_device_comms()  # ncclCommSuspend: collective, every rank sleeps the tag

    def runner_tags(self) -> frozenset[str]:
        return self.held

    def reset_prefix_cache(self) -> int | None:
        """vLLM's own reset: every cached prefix block is freed for reuse, the KV cache stays
        mapped. vLLM does not say how many blocks it dropped: None."""
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running?)")
        return None

    def derived_caches(self) -> tuple[DerivedCache, ...]:
        # vLLM v1 caches prefixes unless told not to: blocks keyed by their tokens alone, so KV
        # the old weights computed would serve a prompt after an update (or a reload).
        if self.engine_kwargs.get("enable_prefix_caching") is False:
            return ()
        return (DerivedCache(PREFIX_KV_CACHE, keyed_by_version=False),)

    def after_wake(self, tags: frozenset[str]) -> None:
        if COMM_TAG in tags & self.held:
            from vllm.distributed.parallel_state import resume_device_comms

            resume_device_comms()
        if KV_CACHE_TAG in tags:
            self.worker.model_runner.post_kv_cache_wake_up()

    def reload_weights(self, source: str | None) -> None:
        if source is not None and not isinstance(source, str):
            raise RunnerArgumentError(f"the reload source must be a checkpoint directory path, got {source!r}")
        # Resolved once: vLLM opens the very directory whose headers were compared.
        directory = resolved(Path(source).expanduser()) if source else self.model_dir
        if any(directory.glob(SHARDED_PATTERN.format(rank="*", part="*"))):  # what save_weights wrote
            self.last_reload = self._reload_sharded(directory)
            return
        compare_checkpoints(self.own_headers, read_headers(directory), str(directory))
        total_bytes = sum(_entry_bytes(e) for e in self.own_headers.values())
        started = time.perf_counter()
        self.worker.model_runner.reload_weights(weights_path=str(directory))
        if self.device.type == "cuda":  # the report times the refill, not its launch
            torch.cuda.synchronize(self.device)
        self.last_reload = ReloadReport(
            str(directory), total_bytes, len(self.own_headers), time.perf_counter() - started
        )
        log.info(
            "reloaded %s: %.2f GB in %.2f s (%.1f GB/s)",
            directory,
            total_bytes / 1e9,
            self.last_reload.duration_s,
            self.last_reload.gb_per_s,
        )

    def save_weights(self, directory: Path, max_file_bytes: int) -> list[str]:
        """vLLM's own save_sharded_state on this rank's worker: its model's state dict (vLLM's
        parameter names, this rank's tensor-parallel shard) as `model-rank-<r>-part-<i>.safetensors`
        files of at most `max_file_bytes`, beside the model's config and tokenizer files, so
        that `LLM(model=directory, load_format="sharded_state")` loads it and this runner's
        reload reads it back."""
        save = getattr(self.worker, "save_sharded_state", None)
        if save is None:
            raise RunnerArgumentError(
                "this vLLM's worker has no save_sharded_state; SaveWeights needs a vLLM that has it (0.4 and later)"
            )
        save(str(directory), pattern=None, max_size=max_file_bytes)
        for path in sorted(self.model_dir.iterdir()):
            if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES):
                shutil.copyfile(path, directory / path.name)  # as vLLM's example saves them beside
        return sorted(p.name for p in directory.iterdir())

    def weights_origin(self) -> str | None:
        return None if self.dummy_weights else str(self.model_dir)

    def _reload_sharded(self, directory: Path) -> ReloadReport:
        """A directory save_weights wrote: this rank's files copied into the model's state dict,
        every name, shape and dtype checked first (vLLM's ShardedStateLoader reads it so)."""
        from safetensors import safe_open

        rank = int(os.environ.get("RANK", "0"))
        files = sorted(directory.glob(SHARDED_PATTERN.format(rank=rank, part="*")))
        state = self._model().state_dict()
        problems = []
        for path in files:
            with opened_without_links(resolved(path)) as name, safe_open(name, framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    piece = f.get_slice(key)
                    have = state.get(key)
                    if have is None or tuple(piece.get_shape()) != tuple(have.shape):
                        problems.append(f"tensor {key!r} {piece.get_shape()} is not the model's")
        if not files or problems:
            raise RunnerArgumentError(
                f"cannot reload {str(directory)!r} as this rank's sharded state (rank {rank}): "
                f"{problems[:MAX_PROBLEMS] or 'no ' + SHARDED_PATTERN.format(rank=rank, part='*') + ' file'}"
            )
        started, moved_bytes, tensors = time.perf_counter(), 0, 0
        with torch.no_grad():
            for path in files:
                with opened_without_links(resolved(path)) as name, safe_open(name, framework="pt", device="cpu") as f:
                    for key in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                        tensor = f.get_tensor(key)
                        state[key].copy_(tensor)
                        moved_bytes, tensors = moved_bytes + tensor.numel() * tensor.element_size(), tensors + 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return ReloadReport(str(directory), moved_bytes, tensors, time.perf_counter() - started)

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The loaded checkpoint's tensors (a trainer's Hugging Face state_dict names), not
        vLLM's fused parameters: vLLM's loader maps one onto the other."""
        specs = {}
        for name, entry in self.own_headers.items():
            if entry.dtype not in _TORCH_DTYPES:
                continue  # no update can carry it; check_specs names it if one tries
            specs[name] = (entry.shape, _TORCH_DTYPES[entry.dtype])
        embedding = specs.get("model.embed_tokens.weight")
        if self.config.get("tie_word_embeddings") and embedding is not None:
            # A trainer's state_dict names the tied head too; vLLM's loader skips it (the
            # embedding it is tied to carries the values).
            specs.setdefault("lm_head.weight", embedding)
        return specs

    def update_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.worker is None:
            raise RuntimeError("update_weights before the vllm engine is loaded")
        counted: list[int] = [0, 0]  # tensors, bytes

        def counting() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in named:
                counted[0] += 1
                counted[1] += tensor.numel() * tensor.element_size()
                yield name, tensor

        started = time.perf_counter()
        with torch.no_grad():
            self.worker.model_runner.reload_weights(weights_iterator=counting(), is_checkpoint_format=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last_reload = ReloadReport("update", counted[1], counted[0], time.perf_counter() - started)

    def close(self) -> None:
        self.llm = self.worker = None
        if self._lora_root is not None:
            shutil.rmtree(self._lora_root, ignore_errors=True)
            self._lora_root = None

    # ------------------------------------------------------------------ LoRA adapters (P-20)

    def check_adapter(self, command: AddAdapter) -> None:
        """vLLM loads the tensors itself; what it is given is checked here first: LoRA enabled,
        a PEFT directory of this architecture, of the rank and modules the command says (its
        tensors, when they come through a weight plane, by the receiver against adapter_specs)."""
        if not self.engine_kwargs.get("enable_lora"):
            raise RunnerArgumentError(
                "this vllm stage was started without LoRA: set runner_args engine_args "
                "{enable_lora: true, max_loras, max_lora_rank} to serve adapters"
            )
        if command.tensors is None:
            check_peft_dir(command, (self.config.get("architectures") or [""])[0])
        elif not lora_specs(self.weight_specs(), command):
            raise RunnerArgumentError(
                f"adapter {command.name!r} targets modules {list(command.target_modules)}, none of them a "
                "linear weight of this model; nothing was loaded"
            )

    def adapter_specs(self, command: AddAdapter) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return lora_specs(self.weight_specs(), command)

    def write_adapter(self, command: AddAdapter, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """vLLM's add_lora loads from a directory only: the checked tensors are written to one of
        this rank's own (a private temporary directory, one per adapter version, removed with
        the adapter) and loaded from there, through vLLM's own LoRA manager."""
        import tempfile

        if self._lora_root is None:
            self._lora_root = Path(tempfile.mkdtemp(prefix="omni-lora-"))
        held = self.loras.get(command.name)
        alpha = command.lora_alpha or (peft_alpha(held.path) if held is not None else None) or float(command.rank)
        directory = self._lora_root / f"{command.adapter_id}-v{command.version}"
        try:
            write_peft_dir(directory, command, alpha, tensors)
            self.add_adapter(msgspec.structs.replace(command, source=str(directory), tensors=None))
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)  # nothing of a failed refit stays on disk
            raise
        if held is not None and held.path.startswith(str(self._lora_root)) and held.path != str(directory):
            shutil.rmtree(held.path, ignore_errors=True)

    def add_adapter(self, command: AddAdapter) -> None:
        slot = LoraSlot(command.name, command.adapter_id, str(Path(command.source).expanduser()))
        old = self.loras.pop(command.name, None)
        if old is not None:
            self.llm.remove_lora(old.lora_int_id)
        if not self.llm.add_lora(slot):
            raise RuntimeError(f"vLLM refused LoRA adapter {command.name!r} from {slot.path}")
        self.loras[command.name] = slot
        if command.pinned:
            self.llm.pin_lora(slot.lora_int_id)

    def remove_adapter(self, name: str) -> None:
        slot = self.loras.pop(name, None)
        if slot is not None:
            self.llm.remove_lora(slot.lora_int_id)
            if self._lora_root is not None and slot.path.startswith(str(self._lora_root)):
                shutil.rmtree(slot.path, ignore_errors=True)  # a refit's own directory

    def pin_adapter(self, name: str, pinned: bool) -> None:
        if pinned and name in self.loras:  # vLLM unpins only by removing
            self.llm.pin_lora(self.loras[name].lora_int_id)

    def execute_adapter(self, payload: Any, adapter: str) -> dict[str, Any]:
        return self.execute(payload, self.loras[adapter])

    # ------------------------------------------------------------------ execution

    def execute(self, payload: Any, lora: LoraSlot | None = None) -> dict[str, Any]:
        """The transformers runner's payload and result (runners/generation.py), generated by
        vLLM: greedy is temperature 0; a seeded request is reproducible on its own."""
        (out,) = self.execute_batch([payload], lora)
        if isinstance(out, Exception):
            raise out
        return dict(out)

    def execute_batch(self, payloads: Sequence[Any], lora: LoraSlot | None = None) -> list[Any]:
        """Every request of the batch in one `generate` over all their prompts, each prompt
        with its request's sampling: vLLM schedules them together (up to max_num_seqs per
        step, the rest as sequences finish). A payload that does not parse is its own error.
        `lora`: the adapter every request of the batch runs through (P-20)."""
        if self.llm is None:
            raise RuntimeError("VllmRunner.execute before load")
        parsed = parse_each(payloads, self._parse)
        requests = [r for r in parsed if isinstance(r, GenerationRequest)]
        rows = [row for r in requests for row in r.rows]
        params = [self._sampling_params(r) for r in requests for _ in r.rows]
        if not rows:
            completions = []
        else:  # the adapter's argument only where there is one: the seam's older stand-ins lack it
            completions = self.llm.generate(rows, params, lora) if lora else self.llm.generate(rows, params)
        outputs: list[Any] = []
        for request in parsed:
            if isinstance(request, Exception):
                outputs.append(request)
                continue
            mine, completions = completions[: len(request.rows)], completions[len(request.rows) :]
            outputs.append(self._shape(request, mine))
        return outputs

    def supports_continuous(self) -> bool:
        return self.llm is not None and hasattr(self.llm, "add_request")  # older seam stand-ins lack it

    def start_request(self, key: str, payload: Any) -> None:
        if self.llm is None:
            raise RuntimeError("VllmRunner.start_request before load")
        if key in self._running.by_key:
            raise ValueError(f"request key {key!r} is running already; each running request needs its own key")
        request = self._parse(payload)
        params = self._sampling_params(request)
        row_ids = [self.llm.add_request(f"{key}/{j}", row, params) for j, row in enumerate(request.rows)]
        self._running.by_key[key] = _Running(request, row_ids, {})
        self._running.row_keys.update((row_id, key) for row_id in row_ids)

    def running_requests(self) -> int:
        return len(self._running.by_key)

    def step_requests(self) -> list[tuple[str, Any]]:
        """One step of vLLM's engine; each request whose every row finished, shaped as
        `execute` shapes it. A raise aborts and forgets every running request."""
        try:
            finished = self.llm.step() if self._running.by_key else []
        except Exception:
            self._forget_running()
            raise
        done: list[tuple[str, Any]] = []
        for row_id, completion in finished:
            key = self._running.row_keys.pop(row_id, None)
            if key is None:  # a row of no request of ours (aborted earlier): nothing waits on it
                continue
            running = self._running.by_key[key]
            running.finished[row_id] = completion
            if len(running.finished) == len(running.row_ids):
                del self._running.by_key[key]
                done.append((key, self._shape(running.request, [running.finished[r] for r in running.row_ids])))
        if self._running.by_key and not done and not self.llm.has_unfinished():
            lost = len(self._running.by_key)
            self._forget_running()
            raise RuntimeError(
                f"vLLM's engine holds none of the {lost} requests this rank started and finished none of them "
                "(an id it did not echo back?); they fail rather than wait: report a bug with the rank's log"
            )
        return done

    def _forget_running(self) -> None:
        row_ids = list(self._running.row_keys)
        self._running.by_key.clear()
        self._running.row_keys.clear()
        try:
            self.llm.abort(row_ids)
        except Exception:  # the engine failing again: the rows are gone from our books either way
            log.warning("aborting %d rows after a failed step also failed", len(row_ids), exc_info=True)

    def _parse(self, payload: Any) -> GenerationRequest:
        return parse_generation(
            payload,
            tokenizer=self.tokenizer,
            vocab_size=int(self.config["vocab_size"]),
            max_batch=self.max_num_seqs,
            max_seq_len=self.max_model_len,
            model_dir=self.model_dir,
        )

    def _shape(self, request: GenerationRequest, completions: list[Completion]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "token_ids": [c.token_ids for c in completions],
            "finish_reason": ["stop" if c.finish_reason == "stop" else "length" for c in completions],
            "prompt_tokens": [len(r) for r in request.rows],
        }
        if self.tokenizer is not None:
            # Decoded here as the transformers runner does (vLLM detokenizes nothing: a
            # checkpoint's vocabulary may be larger than its tokenizer's).
            out["text"] = [self.tokenizer.decode(ids) for ids in out["token_ids"]]
        if not request.batched:
            out = {key: value[0] for key, value in out.items()}
        return out

    @staticmethod
    def _sampling_params(request: GenerationRequest) -> dict[str, Any]:
        """vLLM's SamplingParams fields: greedy is temperature 0, top_k 0 means all tokens."""
        sampling = request.sampling
        greedy = sampling.temperature is None
        return {
            "max_tokens": request.max_new_tokens,
            "ignore_eos": not request.stop_at_eos,
            "detokenize": False,
            "temperature": 0.0 if greedy else sampling.temperature,
            "seed": None if greedy else sampling.seed,
            "top_k": sampling.top_k or 0,
        }


_TORCH_DTYPES = SAFETENSORS_DTYPES


def _entry_bytes(entry: HeaderEntry) -> int:
    count = 1
    for size in entry.shape:
        count *= size
    dtype = _TORCH_DTYPES.get(entry.dtype)
    return count * (dtype.itemsize if dtype is not None else 2)
