"""A diffusion pipeline from a local diffusers directory, as a worker's runner, step-wise.

    StageSpec("decoder", runner="diffusers", tags=("weights", "kv_cache", "requests"),
              runner_args={"model": "/models/dit", "max_requests": 8, "scheduler": "DPMSolverMultistepScheduler"})

Pipelines: `DiTPipeline` (class-conditional DiT + VAE, classifier-free guidance),
`DDPMPipeline` (unconditional UNet) and `StableDiffusionPipeline` (CLIP text encoder, UNet,
VAE). The denoising loop is the pipeline's own, step for step (the tests compare the output
with `pipeline(...)` bit for bit), cut so it can stop between steps:

    {"op": "start", "class_label": 207, "seed": 1, "steps": 25, "guidance_scale": 4.0} -> {"request_id": "r1", ...}
    {"op": "step", "request_id": "r1", "steps": 5}     -> {"steps_done": 5, "steps_total": 25, ...}
    {"op": "finish", "request_id": "r1"}                -> the image (remaining steps first)
    {"op": "cancel", "request_id": "r1"}
    {"class_label": 207, "seed": 1, "steps": 25}        -> the image in one call (no state kept)
    {"prompt": "a cat", "negative_prompt": "blurry", "seed": 1, "steps": 25}   (Stable Diffusion)
    {"op": "prompt_cache", "clear": true}               -> entries, hits, misses (clear is optional;
                                                           the counters also reach status and metrics)

Any request (one call, or "start") may add `"trajectory": true`: its result then also carries
every step's latents, the timesteps, each step's log-probability and the prompt embeddings,
what diffusion RL trains on (omni_core/runners/diffusion_trajectory.py).

With `step_cache_threshold` (DiT only; omni_core/runners/step_cache.py), steps whose
transformer input changed little since the last computed step reuse its residual instead of
running the blocks (TeaCache's method); the counters `step_cache_hits` and `step_cache_misses`
say how many, and the cache's tensors are parked with the request's latents, or with the tag
`step_cache` in a pool of their own that sleeps give back (omni_core/runners/step_cache_pool.py).

Step-wise ops of several requests that the rank batches (StageSpec.batch_max_requests) run
together: one denoiser call per step over the rows of every request still stepping
(`execute_batch`); DiT's result is the request's own bit for bit, a UNet's within 1e-5 of the
latents' magnitude (its convolutions round differently at another batch size). The rank's
Hello declares the capability `step_mode` and lists the weights read at load
(`loaded_weights`); `load_format="dummy"` builds every model from its config with random
weights and reads no weight file (a trainer's first update fills them).

With `offload="layerwise"` (and the tag `offload`), the denoiser's blocks stay on the host and
stream through one device slab, a block at a time (omni_core/runners/block_offload.py). A
stage of two ranks (WORLD_SIZE 2) runs each guided step CFG-parallel, a guidance half per rank
(omni_core/runners/cfg_parallel.py), or splits a DiT's tokens with `parallel="ulysses"` or
`"ring"` (omni_core/runners/diffusion_parallel.py); a world the runner cannot split is refused
at start. The ranks of such a stage batch only the requests every one of them holds.

Images come back as PNG bytes with the sha256 of the raw output tensor (float, [0, 1]).
Text embeddings are cached by prompt when the stage has the tag `prompt_cache`: one slab of
`prompt_cache_bytes` in that pool (runners/prompt_cache.py), least recently used out first,
emptied when a sleep discards it or a ResetPrefixCache asks, and every entry tied to the
weights it was computed with, so an update or a reload makes it a miss, never a stale hit.

Where memory lives: every component's tensors (transformer or UNet, VAE, text encoder) in
`weights`; the state of step-wise requests (latents and the scheduler's latent-shaped tensors,
e.g. DPM-Solver's past model outputs) in one fixed slab of tag `requests`, one slot per
request, allocated in `allocate("requests")`. Between two ops nothing of a request stays on
the device outside that slab; its host-side state (step counter, the CPU random generator,
its text embeddings) stays in Python.

Sleeping: the state machine offloads only `weights` at level 1 and discards every other tag,
so `buffers_to_save()` lists the slots of live requests: the backend copies them to the host
before the discard and back at wake, and a request interrupted by a level-1 sleep finishes
bit-identical. A level-2 sleep discards the weights, so the weights must be reloaded before
anything executes; `reload_weights` bumps a generation counter that no backend can restore,
and every request started under an older generation fails with an error saying why (it would
otherwise continue on other weights). Each slot also carries a random canary checked at every
op: state that came back as anything but what was written fails the request the same way
instead of producing a wrong image.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import io
import json
import logging
import re
import secrets
import shutil
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from omni_core.fsm.tags import ADAPTERS_TAG, KV_CACHE_TAG, WEIGHTS_TAG
from omni_core.protocol import AddAdapter
from omni_core.runners.base import DerivedCache, MemoryBudget, ModelRunner, OpenPool, RunnerArgumentError
from omni_core.runners.block_offload import OFFLOAD_MODES, OFFLOAD_TAG, BlockOffload, denoiser_blocks
from omni_core.runners.cfg_parallel import run_cfg_parallel, shard_dit, stage_world
from omni_core.runners.connector import ConnectorSpec
from omni_core.runners.diffusers_lora import DiffusersAdapters, adapter_problem
from omni_core.runners.diffusion_connector import (
    conditioning_specs,
    export_conditioning,
    imported_conditioning,
    passed_conditioning,
)
from omni_core.runners.diffusion_parallel import (
    SEQUENCE_MODES,
    SequenceParallelDiT,
    agreed_flags,
    attach_sequence_parallel,
    run_agreed,
)
from omni_core.runners.diffusion_steps import (
    DenoiserCall,
    DiffusionRequest,
    Parked,
    ddpm_call,
    dit_call,
    run_together,
    sd_call,
    state_tensors,
)
from omni_core.runners.diffusion_trajectory import MAX_TRAJECTORY_BYTES, Trajectory, log_prob_method
from omni_core.runners.prompt_cache import PROMPT_CACHE_TAG, PromptCache, slot_bytes_for
from omni_core.runners.step_cache import StepCacheState, StepCacheStats, cached_dit_forward, check_threshold
from omni_core.runners.step_cache_pool import STEP_CACHE_TAG, StepCachePool
from omni_core.runners.synthetic import tensor_bytes, torch_dtype
from omni_core.runners.tensor_parallel import join_process_group
from omni_core.runners.weights import (
    ReloadReport,
    WeightSet,
    check_resident,
    module_tensors,
    non_persistent_buffers,
    own_storage,
    torch_threads,
)

log = logging.getLogger("omni_core.runners.diffusers")

REQUESTS_TAG = "requests"
# What a save leaves out of the copy of the model's directory: it writes the weights itself.
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")
_PART = re.compile(r"(-\d{5}-of-\d{5})?\.safetensors$")  # a weights file's name less its part and suffix
PIPELINES = {"DiTPipeline": "dit", "DDPMPipeline": "ddpm", "StableDiffusionPipeline": "sd"}
MODULE_COMPONENTS = {"dit": ("transformer", "vae"), "ddpm": ("unet",), "sd": ("unet", "vae", "text_encoder")}
ALIGN_BYTES = 64  # every tensor in a slot starts here: views of any dtype stay aligned
HEADER_BYTES = ALIGN_BYTES  # canary, generation, steps done (int64 each)
MAX_LOST_REMEMBERED = 1024  # lost requests whose error is kept for their next op
MAX_STEPS_LIMIT = 10_000
OPS = ("start", "step", "finish", "cancel", "prompt_cache")
LOAD_FORMATS = ("auto", "dummy")
STEPPED_OPS = ("step", "finish")  # the ops a batch runs together
STEP_CACHE_PREFIX = "step_cache."  # parked attributes of the request's StepCacheState
REQUEST_KEYS = {
    "dit": frozenset({"class_label", "seed", "steps", "guidance_scale", "trajectory"}),
    "ddpm": frozenset({"seed", "steps", "trajectory"}),
    "sd": frozenset(
        {"prompt", "negative_prompt", "transfer", "conditioning", "seed", "steps", "guidance_scale", "trajectory"}
    ),
}
DEFAULT_GUIDANCE = {"dit": 4.0, "ddpm": 1.0, "sd": 7.5}  # each pipeline's own default
DEFAULT_PROMPT_CACHE_BYTES = 16 << 20  # SD 1.5 in fp16: 70 prompts of 236 KB
MAX_PROMPT_CACHE_BYTES = 1 << 40


class RequestLostError(RuntimeError):
    """A step-wise request whose state did not survive (level-2 sleep, weight update)."""


@runtime_checkable
class _Vae(Protocol):
    """What the runner calls of a pipeline's VAE (AutoencoderKL or another kind). Its result is
    a DecoderOutput or a tuple by `return_dict`, untyped in diffusers (its hook decorator)."""

    def decode(self, z: torch.Tensor, *args: Any, **kwargs: Any) -> Any: ...


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None


def _align(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


class DiffusersRunner(ModelRunner):
    execute_writes_weights = False  # inference: requests read the weights only
    supports_step_mode = True  # ops start, step, finish, cancel

    def __init__(
        self,
        device: torch.device,
        *,
        model: str,
        dtype: str = "float32",
        scheduler: str | None = None,
        max_requests: int = 8,
        max_steps: int = 1000,
        state_tensors: int = 6,
        prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES,
        step_cache_threshold: float | None = None,
        load_format: str = "auto",
        offload: str = "none",
        cpu_threads: int | None = None,
        parallel: str = "cfg",
        init_timeout_s: float = 120.0,
    ) -> None:
        super().__init__(device)
        torch_threads(torch.device(device), cpu_threads)
        self.model_dir = Path(model).expanduser()
        index_path = self.model_dir / "model_index.json"
        if not index_path.is_file():
            raise ValueError(
                f"model={model!r} is not a diffusers pipeline directory (no model_index.json); give a "
                "local directory, e.g. one written by `omni-core models make dit tiny DIR`"
            )
        pipeline_class = _read_json(index_path).get("_class_name")
        if pipeline_class not in PIPELINES:
            raise ValueError(f"{model!r} holds a {pipeline_class}; this runner executes {sorted(PIPELINES)}")
        self.kind = PIPELINES[pipeline_class]
        # Over several ranks: CFG-parallel or a tensor-parallel DiT (omni_core/runners/cfg_parallel.py).
        self.world, self.parallel = stage_world(self.kind, parallel), parallel
        self.dtype = torch_dtype(dtype)
        _check_options(load_format, offload, scheduler, max_requests, max_steps, state_tensors, prompt_cache_bytes)
        self.load_format = load_format
        self.dummy_weights = load_format == "dummy"  # the rank says Hello NEEDS_RELOAD until an update
        self.offload_mode = offload
        self.offload: BlockOffload | None = None
        self.scheduler_class = scheduler
        self.max_requests, self.max_steps, self.state_tensors = max_requests, max_steps, state_tensors
        self.prompt_cache = PromptCache(prompt_cache_bytes, self._prompt_slot_bytes()) if self.kind == "sd" else None
        self.sample_shape = self._sample_shape()
        self.step_cache_threshold = check_threshold(step_cache_threshold)
        _check_combinations(
            self.kind, self.world, parallel, self.step_cache_threshold, offload, f"{model!r} holds a {pipeline_class}"
        )
        self.step_cache_stats = StepCacheStats()
        self.step_cache_pool: StepCachePool | None = None  # with the tag 'step_cache' (step_cache_pool.py)
        self.denoiser_calls = 0  # forward passes of the transformer or UNet
        self.denoiser_rows = 0  # the rows they ran, over every request in them
        # Latents of both guidance halves, in float32 at most (schedulers may upcast), times
        # the tensors a scheduler keeps (DPM-Solver order 3: three past outputs), plus the step
        # cache's two token-shaped tensors where the stage has one.
        sample_bytes = 2 * int(torch.Size(self.sample_shape).numel()) * 4
        self.slot_bytes = HEADER_BYTES + state_tensors * _align(sample_bytes) + 2 * _align(self._step_cache_bytes())
        self.pipeline: Any = None
        self.modules: dict[str, torch.nn.Module] = {}
        self.weights: WeightSet | None = None
        self.slab: torch.Tensor | None = None
        self.generation = 0  # bumped by every reload: requests of an older one are void
        self.requests: dict[str, DiffusionRequest] = {}
        self.lost: OrderedDict[str, str] = OrderedDict()
        self._next_id = 0
        self.last_reload: ReloadReport | None = None
        self.loaded_names: frozenset[str] = frozenset()
        if self.world > 1:  # last: every argument checked before the other rank waits on this one
            join_process_group(self.device, init_timeout_s)

    def _prompt_slot_bytes(self) -> int:
        config = _read_json(self.model_dir / "text_encoder" / "config.json")
        return slot_bytes_for(int(config["max_position_embeddings"]), int(config["hidden_size"]), self.dtype)

    def _step_cache_bytes(self) -> int:
        """One step-cache tensor of a request: both guidance halves' tokens, float32 at most."""
        if self.step_cache_threshold is None:
            return 0
        config = _read_json(self.model_dir / "transformer" / "config.json")
        tokens = (int(config["sample_size"]) // int(config["patch_size"])) ** 2
        return 2 * tokens * int(config["num_attention_heads"]) * int(config["attention_head_dim"]) * 4

    def _sample_shape(self) -> tuple[int, ...]:
        denoiser = "transformer" if self.kind == "dit" else "unet"
        config = _read_json(self.model_dir / denoiser / "config.json")
        size = config.get("sample_size")
        if size is None:
            raise ValueError(f"{self.model_dir / denoiser / 'config.json'} has no sample_size: not a {denoiser} config")
        hw = (size, size) if isinstance(size, int) else tuple(size)
        return (int(config.get("in_channels", 4)), *map(int, hw))

    def _config(self, name: str) -> dict[str, Any]:
        """Component `name`'s diffusers config (ConfigMixin's: a dict whose keys are also attributes)."""
        from diffusers.configuration_utils import ConfigMixin

        module = self.modules[name]
        if not isinstance(module, ConfigMixin):
            raise TypeError(f"component {name!r} is a {type(module).__name__}, which has no diffusers config")
        return module.config

    def _denoiser_dtype(self) -> torch.dtype:
        from diffusers.models.modeling_utils import ModelMixin

        denoiser = self.modules["transformer" if self.kind == "dit" else "unet"]
        if not isinstance(denoiser, ModelMixin):
            raise TypeError(f"the denoiser is a {type(denoiser).__name__}, not a diffusers model")
        return denoiser.dtype

    def _vae(self) -> tuple[_Vae, float]:
        """The pipeline's VAE and its latents' scaling factor."""
        vae = self.modules["vae"]
        if not isinstance(vae, _Vae):
            raise TypeError(f"the pipeline's vae is a {type(vae).__name__}, which has no decode")
        return vae, self._config("vae")["scaling_factor"]

    # ------------------------------------------------------------------ allocation

    def load_weights(self) -> None:
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.disable_progress_bar()
        pipeline = self._dummy_pipeline() if self.load_format == "dummy" else self._read_pipeline()
        if self.scheduler_class is not None:
            import diffusers

            pipeline.scheduler = getattr(diffusers, self.scheduler_class).from_config(pipeline.scheduler.config)
        pipeline.set_progress_bar_config(disable=True)
        modules = {name: getattr(pipeline, name) for name in MODULE_COMPONENTS[self.kind]}
        if self.world > 1 and self.parallel == "tensor":
            shard_dit(modules["transformer"], self.world, self.device)
        elif self.world > 1 and self.parallel in SEQUENCE_MODES:
            attach_sequence_parallel(modules["transformer"], self.world, self.parallel)
        for module in modules.values():
            module.eval()
            module.requires_grad_(False)
        own_storage(modules.values())
        weights = WeightSet(modules)
        if self.load_format != "dummy":  # a dummy load binds the format at its first reload
            weights.bind_source(self.model_dir)
            self.loaded_names = frozenset(weights.named())
        if self.offload_mode == "layerwise":
            denoiser = modules["transformer" if self.kind == "dit" else "unet"]
            blocks, keep = denoiser_blocks(self.kind, denoiser, cached=self.step_cache_threshold is not None)
            self.offload = BlockOffload.attach(self.device, blocks, keep)
        self.pipeline, self.modules, self.weights = pipeline, modules, weights

    def load(self, open_pool: OpenPool, tags: Iterable[str], budget: MemoryBudget | None) -> None:
        tags = tuple(tags)
        if (OFFLOAD_TAG in tags) != (self.offload_mode != "none"):
            raise ValueError(
                f"offload={self.offload_mode!r} and the stage's tags {list(tags)} disagree: a layer-wise offload "
                f"streams through the '{OFFLOAD_TAG}' pool, so list that tag exactly when offload='layerwise'"
            )
        if STEP_CACHE_TAG in tags:
            self._own_step_cache_pool()
        # The slab is sized by the blocks, known once the weights are loaded.
        ordered = sorted(tags, key=lambda tag: (tag != WEIGHTS_TAG, tag == OFFLOAD_TAG))
        super().load(open_pool, ordered, budget)

    def _own_step_cache_pool(self) -> None:
        """The step cache in a pool of its own: out of the request slots, into its slots."""
        if self.step_cache_pool is not None:
            return
        if self.step_cache_threshold is None:
            raise ValueError(f"the tag {STEP_CACHE_TAG!r} holds a step cache: set step_cache_threshold or leave it out")
        cache_bytes = self._step_cache_bytes()
        self.step_cache_pool = StepCachePool(self.max_requests, cache_bytes)
        if self.slab is None:  # the request slots, not allocated yet, need no room for it
            self.slot_bytes -= 2 * _align(cache_bytes)

    def _read_pipeline(self) -> Any:
        from diffusers import DiffusionPipeline

        # device_map places each component on the device as it is read, where diffusers
        # supports it ("cuda", "cpu"); elsewhere the host copy is dropped after the move.
        direct = self.device.type in ("cuda", "cpu") and self.device.index in (None, 0)
        pipeline = DiffusionPipeline.from_pretrained(
            str(self.model_dir),
            local_files_only=True,
            dtype=self.dtype,
            device_map=self.device.type if direct else None,
        )
        if not direct:
            pipeline.to(self.device)
        return pipeline

    def _dummy_pipeline(self) -> Any:
        """The pipeline with random weights (vLLM's `load_format="dummy"`): every model built
        from its config alone, seeded so two loads agree; schedulers and tokenizers from their
        files, which hold no weights. For a trainer's first update, or a memory test."""
        import diffusers

        index = _read_json(self.model_dir / "model_index.json")
        pipeline_class = getattr(diffusers, index["_class_name"])
        accepted = inspect.signature(pipeline_class.__init__).parameters
        components: dict[str, Any] = {}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            for name, entry in index.items():
                if name in accepted and isinstance(entry, list) and len(entry) == 2:
                    components[name] = self._dummy_component(name, *entry)
        for name in ("id2label", "requires_safety_checker"):
            if name in accepted and name in index:
                components[name] = index[name]
        return pipeline_class(**components)

    def _dummy_component(self, name: str, library: Any, class_name: Any) -> Any:
        if library is None:
            return None
        import diffusers
        import transformers

        if library not in ("diffusers", "transformers") or not isinstance(class_name, str):
            raise ValueError(
                f"model_index.json names {name} as {[library, class_name]}; a dummy load builds "
                "diffusers and transformers components only"
            )
        cls = getattr(diffusers if library == "diffusers" else transformers, class_name)
        folder = self.model_dir / name
        if name not in MODULE_COMPONENTS[self.kind]:  # a scheduler or a tokenizer: no weights
            return cls.from_config(cls.load_config(folder)) if library == "diffusers" else cls.from_pretrained(folder)
        if library == "diffusers":
            module = cls.from_config(cls.load_config(folder))
        else:
            module = cls(cls.config_class.from_pretrained(folder))
        module = module.to(self.device)
        return module if module.dtype == self.dtype else module.to(self.dtype)

    def loaded_weights(self) -> frozenset[str]:
        """`component/name` of every weight read from the checkpoint; none after a dummy load."""
        return self.loaded_names

    def allocate_caches(self) -> None:
        # Diffusion keeps no KV cache; activations are transient.
        return None

    def allocate(self, tag: str) -> None:
        if tag == OFFLOAD_TAG:
            if self.offload is None:
                raise ValueError(f"offload is {self.offload_mode!r}: leave {tag!r} out of the stage's tags")
            self.offload.allocate()
        elif tag == REQUESTS_TAG:
            self.slab = torch.zeros(self.max_requests, self.slot_bytes, dtype=torch.uint8, device=self.device)
        elif tag == STEP_CACHE_TAG:
            self._own_step_cache_pool()
            assert self.step_cache_pool is not None
            self.step_cache_pool.allocate(self.device)
        elif tag == PROMPT_CACHE_TAG:
            if self.prompt_cache is None:
                raise ValueError(f"this {self.kind} pipeline has no text encoder: leave {tag!r} out of its tags")
            self.prompt_cache.allocate(self.device)
        else:
            super().allocate(tag)

    def tensors(self, tag: str) -> list[torch.Tensor]:
        adapters = self.lora.tensors() if self.lora is not None else []
        if tag == WEIGHTS_TAG:
            apart = self.offload.streamed_ids() if self.offload is not None else set()
            if self.adapter_tag != WEIGHTS_TAG:
                apart |= {id(t) for t in adapters}  # in a pool of their own (`adapters`)
            return [t for t in module_tensors(self.modules.values()) if id(t) not in apart]
        if tag == ADAPTERS_TAG:
            return adapters
        if tag == OFFLOAD_TAG:
            return self.offload.tensors() if self.offload is not None else []
        if tag == KV_CACHE_TAG:
            return []
        if tag == REQUESTS_TAG:
            return [self.slab] if self.slab is not None else []
        if tag == PROMPT_CACHE_TAG:
            return self.prompt_cache.tensors() if self.prompt_cache is not None else []
        if tag == STEP_CACHE_TAG:
            return self.step_cache_pool.tensors() if self.step_cache_pool is not None else []
        raise ValueError(
            f"DiffusersRunner has no tag {tag!r}; it has "
            f"{[WEIGHTS_TAG, KV_CACHE_TAG, REQUESTS_TAG, PROMPT_CACHE_TAG, OFFLOAD_TAG, STEP_CACHE_TAG, ADAPTERS_TAG]}"
        )

    def before_sleep(self, offload: frozenset[str], discard: frozenset[str]) -> None:
        if self.offload is not None:
            self.offload.release()  # no block points into the slab a sleep discards
        if PROMPT_CACHE_TAG in discard:
            self.reset_prefix_cache()  # its slab is released now

    def derived_caches(self) -> tuple[DerivedCache, ...]:
        # Every entry remembers the weights generation it was computed under (prompt_cache.py).
        return (DerivedCache("prompt_embeddings", keyed_by_version=True),) if self.prompt_cache is not None else ()

    def reset_prefix_cache(self) -> int:
        """Empties the prompt-embedding cache's index; its slab stays mapped in its pool."""
        return self.prompt_cache.discard() if self.prompt_cache is not None else 0

    def buffers_to_save(self) -> dict[str, torch.Tensor]:
        saved = non_persistent_buffers(self.modules)
        if self.slab is not None:
            for request in self.requests.values():
                if request.slot is not None:
                    saved[f"{REQUESTS_TAG}.{request.request_id}"] = self.slab[request.slot]
        return saved

    def reload_weights(self, source: str | None) -> None:
        if self.weights is None:
            raise RuntimeError("reload_weights before load_weights")
        if source is not None and not isinstance(source, str):
            raise RunnerArgumentError(f"the reload source must be a pipeline directory path, got {source!r}")
        directory = Path(source).expanduser() if source else self.model_dir
        if self.weights.own_directory is None:  # after a dummy load: this checkpoint's format binds
            try:
                self.weights.bind_source(directory)
            except Exception:
                self.weights.own_directory = None  # half bound: the next reload binds again
                raise
        self.last_reload = self.weights.load(directory)
        self._weights_changed()

    def save_weights(self, directory: Path, max_file_bytes: int) -> list[str]:
        """The pipeline as diffusers' save_pretrained lays it out: the model's directory (its
        model_index.json, every component's config, scheduler and tokenizer) without its weight
        files, then each component's weights under the file name it had there
        (`diffusion_pytorch_model` for the denoiser and the VAE, `model` for a text encoder): a
        pipeline this runner loads as its `model` and reloads from, bit for bit."""
        if self.weights is None:
            raise RuntimeError("save_weights before load_weights")
        shutil.copytree(self.model_dir, directory, dirs_exist_ok=True, ignore=shutil.ignore_patterns(*WEIGHT_FILES))
        stems = {}
        for folder in self.weights.folders:
            own = sorted((self.model_dir / folder).glob("*.safetensors"))
            stems[folder] = _PART.sub("", own[0].name) if own else "model"
        self.weights.save(directory, max_file_bytes, stems)
        return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())

    def weights_origin(self) -> str | None:
        return None if self.dummy_weights else str(self.model_dir)

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """`component/name` (e.g. `transformer/proj_out.weight`) -> shape and dtype."""
        if self.weights is None:
            raise RuntimeError("weight_specs before load_weights")
        return self.weights.specs()

    def update_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.weights is None:
            raise RuntimeError("update_weights before load_weights")
        self.weights.write(named)
        self._weights_changed()

    def weights_to_share(self) -> dict[str, torch.Tensor]:
        if self.weights is None:
            raise RuntimeError("weights_to_share before load_weights")
        return self.weights.named()

    def _weights_changed(self) -> None:
        """What was derived from the old weights goes: requests in flight are lost, and cached
        prompt embeddings no longer match (their entries carry the generation they were made in)."""
        self.generation += 1
        for request_id in list(self.requests):
            self._lose(
                request_id,
                "the weights were reloaded while it was in flight (a level-2 sleep discarded "
                "its state, or a weight update changed the model under it)",
            )

    def close(self) -> None:
        if self.offload is not None:
            self.offload.close()
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()
        self.pipeline, self.modules, self.weights, self.slab = None, {}, None, None
        self.requests.clear()
        if self.prompt_cache is not None:
            self.prompt_cache.close()
        if self.step_cache_pool is not None:
            self.step_cache_pool.close()

    # ------------------------------------------------------------------ LoRA adapters (P-20)

    lora: DiffusersAdapters | None = None  # from the first AddAdapter

    def _adapters(self) -> DiffusersAdapters:
        if self.pipeline is None:
            raise RuntimeError("an adapter before load_weights")
        problem = adapter_problem(self.kind, self.offload_mode, self.world, self.parallel)
        if problem is not None:
            raise RunnerArgumentError(problem)
        if self.lora is None or self.lora.pipeline is not self.pipeline:
            self.lora = DiffusersAdapters(self.pipeline, self.kind)
        return self.lora

    def check_adapter(self, command: AddAdapter) -> None:
        if command.tensors is not None:
            raise RunnerArgumentError("the diffusers runner takes adapters from a directory only")
        self._adapters().check(command)

    def add_adapter(self, command: AddAdapter) -> None:
        self._adapters().add(command)

    def remove_adapter(self, name: str) -> None:
        if self.lora is not None:
            self.lora.remove(name)

    # ------------------------------------------------------------------ ops

    def execute_adapter(self, payload: Any, adapter: str) -> dict[str, Any]:
        return self._execute_with(adapter, payload)

    def execute(self, payload: Any) -> dict[str, Any]:
        return self._execute_with(None, payload)

    def _execute_with(self, adapter: str | None, payload: Any) -> dict[str, Any]:
        """One op with adapter `adapter` alone, or every adapter off (None)."""
        if self.lora is None or not self.lora.loads:
            return self._execute(payload)
        with self.lora.using(adapter, payload):
            result = self._execute(payload)
        self.lora.record(adapter, result, self.requests)
        return result

    def _execute(self, payload: Any) -> dict[str, Any]:
        op = self._check_payload(payload)
        if op == "prompt_cache":
            return self._prompt_cache_op(payload)
        self._check_pools()
        if op is None:
            request = self._new_request(payload, allowed=REQUEST_KEYS[self.kind])
            with torch.no_grad():
                sample = self._initial_sample(request)
                return self._image(request, self._denoise(request, sample, request.steps_total))
        if op == "start":
            return self._start(payload)
        if op == "cancel":
            self._check_keys(payload, {"op", "request_id"})
            request_id = payload.get("request_id")
            self._claim(request_id, check_state=False)
            self._free(request_id)
            return {"request_id": request_id, "cancelled": True}
        request, count = self._claim_op(op, payload)
        try:
            with torch.no_grad():
                return self._conclude(op, request, self._denoise(request, self._unpark(request), count))
        except Exception as exc:
            self._lose_on_failure(op, request, exc)
            raise

    def execute_batch(self, payloads: Sequence[Any]) -> list[Any]:
        """Step-wise ops ("step", "finish") of distinct requests run together: one denoiser
        call per step over the rows of every request still stepping (vLLM-Omni's
        `execute_stepwise` over a scheduler batch); anything else runs one by one first."""
        if self.world > 1:
            # The ranks' batches may differ (each gathers what waits on its own socket): each
            # group is one every rank holds, so their collectives meet (diffusion_parallel.py).
            return run_agreed(payloads, self._execute_batch_here)
        return self._execute_batch_here(payloads)

    def _execute_batch_here(self, payloads: Sequence[Any]) -> list[Any]:
        ids: list[Any] = [p.get("request_id") if isinstance(p, dict) else None for p in payloads]
        seen = Counter(i for i in ids if isinstance(i, str))
        together = [
            i
            for i, payload in enumerate(payloads)
            if isinstance(payload, dict) and payload.get("op") in STEPPED_OPS and seen[ids[i]] == 1
        ]
        if len(together) < 2:
            together = []
        outputs: list[Any] = [None] * len(payloads)
        for i, payload in enumerate(payloads):
            if i not in together:
                try:
                    outputs[i] = self.execute(payload)
                except Exception as exc:
                    outputs[i] = exc
        if together:
            for i, output in zip(together, self._step_together([payloads[i] for i in together]), strict=True):
                outputs[i] = output
        return outputs

    def _step_together(self, payloads: list[dict[str, Any]]) -> list[Any]:
        """Each payload's result or its own error; the requests step in one batch."""
        self._check_payload(payloads[0])
        self._check_pools()
        outputs: list[Any] = [None] * len(payloads)
        work: list[tuple[int, str, DiffusionRequest, int]] = []
        for k, payload in enumerate(payloads):
            try:
                if self.lora is not None:  # together: every adapter off, as a plain op runs
                    self.lora.check_started(None, payload)
                work.append((k, payload["op"], *self._claim_op(payload["op"], payload)))
            except Exception as exc:
                outputs[k] = exc
        if self.world > 1:
            work = self._agreed_work(work, outputs)
        if not work:
            return outputs
        try:
            with torch.no_grad():
                samples = self._denoise_together([(r, self._unpark(r), count) for _, _, r, count in work])
        except Exception as exc:
            for k, op, request, _ in work:
                self._lose_on_failure(op, request, exc)
                outputs[k] = exc
            return outputs
        for (k, op, request, _), sample in zip(work, samples, strict=True):
            try:
                with torch.no_grad():
                    outputs[k] = self._conclude(op, request, sample)
            except Exception as exc:
                self._lose_on_failure(op, request, exc)
                outputs[k] = exc
        return outputs

    def _agreed_work(self, work: list[Any], outputs: list[Any]) -> list[Any]:
        """The claimed requests every rank claimed (each rank's denoiser calls must match);
        one another rank could not step is lost here too, so the ranks stay alike."""
        flags = agreed_flags([k in {w[0] for w in work} for k in range(len(outputs))])
        kept = []
        for entry in work:
            k, _, request, _ = entry
            if flags[k]:
                kept.append(entry)
                continue
            self._lose(request.request_id, "another rank of the stage could not step it (its error names why)")
            outputs[k] = RequestLostError(f"request {request.request_id} was aborted: {self.lost[request.request_id]}")
        return kept

    def _check_payload(self, payload: Any) -> Any:
        """The payload's op, once the payload is a dict, the op known and the weights loaded."""
        if not isinstance(payload, dict):
            raise TypeError(
                f"DiffusersRunner payload must be a dict like {{'class_label': 1, 'seed': 0, "
                f"'steps': 10}}, got {type(payload).__name__}"
            )
        op = payload.get("op")
        if op is not None and op not in OPS:
            raise ValueError(f"unknown op {op!r}; ops are {list(OPS)} (or none: one call, the whole image)")
        if self.pipeline is None:
            raise RuntimeError("DiffusersRunner.execute before load_weights")
        return op

    def _check_pools(self) -> None:
        # Every pool this runner has must be resident, as the worker requires for any Execute.
        tags = (WEIGHTS_TAG, REQUESTS_TAG, PROMPT_CACHE_TAG, OFFLOAD_TAG, STEP_CACHE_TAG)
        check_resident({tag: self.tensors(tag) for tag in tags})

    def _claim_op(self, op: str, payload: dict[str, Any]) -> tuple[DiffusionRequest, int]:
        """A "step" or "finish" op's live request, and how many steps it asks for."""
        self._check_keys(payload, {"op", "request_id"} | ({"steps"} if op == "step" else set()))
        request = self._claim(payload.get("request_id"))
        count = request.steps_total - request.steps_done
        if op == "step":
            count = payload.get("steps", 1)
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                raise ValueError(f"steps must be an int >= 1, got {count!r}")
        return request, count

    def _conclude(self, op: str, request: DiffusionRequest, sample: torch.Tensor) -> dict[str, Any]:
        """After a step-wise op's steps: its progress (the state parked again), or its image."""
        if op == "step":
            self._park(request, sample)
            return self._progress(request)
        self._free(request.request_id)
        return self._image(request, sample)

    def _lose_on_failure(self, op: str, request: DiffusionRequest, exc: Exception) -> None:
        # Half a step leaves the scheduler ahead of what the slot holds: continuing would
        # produce a wrong image, so the request ends here.
        if request.request_id in self.requests:
            self._lose(request.request_id, f"its {op} op failed ({type(exc).__name__}: {exc})")

    def _check_keys(self, payload: dict[str, Any], allowed: frozenset[str] | set[str]) -> None:
        unknown = sorted(set(payload) - set(allowed))
        if unknown:
            raise ValueError(f"unknown payload key(s) {unknown} for op {payload.get('op')!r}; known: {sorted(allowed)}")

    def _start(self, payload: dict[str, Any]) -> dict[str, Any]:
        if self.slab is None:
            raise ValueError(
                "step-wise requests keep their state in the 'requests' pool, which this stage does not "
                "have; add 'requests' to StageSpec.tags, or send the request without 'op'"
            )
        request = self._new_request(payload, allowed=REQUEST_KEYS[self.kind] | {"op"})
        used = {r.slot for r in self.requests.values()}
        free = [slot for slot in range(self.max_requests) if slot not in used]
        if not free:
            raise RuntimeError(
                f"all {self.max_requests} request slots are in use; finish or cancel a request (or raise max_requests)"
            )
        self._next_id += 1
        request.request_id = f"r{self._next_id}"
        request.slot, request.canary, request.generation = free[0], secrets.randbits(62) + 1, self.generation
        with torch.no_grad():
            self._park(request, self._initial_sample(request))
        self.requests[request.request_id] = request
        return self._progress(request)

    def _progress(self, request: DiffusionRequest) -> dict[str, Any]:
        return {"request_id": request.request_id, "steps_done": request.steps_done, "steps_total": request.steps_total}

    def _new_request(self, payload: dict[str, Any], allowed: frozenset[str]) -> DiffusionRequest:
        self._check_keys(payload, allowed)
        seed = payload.get("seed", 0)
        steps = payload.get("steps", 50)
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
            raise ValueError(f"seed must be an int in [0, 2**63), got {seed!r}")
        if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= self.max_steps:
            raise ValueError(f"steps must be an int in 1..{self.max_steps} (max_steps), got {steps!r}")
        guidance = payload.get("guidance_scale", DEFAULT_GUIDANCE[self.kind])
        if not isinstance(guidance, (int, float)) or isinstance(guidance, bool) or not 0 <= guidance <= 100:
            raise ValueError(f"guidance_scale must be a number in [0, 100], got {guidance!r}")
        label = self._class_label(payload.get("class_label")) if self.kind == "dit" else None
        # Timesteps on the host, as DiTPipeline and DDPMPipeline set them: the same values
        # (StableDiffusionPipeline puts them on the device) without a device tensor per request.
        scheduler = type(self.pipeline.scheduler).from_config(self.pipeline.scheduler.config)
        scheduler.set_timesteps(steps)
        generator = torch.Generator(device="cpu").manual_seed(seed)
        request = DiffusionRequest("", label, seed, steps, float(guidance), scheduler, generator)
        if self.kind == "sd":
            request.prompt = payload.get("prompt")
            if "transfer" in payload:  # P-22: conditioning another stage computed
                request.embeddings = imported_conditioning(self, payload, guidance > 1)
            elif "conditioning" in payload:  # the same, carried by the caller
                request.embeddings = passed_conditioning(self, payload, guidance > 1)
            else:
                request.embeddings = self._prompt_embeddings(
                    request.prompt, payload.get("negative_prompt"), guidance > 1
                )
        request.trajectory = self._trajectory(payload.get("trajectory", False), request)
        return request

    def _trajectory(self, wanted: Any, request: DiffusionRequest) -> Trajectory | None:
        """The RL record a request asked for ("trajectory": true), if it fits its bound."""
        if not isinstance(wanted, bool):
            raise ValueError(f"trajectory must be true or false, got {wanted!r}")
        if not wanted:
            return None
        embeds = request.embeddings
        embeds_bytes = embeds.numel() * embeds.element_size() if embeds is not None else 0
        needed = Trajectory.bytes_needed(request.steps_total, self.sample_shape, self._denoiser_dtype(), embeds_bytes)
        if needed > MAX_TRAJECTORY_BYTES:
            raise ValueError(
                f"a trajectory of {request.steps_total} steps needs {needed} bytes on the host, over its bound of "
                f"{MAX_TRAJECTORY_BYTES}; ask for fewer steps, or no trajectory"
            )
        guided = self.kind == "dit" and request.guidance_scale > 1
        return Trajectory(guided=guided, method=log_prob_method(request.scheduler), prompt_embeds=embeds)

    def transfer_exports(self) -> dict[str, ConnectorSpec]:
        return conditioning_specs(self)

    def transfer_imports(self) -> dict[str, ConnectorSpec]:
        return conditioning_specs(self)

    def export_tensors(self, payload: Any, names: Sequence[str]) -> dict[str, torch.Tensor]:
        return export_conditioning(self, payload, names)

    def _prompt_embeddings(self, prompt: Any, negative: Any, guided: bool) -> torch.Tensor:
        """StableDiffusionPipeline.encode_prompt's result, on the host; cached in the
        `prompt_cache` pool when the stage has one, under the weights that computed it."""
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"this pipeline is text-conditioned: give 'prompt' as a non-empty string, got {prompt!r}")
        if negative is not None and not isinstance(negative, str):
            raise ValueError(f"negative_prompt must be a string, got {negative!r}")
        assert self.prompt_cache is not None
        key = (prompt, negative, guided)
        cached = self.prompt_cache.get(key, self.generation)
        if cached is not None:
            return cached
        with torch.no_grad():
            positive, negative_embeds = self.pipeline.encode_prompt(prompt, self.device, 1, guided, negative)
            embeddings = torch.cat([negative_embeds, positive]) if guided else positive
        self.prompt_cache.put(key, self.generation, embeddings)
        return embeddings.to("cpu")

    def counters(self) -> dict[str, int]:
        # Rows over calls is the batch a step ran at: 2 per guided request, 1 otherwise.
        counters = {"denoiser_calls": self.denoiser_calls, "denoiser_rows": self.denoiser_rows}
        if self.prompt_cache is not None:
            counters.update(self.prompt_cache.counters())
        if self.step_cache_threshold is not None:
            counters.update(self.step_cache_stats.counters())
            counters["step_cache_dropped"] = self.step_cache_pool.dropped if self.step_cache_pool is not None else 0
        return counters

    def _prompt_cache_op(self, payload: dict[str, Any]) -> dict[str, Any]:
        """{"op": "prompt_cache"} -> its figures; with "clear": true, emptied first."""
        self._check_keys(payload, {"op", "clear"})
        if self.prompt_cache is None:
            raise ValueError(f"this {self.kind} pipeline has no text encoder, so no prompt cache")
        clear = payload.get("clear", False)
        if not isinstance(clear, bool):
            raise TypeError(f"clear must be a bool, got {clear!r}")
        if clear:
            self.reset_prefix_cache()
        return {**self.prompt_cache.stats(self.generation), "weights_generation": self.generation}

    def _class_label(self, label: Any) -> int:
        classes = int(self._config("transformer")["num_embeds_ada_norm"])
        if isinstance(label, str):
            ids = self.pipeline.labels
            if label not in ids:
                raise ValueError(f"class_label {label!r} is not a label of this pipeline (e.g. {list(ids)[:3]})")
            return int(ids[label])
        if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < classes:
            raise ValueError(f"class_label must be an int in 0..{classes - 1} or a label name, got {label!r}")
        return label

    # ------------------------------------------------------------------ the pipelines' loops

    def _initial_sample(self, request: DiffusionRequest) -> torch.Tensor:
        from diffusers.utils.torch_utils import randn_tensor

        dtype = request.embeddings.dtype if request.embeddings is not None else self._denoiser_dtype()
        latents = randn_tensor((1, *self.sample_shape), generator=request.generator, device=self.device, dtype=dtype)
        if self.kind == "sd":
            latents = latents * request.scheduler.init_noise_sigma
        elif self.kind == "dit" and request.guidance_scale > 1:
            latents = torch.cat([latents] * 2)
        if request.trajectory is not None:
            request.trajectory.start(latents)
        return latents

    def _denoise(self, request: DiffusionRequest, sample: torch.Tensor, count: int) -> torch.Tensor:
        return self._denoise_together([(request, sample, count)])[0]

    def _denoise_together(self, work: list[tuple[DiffusionRequest, torch.Tensor, int]]) -> list[torch.Tensor]:
        """Each request `count` steps further (fewer where it ends first): per step, one
        denoiser call over the rows of every request still stepping; a request with a step
        cache makes its own call (the cache decides per request whether the blocks run)."""
        denoiser: Any = self.modules["transformer" if self.kind == "dit" else "unet"]
        if self.world > 1 and self.parallel in SEQUENCE_MODES:
            denoiser = SequenceParallelDiT(denoiser)  # its blocks over this rank's tokens
        ends = [min(request.steps_total, request.steps_done + count) for request, _, count in work]
        contexts = [self._step_context(request) for request, _, _ in work]
        samples = [sample for _, sample, _ in work]
        while live := [i for i, (request, _, _) in enumerate(work) if request.steps_done < ends[i]]:
            calls = {i: self._call(work[i][0], samples[i], contexts[i]) for i in live}
            outputs: dict[int, torch.Tensor] = {}
            plain = []
            for i in live:
                request = work[i][0]
                forward = self._cached_forward(request, request.steps_done)
                if forward is None:
                    plain.append(i)
                else:
                    outputs[i] = forward(calls[i].inputs, calls[i].timesteps, calls[i].condition)
            if plain:
                run = run_cfg_parallel if self.world > 1 and self.parallel == "cfg" else run_together
                outputs.update(zip(plain, run(self.kind, denoiser, [calls[i] for i in plain]), strict=True))
            self.denoiser_calls += len(live) - len(plain) + (1 if plain else 0)
            halves = self.world > 1 and self.parallel == "cfg"
            split = {i for i in plain if calls[i].guided and halves}  # this rank ran half of each
            self.denoiser_rows += sum(len(calls[i].inputs) // (self.world if i in split else 1) for i in live)
            for i in live:
                samples[i] = calls[i].finish(outputs[i])
                work[i][0].steps_done += 1
        return samples

    def _step_context(self, request: DiffusionRequest) -> tuple[Any, dict[str, Any], Any]:
        """What every step of a request takes: its conditioning on the device (DiT's class
        labels, SD's text embeddings), the scheduler's extra arguments, its trajectory's hook."""
        condition, step_kwargs = None, {}
        if self.kind == "dit":
            condition = torch.tensor([request.class_label], device=self.device)
            if request.guidance_scale > 1:
                null = int(self._config("transformer")["num_embeds_ada_norm"])
                condition = torch.cat([condition, torch.tensor([null], device=self.device)], 0)
        elif self.kind == "sd":
            if request.embeddings is None:
                raise ValueError("a stable-diffusion request carries its prompt's embeddings; this one has none")
            condition = request.embeddings.to(self.device)
            accepted = set(inspect.signature(request.scheduler.step).parameters)
            step_kwargs = {k: v for k, v in (("eta", 0.0), ("generator", request.generator)) if k in accepted}
        trajectory = request.trajectory
        observe = None if trajectory is None else functools.partial(trajectory.step, request.scheduler)
        return condition, step_kwargs, observe

    def _call(self, request: DiffusionRequest, sample: torch.Tensor, context: tuple[Any, Any, Any]) -> DenoiserCall:
        condition, step_kwargs, observe = context
        t = request.scheduler.timesteps[request.steps_done]
        if self.kind == "dit":
            return dit_call(self.modules["transformer"], request, sample, t, condition, observe)
        if self.kind == "sd":
            return sd_call(self.modules["unet"], request, sample, t, condition, step_kwargs, observe)
        return ddpm_call(self.modules["unet"], request, sample, t, observe)

    def _cached_forward(self, request: DiffusionRequest, index: int) -> Any:
        """The transformer's forward through the request's step cache, or None without one."""
        threshold = self.step_cache_threshold
        if threshold is None:
            return None
        if request.step_cache is None:
            request.step_cache = StepCacheState()
        state, transformer, stats = request.step_cache, self.modules["transformer"], self.step_cache_stats
        must_compute = index in (0, request.steps_total - 1)

        def forward(sample: torch.Tensor, timesteps: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return cached_dit_forward(
                transformer, sample, timesteps, labels, state, threshold, stats, must_compute=must_compute
            )

        return forward

    def _image(self, request: DiffusionRequest, sample: torch.Tensor) -> dict[str, Any]:
        if self.kind == "dit":
            vae, scaling = self._vae()
            latents = sample.chunk(2, dim=0)[0] if request.guidance_scale > 1 else sample
            sample = vae.decode(1 / scaling * latents).sample
        elif self.kind == "sd":  # the pipelines scale in different ways; each result is its own
            vae, scaling = self._vae()
            sample = vae.decode(sample / scaling, return_dict=False, generator=request.generator)[0]
        images = (sample / 2 + 0.5).clamp(0, 1)
        pixels = images.cpu().permute(0, 2, 3, 1).float().numpy()
        png = io.BytesIO()
        self.pipeline.numpy_to_pil(pixels)[0].save(png, format="PNG")
        return {
            "png": png.getvalue(),
            "sha256": hashlib.sha256(tensor_bytes(images)).hexdigest(),
            "shape": list(images.shape),
            "dtype": str(images.dtype).removeprefix("torch."),
            "steps": request.steps_total,
            "seed": request.seed,
            "class_label": request.class_label,
            "prompt": request.prompt,
            **({"trajectory": request.trajectory.to_wire()} if request.trajectory is not None else {}),
        }

    # ------------------------------------------------------------------ request state in the slab

    def _slot_view(self, slot: int, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        assert self.slab is not None
        nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
        return self.slab[slot, offset : offset + nbytes].view(dtype).view(shape)

    def _header(self, slot: int) -> torch.Tensor:
        return self._slot_view(slot, 0, (3,), torch.int64)

    def _park(self, request: DiffusionRequest, sample: torch.Tensor) -> None:
        assert request.slot is not None
        own_pool = self.step_cache_pool
        state = state_tensors(request, sample) + ([] if own_pool is not None else _step_cache_tensors(request))
        needed = HEADER_BYTES + sum(_align(t.numel() * t.element_size()) for _, _, t in state)
        if needed > self.slot_bytes:
            self._lose(request.request_id, f"its state needs {needed} bytes, a slot holds {self.slot_bytes}")
            raise RuntimeError(
                f"request {request.request_id}: the scheduler keeps {len(state)} latent-shaped "
                f"tensors ({needed} bytes), more than a request slot holds ({self.slot_bytes}); "
                "raise the runner's state_tensors"
            )
        offset, parked = HEADER_BYTES, []
        for attribute, index, tensor in state:
            self._slot_view(request.slot, offset, tuple(tensor.shape), tensor.dtype).copy_(tensor)
            parked.append(Parked(attribute, index, offset, tuple(tensor.shape), tensor.dtype))
            offset += _align(tensor.numel() * tensor.element_size())
            # Drop the reference: until the next op this state exists only in the slab.
            if attribute.startswith(STEP_CACHE_PREFIX):
                setattr(request.step_cache, attribute.removeprefix(STEP_CACHE_PREFIX), None)
            elif attribute != "sample":
                if index is None:
                    setattr(request.scheduler, attribute, None)
                else:
                    getattr(request.scheduler, attribute)[index] = None
        self._header(request.slot).copy_(torch.tensor([request.canary, request.generation, request.steps_done]))
        request.parked = parked
        if own_pool is not None and request.step_cache is not None:
            own_pool.park(request.slot, request.canary, self.generation, request.step_cache)

    def _unpark(self, request: DiffusionRequest) -> torch.Tensor:
        assert request.slot is not None
        sample = None
        for p in request.parked:
            value = self._slot_view(request.slot, p.offset, p.shape, p.dtype).clone()
            if p.attribute == "sample":
                sample = value
            elif p.attribute.startswith(STEP_CACHE_PREFIX):
                setattr(request.step_cache, p.attribute.removeprefix(STEP_CACHE_PREFIX), value)
            elif p.index is None:
                setattr(request.scheduler, p.attribute, value)
            else:
                getattr(request.scheduler, p.attribute)[p.index] = value
        assert sample is not None
        if self.step_cache_pool is not None and request.step_cache is not None:
            self.step_cache_pool.unpark(request.slot, request.canary, self.generation, request.step_cache)
        return sample

    def _claim(self, request_id: Any, check_state: bool = True) -> DiffusionRequest:
        """The live request of this id, its state verified; a lost one raises why."""
        if request_id in self.lost:
            raise RequestLostError(f"request {request_id} was aborted: {self.lost[request_id]}; start it again")
        request = self.requests.get(request_id) if isinstance(request_id, str) else None
        if request is None:
            raise ValueError(f"unknown request_id {request_id!r}; live requests: {sorted(self.requests)}")
        if not check_state:
            return request
        assert self.slab is not None and request.slot is not None
        header = self._header(request.slot).tolist()
        expected = [request.canary, request.generation, request.steps_done]
        if request.generation != self.generation or header != expected:
            self._lose(
                request_id, "its state in the 'requests' pool did not survive (discarded by a sleep and not restored)"
            )
            raise RequestLostError(f"request {request_id} was aborted: {self.lost[request_id]}; start it again")
        return request

    def _free(self, request_id: str) -> None:
        request = self.requests.pop(request_id)
        if self._slab_resident() and request.slot is not None:
            self._header(request.slot).zero_()  # a later request in this slot cannot match it
        if self.step_cache_pool is not None and request.slot is not None:
            self.step_cache_pool.clear(request.slot)
        request.slot = None

    def _slab_resident(self) -> bool:
        # A reload can run while 'requests' is still asleep (a wake of 'weights' alone): its
        # storage is then released and must not be written.
        return self.slab is not None and self.slab.untyped_storage().nbytes() >= self.slab.numel()

    def _lose(self, request_id: str, reason: str) -> None:
        if request_id in self.requests:
            self._free(request_id)
        self.lost[request_id] = reason
        while len(self.lost) > MAX_LOST_REMEMBERED:
            self.lost.popitem(last=False)
        log.warning("step-wise request %s aborted: %s", request_id, reason)


def _step_cache_tensors(request: DiffusionRequest) -> list[tuple[str, int | None, torch.Tensor]]:
    """The request's step-cache tensors, parked in its slot beside its latents."""
    state = request.step_cache
    if state is None:
        return []
    named = (("previous", state.previous), ("residual", state.residual))
    return [(STEP_CACHE_PREFIX + name, None, tensor) for name, tensor in named if tensor is not None]


def _check_options(
    load_format: str,
    offload: str,
    scheduler: str | None,
    max_requests: int,
    max_steps: int,
    state_tensors: int,
    prompt_cache_bytes: int,
) -> None:
    """The runner's arguments one by one, before anything loads."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format must be one of {list(LOAD_FORMATS)} ('dummy': random weights from the components' "
            f"configs, no weight file read), got {load_format!r}"
        )
    if offload not in OFFLOAD_MODES:
        raise ValueError(
            f"offload must be one of {list(OFFLOAD_MODES)} ('layerwise': the denoiser's blocks on the host, "
            f"streamed through one device slab in the '{OFFLOAD_TAG}' pool), got {offload!r}"
        )
    if scheduler is not None:
        import diffusers

        if not isinstance(getattr(diffusers, scheduler, None), type) or not scheduler.endswith("Scheduler"):
            raise ValueError(
                f"scheduler={scheduler!r} is not a diffusers scheduler class "
                "(e.g. DDIMScheduler, DPMSolverMultistepScheduler)"
            )
    limits = (
        ("max_requests", max_requests, 1, 4096),
        ("max_steps", max_steps, 1, MAX_STEPS_LIMIT),
        ("state_tensors", state_tensors, 2, 64),
        ("prompt_cache_bytes", prompt_cache_bytes, 0, MAX_PROMPT_CACHE_BYTES),
    )
    for name, value, low, high in limits:
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise ValueError(f"{name} must be an int in {low}..{high}, got {value!r}")


def _check_combinations(
    kind: str, world: int, parallel: str, step_cache_threshold: float | None, offload: str, holds: str
) -> None:
    """The arguments that do not combine."""
    if step_cache_threshold is not None and kind != "dit":
        raise ValueError(f"step_cache_threshold applies to DiT pipelines; {holds}")
    if world > 1 and offload != "none":
        raise ValueError("offload='layerwise' runs on a stage of one rank; use ranks=1 or offload='none'")
    if world > 1 and step_cache_threshold is not None and parallel in SEQUENCE_MODES:
        raise ValueError(
            f"step_cache_threshold and parallel={parallel!r} do not combine (the cache runs the blocks over every "
            "token); use parallel='cfg' or no step cache"
        )
