"""The built-in synthetic runner: a plain torch model whose output proves the memory came back.

Weights are `tensor_count` matrices of shape (rows, hidden) whose total is about
`weights_bytes`, filled from `seed`. A request {"seed": s, "batch": b} draws an input
from s and passes it through every weight matrix in turn, writing each layer's result into
the KV cache and reading it back from there. So:

- every weight element is read: a missing or wrong restore changes the output;
- the KV cache is scratch (written before it is read): its content after a discard does
  not matter, but its memory must be mapped;
- a `calibration` buffer, drawn at load time and *not* refilled by `reload_weights`, scales
  the input: a level-2 sleep that loses `buffers_to_save()` changes the output after reload.

The output is deterministic for a given input, seed and device, so "output after wake
equals output before sleep" is checked bit for bit (`data` holds the raw bytes).

A request {"prompt": [token, ...]} runs a recurrent pass instead, one weight matrix per token,
and, when `prefix_cache_entries` > 0, reuses the state reached at each full block of
`prefix_block_tokens` tokens of an earlier prompt with the same prefix (vLLM's prefix caching in
miniature, keyed by the tokens alone). That cache is derived from the weights
(`derived_caches`), so the worker drops it at every reload and update: a prompt served before
and after an update equals a fresh stage's on the new weights.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from omni_core.fsm.tags import ADAPTERS_TAG, KV_CACHE_TAG, WEIGHTS_TAG
from omni_core.protocol import AddAdapter
from omni_core.runners.base import DerivedCache, ModelRunner, RunnerArgumentError
from omni_core.runners.connector import ConnectorSpec
from omni_core.runners.weights import read_saved, write_safetensors

MiB = 1 << 20
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a runner argument names; the synthetic runners support these three."""
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; use one of {sorted(_DTYPES)}")
    return _DTYPES[name]


MAX_BATCH = 1024
MAX_PROMPT_TOKENS = 4096
MAX_PREFIX_CACHE_ENTRIES = 65536
PREFIX_CACHE = "prefix_states"  # the states at each full block of a prompt (DerivedCache)


def tensor_bytes(t: torch.Tensor) -> bytes:
    """Raw bytes of a tensor (copied to CPU), without needing numpy."""
    host = t.detach().to("cpu").contiguous()
    return ctypes.string_at(host.data_ptr(), host.numel() * host.element_size()) if host.numel() else b""


def _seed_for(seed: int, index: int) -> int:
    return (seed * 1_000_003 + index) % (1 << 63)


class SyntheticRunner(ModelRunner):
    execute_writes_weights = False  # inference: requests read the weights only

    def __init__(
        self,
        device: torch.device,
        *,
        weights_bytes: int = 4 * MiB,
        tensor_count: int = 16,
        kv_bytes: int | str = 1 * MiB,  # or "auto": all that gpu_memory_fraction leaves
        hidden: int = 128,
        dtype: str = "float32",
        seed: int = 0,
        cpu_threads: int | None = None,
        prefix_cache_entries: int = 0,
        prefix_block_tokens: int = 16,
    ) -> None:
        super().__init__(device)
        self.prefix = PrefixStates(prefix_cache_entries, prefix_block_tokens)
        if cpu_threads is not None and torch.device(device).type == "cpu":
            # Tiny matmuls on a busy machine: several intra-op threads wait on each other
            # for whole scheduler slices (20 ms per op seen on 2 loaded cores).
            torch.set_num_threads(cpu_threads)
        self.dtype = torch_dtype(dtype)
        elem = torch.empty((), dtype=self.dtype).element_size()
        if tensor_count < 1 or hidden < 1:
            raise ValueError(f"tensor_count ({tensor_count}) and hidden ({hidden}) must be >= 1")
        self.rows = weights_bytes // (tensor_count * hidden * elem)
        if self.rows < 1:
            raise ValueError(
                f"weights_bytes={weights_bytes} is too small for {tensor_count} tensors "
                f"of hidden={hidden} {dtype}; need >= {tensor_count * hidden * elem}"
            )
        self._row_bytes = hidden * elem
        if kv_bytes == "auto":
            self.kv_rows = 0  # sized by fit_caches
        elif isinstance(kv_bytes, int):
            self.kv_rows = kv_bytes // self._row_bytes
            if self.kv_rows < 1:
                raise ValueError(f"kv_bytes={kv_bytes} is below one row of hidden={hidden} {dtype}")
        else:
            raise ValueError(f"kv_bytes must be a byte count or 'auto', got {kv_bytes!r}")
        self.kv_auto = kv_bytes == "auto"
        self.tensor_count = tensor_count
        self.hidden = hidden
        self.seed = seed
        self.weights: list[torch.Tensor] = []
        self.calibration: torch.Tensor | None = None
        self.kv: torch.Tensor | None = None
        # LoRA adapters (P-20): name -> {weight index: (A (rank, hidden), B (hidden, rank))}
        self.adapters: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._graphs: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = {}
        self._adapter: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # the running request's

    # ------------------------------------------------------------------ sizes

    @property
    def weights_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.weights)

    # ------------------------------------------------------------------ allocation

    def load_weights(self) -> None:
        self.weights = [
            torch.empty(self.rows, self.hidden, dtype=self.dtype, device=self.device) for _ in range(self.tensor_count)
        ]
        self._fill(self.seed)
        gen = torch.Generator(device="cpu").manual_seed(_seed_for(self.seed, 1 << 32))
        calib = 1.0 + 0.5 * torch.rand(self.hidden, generator=gen)
        self.calibration = calib.to(device=self.device, dtype=self.dtype)

    def fit_caches(self, available_bytes: int) -> None:
        if self.kv_auto:
            self.kv_rows = available_bytes // self._row_bytes

    def allocate_caches(self) -> None:
        if self.kv_rows < 1:
            raise ValueError(
                "kv_bytes='auto' sizes the KV cache from the stage's gpu_memory_fraction, "
                "but none was set or nothing was left; set StageSpec.gpu_memory_fraction "
                "or give kv_bytes in bytes"
            )
        self.kv = torch.zeros(self.kv_rows, self.hidden, dtype=self.dtype, device=self.device)

    def tensors(self, tag: str) -> list[torch.Tensor]:
        held = [t for pairs in self.adapters.values() for pair in pairs.values() for t in pair]
        if tag == WEIGHTS_TAG:
            own = [*self.weights, *([self.calibration] if self.calibration is not None else [])]
            return own + (held if self.adapter_tag == WEIGHTS_TAG else [])
        if tag == KV_CACHE_TAG:
            return [self.kv] if self.kv is not None else []
        if tag == ADAPTERS_TAG:
            return held
        raise ValueError(f"SyntheticRunner has no tag {tag!r}; it has {[WEIGHTS_TAG, KV_CACHE_TAG, ADAPTERS_TAG]}")

    # ------------------------------------------------------------------ LoRA adapters (P-20)

    def check_adapter(self, command: AddAdapter) -> None:
        """A synthetic adapter comes from 'seed:<int>' or from tensors; its modules are the
        weights `w0`.."""
        if command.tensors is None:
            _parse_seed(command.source)
        modules = {f"w{i}" for i in range(self.tensor_count)}
        missing = sorted(set(command.target_modules) - modules)
        if missing:
            raise RunnerArgumentError(
                f"adapter {command.name!r} targets modules {missing} this model lacks; "
                f"it has w0..w{self.tensor_count - 1}"
            )
        if command.rank > self.hidden:
            raise RunnerArgumentError(f"adapter {command.name!r} has rank {command.rank} above hidden {self.hidden}")

    def add_adapter(self, command: AddAdapter) -> None:
        seed = _parse_seed(command.source)
        pairs = {}
        for module in command.target_modules:
            index = int(module[1:])
            gen = torch.Generator(device="cpu").manual_seed(_seed_for(seed, index))
            a = torch.randn(command.rank, self.hidden, generator=gen) / math.sqrt(self.hidden)
            b = torch.randn(self.hidden, command.rank, generator=gen) / math.sqrt(command.rank)
            pairs[index] = (a.to(self.device, self.dtype), b.to(self.device, self.dtype))
        self.adapters[command.name] = pairs

    def adapter_specs(self, command: AddAdapter) -> Mapping[str, tuple[tuple[int, ...], torch.dtype]]:
        specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for module in command.target_modules:
            specs[f"base_model.model.{module}.lora_A.weight"] = ((command.rank, self.hidden), self.dtype)
            specs[f"base_model.model.{module}.lora_B.weight"] = ((self.hidden, command.rank), self.dtype)
        return specs

    def write_adapter(self, command: AddAdapter, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        held = self.adapters.get(command.name)
        shape = {int(m[1:]) for m in command.target_modules}
        if held is None or set(held) != shape or held[next(iter(held))][0].shape[0] != command.rank:
            held = {
                i: (
                    torch.empty(command.rank, self.hidden, dtype=self.dtype, device=self.device),
                    torch.empty(self.hidden, command.rank, dtype=self.dtype, device=self.device),
                )
                for i in sorted(shape)
            }
            self.adapters[command.name] = held
        with torch.no_grad():
            for name, tensor in tensors:  # in place: a refit allocates nothing
                module, _, kind = name.removeprefix("base_model.model.").partition(".lora_")
                held[int(module[1:])][0 if kind.startswith("A") else 1].copy_(tensor)

    def remove_adapter(self, name: str) -> None:
        self.adapters.pop(name, None)

    def execute_adapter(self, payload: Any, adapter: str) -> Any:
        if not isinstance(payload, dict) or "prompt" in payload or payload.get("graph"):
            raise ValueError("a synthetic adapter serves {'seed', 'batch'} requests only (no prompt, no graph)")
        self._adapter = self.adapters[adapter]
        try:
            return self.execute(payload)
        finally:
            self._adapter = {}

    def buffers_to_save(self) -> Mapping[str, torch.Tensor]:
        return {"calibration": self.calibration} if self.calibration is not None else {}

    def reload_weights(self, source: str | None) -> None:
        if source is not None and os.path.isabs(source):  # a directory save_weights wrote
            if not os.path.isdir(source):
                raise RunnerArgumentError(
                    f"SyntheticRunner reloads from 'seed:<int>' or a directory it saved; {source[:200]!r} is "
                    "not a directory: give the directory a save_weights wrote, or a seed"
                )
            self.update_weights(read_saved(Path(source), self.weight_specs()))
            return
        seed = self.seed if source is None else _parse_seed(source)
        elsewhere = sorted({str(w.device) for w in self.weights if w.device != self.device})
        if elsewhere:  # the weights point at a host copy (a refit while asleep)
            raise RunnerArgumentError(
                f"the synthetic runner draws its weights on {self.device}, not on {elsewhere}: a refit into "
                "the host copy takes an shm, ipc or collective update; wake it to reload from 'seed:N'"
            )
        self._fill(seed)

    def save_weights(self, directory: Path, max_file_bytes: int) -> list[str]:
        return write_safetensors(directory, self.weights_to_share(), max_file_bytes)

    def weight_specs(self) -> Mapping[str, tuple[tuple[int, ...], torch.dtype]]:
        # The calibration buffer is not a weight: like a reload, an update leaves it alone.
        return {f"w{i}": ((self.rows, self.hidden), self.dtype) for i in range(self.tensor_count)}

    # Updates copy in place wherever the tensors point (the host copy too); a reload draws from
    # a generator on the rank's device, which a host copy cannot take: refused before writing.
    supports_host_refit = True

    def update_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in named:
                self.weights[int(name[1:])].copy_(tensor)

    def weights_to_share(self) -> dict[str, torch.Tensor]:
        return {f"w{i}": w for i, w in enumerate(self.weights)}

    def _fill(self, seed: int) -> None:
        # One generator per tensor on the device itself: the same values at load and at
        # every reload, and no multi-GiB detour through host memory.
        std = 1.0 / math.sqrt(math.sqrt(self.rows * self.hidden))
        with torch.no_grad():
            for i, w in enumerate(self.weights):
                gen = torch.Generator(device=self.device).manual_seed(_seed_for(seed, i))
                w.normal_(0.0, std, generator=gen)

    def derived_caches(self) -> tuple[DerivedCache, ...]:
        return (DerivedCache(PREFIX_CACHE, keyed_by_version=False),) if self.prefix.capacity else ()

    def drop_derived_cache(self, name: str) -> None:
        self.prefix.clear()

    def reset_prefix_cache(self) -> int:
        """The prompt states kept by prefix (the KV rows are scratch every request writes before
        it reads them, so nothing else is kept across requests); how many went."""
        return self.prefix.clear()

    def counters(self) -> Mapping[str, int]:
        if not self.prefix.capacity:
            return {}
        return {"prefix_cache_hits": self.prefix.hits, "prefix_cache_misses": self.prefix.misses}

    def close(self) -> None:
        self._graphs.clear()
        self.weights = []
        self.calibration = None
        self.kv = None
        self.adapters.clear()
        self.prefix.clear()

    # ------------------------------------------------------------------ execution

    def _check_resident(self) -> None:
        # A released tensor reads freed memory (a crash on CPU, garbage on GPU); refuse
        # with a message instead. Cheap: one storage size per tensor.
        adapter = [t for pair in self._adapter.values() for t in pair]
        held = (
            (WEIGHTS_TAG, self.tensors(WEIGHTS_TAG)),
            (KV_CACHE_TAG, self.tensors(KV_CACHE_TAG)),
            (ADAPTERS_TAG, adapter),
        )
        for tag, tensors in held:
            for t in tensors:
                if t.untyped_storage().nbytes() < t.numel() * t.element_size():
                    raise RuntimeError(
                        f"a {tag} tensor of shape {tuple(t.shape)} holds no memory: "
                        "its pool is asleep; wake it before Execute"
                    )
        if not self.weights or self.kv is None or self.calibration is None:
            raise RuntimeError("SyntheticRunner.execute before load_weights/allocate_caches")

    def transfer_exports(self) -> dict[str, ConnectorSpec]:
        """`hidden`: the forward pass's output rows, which another synthetic stage takes as its input."""
        return {"hidden": ConnectorSpec(self.dtype, (None, self.hidden))}

    def transfer_imports(self) -> dict[str, ConnectorSpec]:
        return self.transfer_exports()

    def export_tensors(self, payload: Any, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """The output rows of `execute(payload)` (`{"seed", "batch"}`) as the tensor `hidden`."""
        if not isinstance(payload, dict) or set(payload) - {"seed", "batch"}:
            raise RunnerArgumentError(f"an export takes {{'seed': int, 'batch': int}}, got {payload!r:.200}")
        self._check_resident()
        with torch.no_grad():
            return {"hidden": self._forward(self._input(int(payload.get("seed", 0)), int(payload.get("batch", 1))))}

    def _input(self, seed: int, batch: int) -> torch.Tensor:
        gen = torch.Generator(device="cpu").manual_seed(_seed_for(seed, 7))
        return torch.randn(batch, self.hidden, generator=gen).to(device=self.device, dtype=self.dtype)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.kv is not None and self.calibration is not None
        batch = x.shape[0]
        slots = self.kv_rows // batch
        x = x * self.calibration
        for i, w in enumerate(self.weights):
            y = (x @ w.T) @ w
            if i in self._adapter:  # the request's adapter on this weight: x A^T B^T
                a, b = self._adapter[i]
                y = y + (x @ a.T) @ b.T
            start = (i % slots) * batch
            cache = self.kv[start : start + batch]
            cache.copy_(y)  # write, then read back: the KV pool must be mapped
            x = x + torch.tanh(cache)
        return x

    def execute(self, payload: Any) -> dict[str, Any]:
        if not isinstance(payload, dict):
            raise TypeError(f"SyntheticRunner payload must be a dict like {{'seed': 1, 'batch': 2}}, got {payload!r}")
        if "prompt" in payload:
            return self._prompt(payload["prompt"])
        seed = int(payload.get("seed", 0))
        batch = int(payload.get("batch", 1))
        limit = min(MAX_BATCH, self.kv_rows)
        if not 1 <= batch <= limit:
            raise ValueError(f"batch must be in 1..{limit} (KV rows {self.kv_rows}), got {batch}")
        self._check_resident()
        # P-22: a pipeline's consumer runs on what its producer stage's export landed here.
        x = self.take_imported(payload["transfer"])["hidden"] if "transfer" in payload else self._input(seed, batch)
        with torch.no_grad():
            out = self._graph_forward(x) if payload.get("graph") else self._forward(x)
        data = tensor_bytes(out)
        return {
            "shape": list(out.shape),
            "dtype": str(out.dtype).removeprefix("torch."),
            "sha256": hashlib.sha256(data).hexdigest(),
            "data": data,
            "graph": bool(payload.get("graph")),
        }

    def _prompt(self, tokens: Any) -> dict[str, Any]:
        """The recurrent pass over `tokens`, from the longest cached block-aligned prefix."""
        if not (
            isinstance(tokens, list)
            and 1 <= len(tokens) <= MAX_PROMPT_TOKENS
            and all(type(t) is int and 0 <= t < 1 << 31 for t in tokens)
        ):
            raise ValueError(f"prompt must be a list of 1..{MAX_PROMPT_TOKENS} token ids in 0..2**31-1")
        self._check_resident()
        assert self.calibration is not None
        reused, state = self.prefix.longest(tokens)
        x = self.calibration[None].clone() if state is None else state.to(self.device, copy=True)
        with torch.no_grad():
            for position in range(reused, len(tokens)):
                gen = torch.Generator(device="cpu").manual_seed(_seed_for(tokens[position], 11))
                embedding = torch.randn(1, self.hidden, generator=gen).to(device=self.device, dtype=self.dtype)
                w = self.weights[position % self.tensor_count]
                x = x + torch.tanh(((x + embedding) @ w.T) @ w)
                self.prefix.offer(tokens, position + 1, x)
        data = tensor_bytes(x)
        return {"sha256": hashlib.sha256(data).hexdigest(), "data": data, "reused_tokens": reused}

    def _graph_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Replay a CUDA graph captured at the first call of this batch size: the graph keeps
        the weight and KV addresses it saw, so it is only valid on a backend with stable
        addresses (cumem), which is the point of testing it."""
        if self.device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA device; this runner is on {self.device}")
        batch = x.shape[0]
        if batch not in self._graphs:
            static_in = x.clone()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward(static_in)  # warm-up outside capture (cuBLAS handles, workspaces)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = self._forward(static_in)
            self._graphs[batch] = (graph, static_in, static_out)
        graph, static_in, static_out = self._graphs[batch]
        static_in.copy_(x)
        graph.replay()
        torch.cuda.synchronize(self.device)
        return static_out.clone()


class PrefixStates:
    """The state after each full block of a prompt, by the digest of the tokens up to it, least
    recently used out first; at most `capacity` entries, each one host copy of a hidden row."""

    def __init__(self, capacity: int, block_tokens: int) -> None:
        if type(capacity) is not int or not 0 <= capacity <= MAX_PREFIX_CACHE_ENTRIES:
            raise ValueError(f"prefix_cache_entries must be an int in 0..{MAX_PREFIX_CACHE_ENTRIES}, got {capacity!r}")
        if type(block_tokens) is not int or not 1 <= block_tokens <= MAX_PROMPT_TOKENS:
            raise ValueError(f"prefix_block_tokens must be an int in 1..{MAX_PROMPT_TOKENS}, got {block_tokens!r}")
        self.capacity, self.block_tokens = capacity, block_tokens
        self.entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.hits = self.misses = 0

    @staticmethod
    def _key(tokens: list[int], length: int) -> bytes:
        return hashlib.sha256(b"".join(t.to_bytes(4, "little") for t in tokens[:length])).digest()

    def longest(self, tokens: list[int]) -> tuple[int, torch.Tensor | None]:
        """The longest cached block-aligned prefix of `tokens` (its length, its state)."""
        if self.capacity:
            for length in range(len(tokens) // self.block_tokens * self.block_tokens, 0, -self.block_tokens):
                key = self._key(tokens, length)
                state = self.entries.get(key)
                if state is not None:
                    self.entries.move_to_end(key)
                    self.hits += 1
                    return length, state
            self.misses += 1
        return 0, None

    def offer(self, tokens: list[int], length: int, state: torch.Tensor) -> None:
        """Keep the state after `length` tokens when it ends a full block."""
        if not self.capacity or length % self.block_tokens:
            return
        key = self._key(tokens, length)
        self.entries[key] = state.detach().to("cpu", copy=True)
        self.entries.move_to_end(key)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def clear(self) -> int:
        dropped = len(self.entries)
        self.entries.clear()
        return dropped


def _parse_seed(source: str) -> int:
    """'seed:<int>' to the int; anything else is the caller's mistake, refused before any write
    (the fuzzer found '--5', '²' and 5000 digits passing a str.isdigit() check into int())."""
    digits = source[5:] if source.startswith("seed:") else None
    try:
        if digits is None or len(digits) > 20:  # a seed is a 64-bit value
            raise ValueError
        return int(digits, 10)
    except ValueError:
        raise RunnerArgumentError(
            f"SyntheticRunner reloads from 'seed:<int>' (at most 20 digits), a directory it saved "
            f"(an absolute path) or None (its own seed), got {source[:80]!r}"
        ) from None
