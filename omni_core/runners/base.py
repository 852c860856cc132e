"""How a user's model plugs into a worker.

A runner owns the model's tensors; the worker owns the memory they live in. The worker
calls `allocate(tag)` once per tag inside the backend's pool of that tag (so `weights`
land in the weights pool and caches in `kv_cache`), then `tensors(tag)` so a backend that
moves tensors (portable) knows what to move. After that the runner keeps references to
its tensors for life: backends restore memory *into the same tensor objects*, so a runner
must never cache a copy or a `.data_ptr()` it did not get from its own tensors.

Runners are chosen by name (omni_core.plugins: omni-core's own, e.g. "synthetic", or one an
installed package registers under the entry-point group `omni_core.runners`) or by import
path, `package.module:Class`, so users bring their own.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omni_core.fsm.tags import ADAPTERS_TAG, KV_CACHE_TAG, WEIGHTS_TAG
from omni_core.plugins import RUNNERS, resolve
from omni_core.protocol.messages import MAX_DERIVED_CACHES, AddAdapter
from omni_core.runners.connector import ConnectorSpec, TransferInbox

_CACHE_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")

# `open_pool(tag)`: the context in which allocations belong to `tag` (the backend's pool).
OpenPool = Callable[[str], AbstractContextManager[None]]


@dataclass(frozen=True)
class MemoryBudget:
    """The stage's share of the device, for runners that size their caches to it."""

    fraction: float  # StageSpec.gpu_memory_fraction
    # What this process may still allocate now: its fraction of the device minus what this
    # process holds (NVML per PID), other processes on the GPU not counted, less headroom.
    available_bytes: Callable[[], int]


@dataclass(frozen=True)
class DerivedCache:
    """A cache whose entries are computed from the weights (vLLM's prefix KV blocks, a prompt
    cache of hidden states or embeddings). `keyed_by_version`: each entry remembers the weights
    it was computed under and a lookup under other weights misses, so the cache may outlive an
    update (SGLang's `flush_cache: false`); a cache keyed by its prompt alone must go."""

    name: str  # [a-z][a-z0-9_]*, as a counter's: it is named in the Ack's `caches_dropped`
    keyed_by_version: bool

    def __post_init__(self) -> None:
        # Checked here, not at the Ack: a name the wire's schema refuses would lose the Ack.
        if not (isinstance(self.name, str) and _CACHE_NAME.fullmatch(self.name)):
            raise ValueError(
                f"a derived cache's name must match [a-z][a-z0-9_]* (at most 64 characters), got {self.name!r:.80}"
            )


class RunnerArgumentError(ValueError):
    """The runner cannot honour a command because of its arguments (an unusable reload
    source, a checkpoint of another architecture). Raise it *before* touching any tensor:
    the worker answers NACK INVALID_ARGUMENT with the message and stays in its previous
    state. Any other exception from `reload_weights` means the weights may be half written
    and moves the rank to FAILED."""


class ModelRunner(ABC):
    """A model as a worker sees it. Subclass and name it by import path in WorkerConfig.runner.

    `__init__(device, **runner_args)` must not allocate device memory: allocation happens in
    `allocate`, inside the right pool.
    """

    def __init__(self, device: torch.device, **runner_args: Any) -> None:
        self.device = device

    @abstractmethod
    def load_weights(self) -> None:
        """Create and fill the weight tensors (runs inside the `weights` pool)."""

    @abstractmethod
    def allocate_caches(self) -> None:
        """Create the KV cache / scratch tensors (runs inside the `kv_cache` pool)."""

    @abstractmethod
    def tensors(self, tag: str) -> list[torch.Tensor]:
        """Every tensor holding memory of `tag`; the portable backend releases exactly these."""

    @abstractmethod
    def execute(self, payload: Any) -> Any:
        """Run one request; the result must be msgpack-serialisable. Runs only when ACTIVE."""

    def execute_batch(self, payloads: Sequence[Any]) -> list[Any]:
        """Run several requests together (those in flight on this rank at once, up to the
        stage's max_in_flight); return one entry per payload, in order: its result, or the
        exception that is that request's own error (the others still succeed). A raise fails
        every request of the batch. The default runs them one by one through `execute`; a
        runner whose framework batches (vLLM's engine, a padded forward pass) overrides it."""
        outputs: list[Any] = []
        for payload in payloads:
            try:
                outputs.append(self.execute(payload))
            except Exception as exc:
                outputs.append(exc)
        return outputs

    # Continuous batching: requests join and leave the running set between the framework's
    # steps (vLLM's add_request/step), so a request arriving while others decode starts at
    # the next step instead of waiting for the whole batch. A runner that cannot leaves
    # these as they are, and the worker runs its gathered batches through execute_batch.
    def supports_continuous(self) -> bool:
        return False

    def start_request(self, key: str, payload: Any) -> None:
        """Add one request to the running set under `key` (unique among those running);
        raises, adding nothing, when the payload is bad (that request's own error)."""
        raise NotImplementedError(f"{type(self).__name__} has no continuous batching")

    def running_requests(self) -> int:
        """How many requests started with `start_request` have not finished."""
        return 0

    def step_requests(self) -> list[tuple[str, Any]]:
        """One step of every running request; returns those that finished, each `(key,
        result)`. A raise fails every running request (the runner forgets them all)."""
        raise NotImplementedError(f"{type(self).__name__} has no continuous batching")

    # Pause mode keep (HoldRequests): the running requests frozen where they are while the
    # weights change under them. A continuous runner that can stop between its steps and go
    # on from there (vLLM's engine: no step is taken) overrides these three; one that cannot
    # has its running requests finished before the hold is answered (as mode wait).
    def supports_hold(self) -> bool:
        return False

    def hold_requests(self, clear_cache: bool) -> Mapping[str, int]:
        """Every running request, by key: the output tokens it has generated so far (the
        longest of its rows), where a span of new weights starts once it goes on. Nothing
        is stepped until the rank steps again. With `clear_cache`, drop their KV instead:
        each restarts generation from its prompt at its next step (the count is what it
        discarded)."""
        raise NotImplementedError(f"{type(self).__name__} cannot hold its running requests")

    def abort_requests(self, keys: Iterable[str]) -> None:
        """Forget these running requests (their answers are no one's now: their weights were
        lost under them). A runner that cannot lets them finish unanswered."""
        return None

    @abstractmethod
    def reload_weights(self, source: str | None) -> None:
        """Refill the weights in place (after a level-2 sleep, or to swap weights).

        `source` is runner-specific; None means the runner's own. Write into the existing
        tensors (this runs outside any pool): other code (CUDA graphs, the backend) holds
        their addresses. A source the runner cannot use raises `RunnerArgumentError` before
        any tensor is written.
        """

    def weight_specs(self) -> Mapping[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name -> (full shape, dtype) of every weight an update may write (P-17): the names a
        trainer's state_dict uses, the unsharded shapes (a tensor-parallel rank takes its
        shard in `update_weights`). An update naming anything else is refused before writing."""
        raise NotImplementedError(
            f"{type(self).__name__} takes no weight updates; override weight_specs and update_weights"
        )

    def update_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Write each full tensor into the weight of that name, in place (the addresses stay:
        CUDA graphs and the backend hold them). Names, shapes and dtypes were checked against
        `weight_specs` before the first call; the tensors may live in another process's
        shared memory and are valid only during this call, so copy, never keep them."""
        raise NotImplementedError(f"{type(self).__name__} takes no weight updates")

    def weights_to_share(self) -> Mapping[str, torch.Tensor]:
        """Name -> the full tensor of every weight, for another stage on the node (a trainer
        stage's side of `Engine.transfer_weights`); the names are `weight_specs`' names. Read
        only, during the ShareWeights; a runner that cannot raises RunnerArgumentError."""
        raise RunnerArgumentError(f"{type(self).__name__} cannot share its weights; implement weights_to_share")

    # ------------------------------------------------------------------ the connector (P-22)

    def transfer_exports(self) -> Mapping[str, ConnectorSpec]:
        """Name -> dtype and shape of every tensor this runner computes for another stage
        (a text model's hidden states, prompt embeddings); none by default."""
        return {}

    def export_tensors(self, payload: Any, names: Sequence[str]) -> Mapping[str, torch.Tensor]:
        """The tensors `names` (each of `transfer_exports`) this runner computes for `payload`.
        A payload it cannot use raises RunnerArgumentError; nothing is held then."""
        raise RunnerArgumentError(f"{type(self).__name__} exports nothing to other stages; implement export_tensors")

    def transfer_imports(self) -> Mapping[str, ConnectorSpec]:
        """Name -> dtype and shape of every tensor this runner takes from another stage (a
        diffusion decoder's prompt embeddings); none by default."""
        return {}

    @property
    def inbox(self) -> TransferInbox:
        """What landed for each request (TransferIn), until `take_imported` or a release."""
        inbox = self.__dict__.get("_transfer_inbox")
        if inbox is None:
            inbox = self.__dict__["_transfer_inbox"] = TransferInbox()
        return inbox

    def take_imported(self, request_id: Any) -> dict[str, torch.Tensor]:
        """The tensors that landed for `request_id` (a payload's "transfer"), taken once."""
        if not isinstance(request_id, str):
            raise ValueError(f"'transfer' names a request id (a string), got {request_id!r}")
        return self.inbox.take(request_id)

    # Whether `execute` takes step-wise requests (ops "start", "step", "finish", "cancel":
    # vLLM-Omni's `supports_step_mode`); the rank's Hello declares Capability.STEP_MODE.
    supports_step_mode: bool = False

    def loaded_weights(self) -> frozenset[str]:
        """The names of the weights `load_weights` read from the checkpoint (vLLM's
        `load_weights` set; `weight_specs`' names); empty: none read (random weights of a
        dummy load) or not reported. The rank's Hello carries them."""
        return frozenset()

    def save_weights(self, directory: Path, max_file_bytes: int) -> list[str]:
        """Write the weights held now into `directory` (it exists and is empty; SaveWeights) so
        that `reload_weights(str(directory))` reads them back bit for bit; files of at most
        `max_file_bytes` each (`weights.write_safetensors`). Return the names of the files
        written. Runs outside any pool and must not change a weight; the worker writes the
        index (version, origin) and renames the directory into place. A runner that does not
        override this does not declare the capability `save_weights`: SaveWeights is refused
        UNSUPPORTED."""
        raise RunnerArgumentError(f"{type(self).__name__} cannot save its weights; implement save_weights")

    @property
    def supports_save_weights(self) -> bool:
        return type(self).save_weights is not ModelRunner.save_weights

    def weights_origin(self) -> str | None:
        """The checkpoint the weights were loaded from (a saved directory's index names it), or
        None where the runner has none (random weights, a seed)."""
        return None

    @property
    def supports_weight_update(self) -> bool:
        return type(self).update_weights is not ModelRunner.update_weights

    # Whether every write of `reload_weights` and `update_weights` goes in place through the
    # tensors of `host_refit_tensors`, and nothing else touches the device meanwhile: then an
    # update may be written into the backend's host copy while the weights sleep at level 1
    # (the rank's Hello declares Capability.HOST_REFIT where its backend reaches that copy).
    supports_host_refit: bool = False

    def host_refit_tensors(self) -> list[torch.Tensor]:
        """The tensors a weights write goes through: each points at its host copy while the
        update is written into it (the same Python objects, their `.data` swapped back after)."""
        return self.tensors(WEIGHTS_TAG)

    # Whether the weights came from no checkpoint (load_format "dummy": random, for a rollout
    # that receives its trainer's): the rank then says Hello NEEDS_RELOAD until an update.
    dummy_weights: bool = False

    # Whether `execute` may write the weights (a trainer: yes; inference: no). The default is
    # the safe answer; a wrong "no" brings back stale weights after a wake
    # (StageSpec.verify_clean_sleep catches it).
    execute_writes_weights: bool = True

    def read_only_tags(self) -> frozenset[str]:
        """Tags whose content `execute` never changes. A backend that keeps a host copy of
        them (`fast`) sleeps them without copying again."""
        return frozenset() if self.execute_writes_weights else frozenset({WEIGHTS_TAG})

    def buffers_to_save(self) -> Mapping[str, torch.Tensor]:
        """Small tensors that a sleep discarding their pool must keep (level 2): values that
        `reload_weights` does not reproduce, e.g. buffers computed at start-up."""
        return {}

    def load(self, open_pool: OpenPool, tags: Iterable[str], budget: MemoryBudget | None) -> None:
        """Allocate every tag, each inside its pool. The default allocates tag by tag and
        sizes the caches first when the stage has a memory fraction (`budget` is then
        given). A runner whose framework allocates several tags in one call (vLLM's worker
        loads weights, profiles, then allocates its KV cache) overrides this and opens the
        pools itself, at the points where the framework allocates."""
        tags = tuple(tags)
        self.adapter_tag = ADAPTERS_TAG if ADAPTERS_TAG in tags else WEIGHTS_TAG
        held = self.runner_tags()
        for tag in tags:
            if budget is not None and tag == KV_CACHE_TAG:
                self.fit_caches(budget.available_bytes())
            with nullcontext() if tag in held else open_pool(tag):
                self.allocate(tag)

    def runner_tags(self) -> frozenset[str]:
        """Tags whose memory the runner releases in `before_sleep` and restores in `after_wake`
        itself, outside every backend pool (vLLM's NCCL communicators: `comm`); the backend
        never sees them. The default: none."""
        return frozenset()

    def held_bytes(self, tag: str) -> int:
        """Device bytes the runner holds now for one of its `runner_tags` (0 while released)."""
        return 0

    def before_sleep(self, offload: frozenset[str], discard: frozenset[str]) -> None:
        """Called before the backend releases `offload | discard`: drop state that would
        point into released memory (vLLM: the prefix cache). The default does nothing."""
        return None

    def after_wake(self, tags: frozenset[str]) -> None:
        """Called after the backend mapped `tags` back (and restored saved buffers): rebuild
        what a wake leaves undefined (vLLM: KV-cache scales). The default does nothing."""
        return None

    def allocate(self, tag: str) -> None:
        """Allocate the memory of one tag. Override for tags other than weights/kv_cache.
        `adapters` starts empty: AddAdapter allocates in it (P-20)."""
        if tag == WEIGHTS_TAG:
            self.load_weights()
        elif tag == KV_CACHE_TAG:
            self.allocate_caches()
        elif tag == ADAPTERS_TAG and self.supports_adapters:
            self.adapter_tag = ADAPTERS_TAG  # the adapters get a pool of their own
        else:
            raise ValueError(
                f"{type(self).__name__} has no allocation for tag {tag!r}; override "
                f"ModelRunner.allocate or configure only tags {[WEIGHTS_TAG, KV_CACHE_TAG]}"
            )

    def fit_caches(self, available_bytes: int) -> None:
        """Called before `allocate_caches` when the stage has a `gpu_memory_fraction`: the
        bytes this process may still allocate (its fraction of the device minus what it
        already holds, other processes on the GPU not counted). Size the caches to it; the
        default keeps the configured size, and the worker refuses to start if that overshoots."""
        return None

    def reset_prefix_cache(self) -> int | None:
        """Drop what the runner caches across requests (prefix KV blocks, prompt embeddings)
        without releasing or remapping memory (ResetPrefixCache); return how many entries went
        (None: the framework does not say). The default is for a runner that caches nothing
        across requests: nothing to drop, 0."""
        return 0

    def derived_caches(self) -> tuple[DerivedCache, ...]:
        """Every cache whose entries the weights produced. The worker drops each (or, when the
        caller keeps caches keyed by version, each not keyed so) after a reload or an update
        wrote the weights and before it ACKs, naming them in the Ack: a request after the
        ACK never reuses what older weights computed. A runner that caches anything across
        requests must list it here; the default caches nothing."""
        return ()

    def drop_derived_cache(self, name: str) -> None:
        """Drop every entry of the derived cache `name` (one of `derived_caches`), releasing no
        memory. The default drops all of them at once, by `reset_prefix_cache`."""
        self.reset_prefix_cache()

    # ------------------------------------------------------------------ LoRA adapters (P-20)

    # The tag whose pool holds the adapters' tensors: `adapters` when the stage has it (set by
    # `load`), else the weights', which then list them too.
    adapter_tag: str = WEIGHTS_TAG

    @property
    def supports_adapters(self) -> bool:
        return type(self).add_adapter is not ModelRunner.add_adapter

    def check_adapter(self, command: AddAdapter) -> None:
        """Check an AddAdapter before anything is loaded or evicted: the source exists and is
        an adapter of this model's architecture, of `command.rank`, on `command.target_modules`
        (each a module this model has). A problem raises RunnerArgumentError naming it."""
        raise RunnerArgumentError(f"{type(self).__name__} serves no LoRA adapters")

    def add_adapter(self, command: AddAdapter) -> None:
        """Load the adapter (checked by `check_adapter`) as `command.name`, replacing one of that
        name; runs inside the adapters' pool. Its tensors are listed by `tensors(tag)` of that
        pool's tag (`adapters`, else `weights`), so a level-1 sleep keeps them bit for bit."""
        raise RunnerArgumentError(f"{type(self).__name__} serves no LoRA adapters")

    @property
    def supports_adapter_tensors(self) -> bool:
        return type(self).write_adapter is not ModelRunner.write_adapter

    def adapter_specs(self, command: AddAdapter) -> Mapping[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every tensor an adapter of `command.rank` on `command.target_modules` holds, by the
        name PEFT saves it under (`base_model.model.<module>.lora_A.weight`), with its shape and
        dtype: what an AddAdapter's `tensors` must carry, checked before anything is written."""
        raise RunnerArgumentError(f"{type(self).__name__} takes adapters from a directory only")

    def write_adapter(self, command: AddAdapter, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Make the adapter `command.name` from `tensors` (checked against `adapter_specs`), or
        refit the one held of that name, rank and modules in place (no new allocation, the
        base weights untouched); runs inside the adapters' pool, as `add_adapter` does. A raise
        once writing began leaves the adapter unloaded (the worker removes it)."""
        raise RunnerArgumentError(f"{type(self).__name__} takes adapters from a directory only")

    def remove_adapter(self, name: str) -> None:
        """Unload the adapter `name`; a name not loaded is nothing to do."""
        return None

    def pin_adapter(self, name: str, pinned: bool) -> None:
        """A framework with its own adapter cache (vLLM) pins it there; the default has none."""
        return None

    def execute_adapter(self, payload: Any, adapter: str) -> Any:
        """Run one request with the loaded adapter `adapter` (the worker core checked it is)."""
        raise RunnerArgumentError(f"{type(self).__name__} serves no LoRA adapters")

    def counters(self) -> Mapping[str, int]:
        """A few counters of the runner's own (a cache's hits and misses), shown in the stage's
        status and as metrics: the same names every call (at load they are declared; at most
        16, of [a-z0-9_] starting with a letter), each an int in 0..2**63-1. Called after every
        command, so keep it cheap. The default reports none."""
        return {}

    def close(self) -> None:
        """Drop every tensor reference (Shutdown). The default does nothing."""
        return None


def drop_derived_caches(runner: ModelRunner, *, flush: bool) -> tuple[str, ...]:
    """After a reload or an update wrote the weights: drop every derived cache (`flush`), or
    those not keyed by version; the names dropped, for the Ack."""
    caches = runner.derived_caches()
    if len(caches) > MAX_DERIVED_CACHES:
        raise RuntimeError(
            f"{type(runner).__name__} declares {len(caches)} derived caches; an Ack names at most "
            f"{MAX_DERIVED_CACHES}: merge them"
        )
    dropped = []
    for cache in caches:
        if flush or not cache.keyed_by_version:
            runner.drop_derived_cache(cache.name)
            dropped.append(cache.name)
    return tuple(dropped)


def refuse_kept_caches(runner: ModelRunner) -> None:
    """An update asked to keep the caches (`flush_cache` False): legal only when every derived
    cache is keyed by version; refused before any write otherwise."""
    unkeyed = [cache.name for cache in runner.derived_caches() if not cache.keyed_by_version]
    if unkeyed:
        raise RunnerArgumentError(
            f"flush_cache false keeps only caches keyed by weights version, and {type(runner).__name__}'s "
            f"{unkeyed} are keyed by prompt alone: kept, they would serve what the old weights "
            "computed; send flush_cache true (the default)"
        )


def load_runner_class(name: str) -> type[ModelRunner]:
    """The runner class for WorkerConfig.runner: a registered name (omni_core.plugins) or
    'package.module:Class'."""
    cls = resolve(RUNNERS, name)
    if not (isinstance(cls, type) and issubclass(cls, ModelRunner)):
        raise TypeError(
            f"runner {name!r} resolves to {cls!r}, which is not a subclass of omni_core.runners.base.ModelRunner"
        )
    return cls


def load_runner(name: str, device: torch.device, runner_args: Mapping[str, Any]) -> ModelRunner:
    return load_runner_class(name)(device, **dict(runner_args))
