"""A causal language model from a local transformers directory, as a worker's runner.

    StageSpec("talker", runner="transformers",
              runner_args={"model": "/models/qwen2-1.5b", "dtype": "bfloat16", "max_batch": 4, "max_seq_len": 2048})

- `load_weights` (inside the `weights` pool): `AutoModelForCausalLM.from_pretrained(model,
  local_files_only=True)` straight onto the worker's device; every parameter and buffer,
  the rotary `inv_freq` included, is then memory of that pool.
- `allocate_caches` (inside `kv_cache`): one transformers `StaticCache` of `max_batch` rows x
  `max_seq_len` tokens, allocated up front (transformers would otherwise allocate it lazily
  at the first request, outside any pool). `max_seq_len="auto"` takes what
  `gpu_memory_fraction` leaves (`fit_caches`).
- `execute`: greedy or seeded sampling with that cache; see `TransformersRunner.execute`.
- `reload_weights(source)`: refills the same tensors from safetensors (None: the runner's own
  directory; another directory of the same architecture: an RL weight update), after checking
  every header; `last_reload` keeps bytes, duration and GB/s.
- `buffers_to_save`: the non-persistent buffers (rotary frequencies), which no checkpoint holds.

Tensor parallel: a stage of several ranks (WORLD_SIZE > 1, set by the engine) is one model
sharded across them with transformers' own plan (`tp_plan="auto"`: attention heads and MLP
columns split, norms replicated; Qwen2, Llama and the other architectures transformers ships
a plan for). Each rank joins the stage's process group (NCCL, gloo on CPU), holds its shard of
every weight and its heads of the KV cache, and runs every request; the logits are gathered,
so every rank picks the same tokens and returns the same result. A reload cuts each rank's
shard from the checkpoint on the host, as the plan does.

The cache is scratch: each request resets it, so its content after a discard does not matter.
"""

from __future__ import annotations

import inspect
import logging
import os
import shutil
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

from omni_core.fsm.tags import ADAPTERS_TAG, KV_CACHE_TAG, WEIGHTS_TAG
from omni_core.protocol import AddAdapter
from omni_core.runners.base import ModelRunner, RunnerArgumentError
from omni_core.runners.connector import ConnectorSpec, export_result, wants_export
from omni_core.runners.generation import GenerationRequest, Sampling, is_int, parse_each, parse_generation
from omni_core.runners.lora import PeftAdapters
from omni_core.runners.synthetic import torch_dtype
from omni_core.runners.tensor_parallel import join_process_group
from omni_core.runners.weights import (
    ReloadReport,
    WeightSet,
    check_placements,
    check_resident,
    module_tensors,
    non_persistent_buffers,
    own_storage,
    torch_threads,
)

log = logging.getLogger("omni_core.runners.transformers")

# What a save copies of the model's directory besides the weights: what from_pretrained reads.
CHECKPOINT_FILES = frozenset(
    {"config.json", "generation_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"}
)
LOAD_FORMATS = ("safetensors", "dummy")  # vLLM's names: the checkpoint's weights, or random ones
DEFAULT_MAX_SEQ_LEN = 2048  # when the config allows more: the cache is allocated whole
MAX_BATCH_LIMIT = 1024
ASYNC_LOAD_SWITCH = "HF_DEACTIVATE_ASYNC_LOAD"  # transformers >= 5: "1" reads every tensor on the calling thread


def cache_keyword(forward: Any) -> str:
    """The name a model's forward takes its KV cache under: `cache` from transformers 5.25 on
    (where `past_key_values` is deprecated, to go in 5.40), `past_key_values` before it."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


@contextmanager
def _sequential_loading() -> Iterator[None]:
    """transformers' switch for loading on the calling thread (read at each from_pretrained)."""
    before = os.environ.get(ASYNC_LOAD_SWITCH)
    os.environ[ASYNC_LOAD_SWITCH] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ASYNC_LOAD_SWITCH, None)
        else:
            os.environ[ASYNC_LOAD_SWITCH] = before


def _auto_tp_plan() -> dict[str, Any]:
    """transformers' own sharding plan, asked for the way the installed version takes it."""
    try:  # newer transformers take it in a DistributedConfig (there a bare tp_plan= is deprecated)
        from transformers.distributed import DistributedConfig

        return {"distributed_config": DistributedConfig(tp_plan="auto")}
    except (ImportError, TypeError):
        return {"tp_plan": "auto"}


class TransformersRunner(ModelRunner):
    execute_writes_weights = False  # inference: requests read the weights only

    def __init__(
        self,
        device: torch.device,
        *,
        model: str,
        dtype: str = "auto",
        max_batch: int = 1,
        max_seq_len: int | str | None = None,
        attn_implementation: str = "sdpa",
        cpu_threads: int | None = None,
        init_timeout_s: float = 120.0,
        load_format: str = "safetensors",
    ) -> None:
        super().__init__(device)
        if load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format must be one of {list(LOAD_FORMATS)}, got {load_format!r}: 'dummy' reads no "
                "weights (random, from config.json), for a rollout whose trainer sends them"
            )
        self.dummy_weights = load_format == "dummy"
        from transformers import AutoConfig

        torch_threads(torch.device(device), cpu_threads)
        self.model_dir = Path(model).expanduser()
        if not (self.model_dir / "config.json").is_file():
            raise ValueError(
                f"model={model!r} is not a transformers checkpoint directory (no config.json); give "
                "a local directory, e.g. one written by `omni-core models make qwen2 tiny DIR`"
            )
        # Host-side only: the config (and the tokenizer below) hold no device memory, and a
        # bad argument should fail here rather than half-way through loading.
        self.config = AutoConfig.from_pretrained(str(self.model_dir), local_files_only=True)
        self.dtype = self._resolve_dtype(dtype)
        if not is_int(max_batch) or not 1 <= max_batch <= MAX_BATCH_LIMIT:
            raise ValueError(f"max_batch must be an int in 1..{MAX_BATCH_LIMIT}, got {max_batch!r}")
        self.max_batch = max_batch
        self.max_positions = int(getattr(self.config, "max_position_embeddings", DEFAULT_MAX_SEQ_LEN))
        self.seq_len_auto = max_seq_len == "auto"
        self.max_seq_len = self._resolve_seq_len(max_seq_len)
        self.attn_implementation = attn_implementation
        self.kv_heads = int(getattr(self.config, "num_key_value_heads", None) or self.config.num_attention_heads)
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        if self.world > 1:
            self._join_tensor_parallel(init_timeout_s)
        self.local_kv_heads = self.kv_heads // self.world  # the heads of the cache this rank holds
        self.head_dim = int(
            getattr(self.config, "head_dim", None) or self.config.hidden_size // self.config.num_attention_heads
        )
        self.tokenizer = self._load_tokenizer()
        self.model: Any = None
        self.cache: Any = None
        self.weights: WeightSet | None = None
        self.last_reload: ReloadReport | None = None
        self.lora: PeftAdapters | None = None  # LoRA adapters (P-20), from the first AddAdapter

    def _join_tensor_parallel(self, init_timeout_s: float) -> None:
        """One rank of a tensor-parallel stage: check the heads shard and the device, then join
        the process group."""
        heads = int(self.config.num_attention_heads)
        if heads % self.world or self.kv_heads % self.world:
            raise ValueError(
                f"a stage of {self.world} ranks shards the model's attention heads: "
                f"{heads} query and {self.kv_heads} key/value heads must both be divisible by "
                f"{self.world}; use a number of ranks that divides them"
            )
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if self.device.type == "cuda" and self.device.index not in (None, local_rank):
            raise ValueError(
                f"transformers places a tensor-parallel rank on cuda:{local_rank} (LOCAL_RANK), "
                f"but this rank's device is {self.device}"
            )
        if self.dummy_weights:
            raise ValueError("load_format='dummy' on a tensor-parallel stage is not supported: run it with one rank")
        join_process_group(self.device, init_timeout_s)

    def _resolve_seq_len(self, max_seq_len: int | str | None) -> int:
        """The cache's length: the argument, the default (capped by the model), or 0 for
        "auto" (sized by fit_caches)."""
        if max_seq_len is None:
            return min(self.max_positions, DEFAULT_MAX_SEQ_LEN)
        if self.seq_len_auto:
            return 0
        if is_int(max_seq_len) and 2 <= int(max_seq_len) <= self.max_positions:
            return int(max_seq_len)
        raise ValueError(
            f"max_seq_len must be an int in 2..{self.max_positions} (the model's max_position_embeddings), "
            f"'auto' or None, got {max_seq_len!r}"
        )

    def _resolve_dtype(self, name: str) -> torch.dtype:
        if name != "auto":
            return torch_dtype(name)
        configured = getattr(self.config, "dtype", None) or getattr(self.config, "torch_dtype", None)
        if isinstance(configured, torch.dtype):
            return configured
        return torch_dtype(str(configured)) if configured else torch.float32

    def _load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        if not any((self.model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            return None  # prompt_ids only
        return AutoTokenizer.from_pretrained(str(self.model_dir), local_files_only=True)

    # ------------------------------------------------------------------ allocation

    def _dummy_model(self) -> Any:
        """The architecture of config.json with transformers' own random initialisation, made on
        the device (inside the weights pool) and reading no file: vLLM's load_format 'dummy'."""
        from transformers import AutoModelForCausalLM

        with torch.device(self.device):
            return AutoModelForCausalLM.from_config(
                self.config, dtype=self.dtype, attn_implementation=self.attn_implementation
            )

    def load_weights(self) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        # device_map puts each tensor on the device as it is read: no full host copy first.
        # Read on this thread: a backend's pool (torch.cuda.use_mem_pool) routes only the
        # calling thread's allocations, and transformers 5 reads on a thread pool by default,
        # which left a Qwen2 1.5B's weights outside `weights` (2 MiB of 2.9 GiB in the pool,
        # resident through every sleep; H100, cumem and fast).
        placement: dict[str, Any] = {"device_map": str(self.device)}
        if self.world > 1:
            from torch.distributed.device_mesh import init_device_mesh

            placement = {"device_mesh": init_device_mesh(self.device.type, (self.world,)), **_auto_tp_plan()}
        if self.dummy_weights:
            model = self._dummy_model()
        else:
            with _sequential_loading():
                model = AutoModelForCausalLM.from_pretrained(
                    str(self.model_dir),
                    local_files_only=True,
                    dtype=self.dtype,
                    attn_implementation=self.attn_implementation,
                    **placement,
                )
        if self.world > 1:
            check_placements(model)
        model.eval()
        model.requires_grad_(False)
        copied = own_storage([model])
        if copied:
            log.info("copied %d memory-mapped tensors into the weights pool", copied)
        weights = WeightSet({"": model})
        if self.dummy_weights:
            weights.bind_own_dtypes()  # no checkpoint: a reload or an update brings the model's dtypes
        else:
            weights.bind_source(self.model_dir)
        self.model, self.weights = model, weights

    def fit_caches(self, available_bytes: int) -> None:
        if self.seq_len_auto:
            self.max_seq_len = min(self.max_positions, available_bytes // self.kv_bytes_per_token)

    @property
    def kv_bytes_per_token(self) -> int:
        layers = self.config.num_hidden_layers
        return 2 * layers * self.local_kv_heads * self.head_dim * self.dtype.itemsize * self.max_batch

    def allocate_caches(self) -> None:
        from transformers import StaticCache

        if self.max_seq_len < 2:
            raise ValueError(
                "max_seq_len='auto' sizes the KV cache from the stage's gpu_memory_fraction, but "
                "none was set or too little was left; set StageSpec.gpu_memory_fraction or give "
                "max_seq_len"
            )
        cache = StaticCache(config=self.config, max_cache_len=self.max_seq_len)
        cache.early_initialization(
            batch_size=self.max_batch,
            num_heads=self.local_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self.cache = cache

    def tensors(self, tag: str) -> list[torch.Tensor]:
        adapters = self.lora.tensors() if self.lora is not None else []
        if tag == ADAPTERS_TAG:
            return adapters
        if tag == WEIGHTS_TAG:
            if self.model is None:
                return []
            if self.adapter_tag == WEIGHTS_TAG:
                return module_tensors([self.model])
            held = {id(t) for t in adapters}
            return [t for t in module_tensors([self.model]) if id(t) not in held]
        if tag == KV_CACHE_TAG:
            if self.cache is None:
                return []
            return [
                value
                for layer in self.cache.layers
                for value in vars(layer).values()
                if isinstance(value, torch.Tensor)
            ]
        raise ValueError(f"TransformersRunner has no tag {tag!r}; it has {[WEIGHTS_TAG, KV_CACHE_TAG, ADAPTERS_TAG]}")

    # ------------------------------------------------------------------ LoRA adapters (P-20)

    def _adapters(self) -> PeftAdapters:
        if self.model is None:
            raise RuntimeError("an adapter before load_weights")
        if self.world > 1:
            raise RunnerArgumentError("LoRA adapters on a tensor-parallel transformers stage are not supported")
        if self.lora is None:
            self.lora = PeftAdapters(self.model)
        return self.lora

    def check_adapter(self, command: AddAdapter) -> None:
        self._adapters().check(command)

    def add_adapter(self, command: AddAdapter) -> None:
        self._adapters().add(command)

    def adapter_specs(self, command: AddAdapter) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return self._adapters().specs(command)

    def write_adapter(self, command: AddAdapter, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        self._adapters().write(command, tensors)

    def remove_adapter(self, name: str) -> None:
        if self.lora is not None:
            self.lora.remove(name)

    def execute_adapter(self, payload: Any, adapter: str) -> dict[str, Any]:
        return self.execute(payload, adapter)

    def buffers_to_save(self) -> dict[str, torch.Tensor]:
        return non_persistent_buffers({"": self.model}) if self.model is not None else {}

    def reload_weights(self, source: str | None) -> None:
        if self.weights is None:
            raise RuntimeError("reload_weights before load_weights")
        if source is not None and not isinstance(source, str):
            raise RunnerArgumentError(f"the reload source must be a checkpoint directory path, got {source!r}")
        if source is None and self.dummy_weights:
            raise RunnerArgumentError(
                f"Model reloading with dummy format: {str(self.model_dir)!r} was loaded with load_format "
                "'dummy' (no checkpoint was read), so there are no own weights to reload; reload from a "
                "checkpoint directory (source) or update the weights (UpdateWeights)"
            )
        self.last_reload = self.weights.load(Path(source).expanduser() if source else self.model_dir)

    @property
    def supports_save_weights(self) -> bool:
        # A tensor-parallel rank holds shards that its reload (which cuts a full checkpoint)
        # cannot read back: such a stage declares no `save_weights` (SaveWeights: UNSUPPORTED).
        return self.world == 1

    def save_weights(self, directory: Path, max_file_bytes: int) -> list[str]:
        """The weights as `model.safetensors` (or parts with an index) beside the model's own
        config, generation config and tokenizer files: a checkpoint this runner loads as its
        `model` and reloads from, bit for bit."""
        if self.weights is None:
            raise RuntimeError("save_weights before load_weights")
        if self.world > 1:
            raise RunnerArgumentError("a tensor-parallel rank holds shards; save from a stage of one rank")
        files = self.weights.save(directory, max_file_bytes)
        for path in sorted(self.model_dir.iterdir()):
            if path.is_file() and (path.name in CHECKPOINT_FILES or path.name.startswith("tokenizer")):
                shutil.copyfile(path, directory / path.name)
                files.append(path.name)
        return files

    def weights_origin(self) -> str | None:
        return None if self.dummy_weights else str(self.model_dir)

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        if self.weights is None:
            raise RuntimeError("weight_specs before load_weights")
        return self.weights.specs()

    # Reloads and updates write in place through the modules' own tensors (WeightSet), each
    # cast and cut on the host: into the backend's host copy as well as into the device.
    supports_host_refit = True

    def update_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """A trainer's state_dict tensors (full, in the model's dtype); a tensor-parallel rank
        keeps its shard of each, cut as the plan cuts it (`rank_shard`)."""
        if self.weights is None:
            raise RuntimeError("update_weights before load_weights")
        self.weights.write(named)

    def weights_to_share(self) -> dict[str, torch.Tensor]:
        if self.weights is None:
            raise RuntimeError("weights_to_share before load_weights")
        if self.world > 1:
            raise RunnerArgumentError(
                "a tensor-parallel stage holds shards, not whole weights: share from a stage of one rank"
            )
        return self.weights.named()

    def reset_prefix_cache(self) -> int:
        """Nothing to drop, truly: the StaticCache is scratch that every request resets, so no
        entry outlives its request."""
        return 0

    def close(self) -> None:
        self.model = self.cache = self.weights = None
        if self.world > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    # ------------------------------------------------------------------ execution

    def execute(self, payload: Any, adapter: str | None = None) -> dict[str, Any]:
        """Generate tokens for one prompt or a batch of up to `max_batch`.

        payload: {"prompt_ids": [int, ...] | [[int, ...], ...]} or {"prompt": str | [str, ...]}
        (text needs a tokenizer in the model directory), "max_new_tokens" (default 16),
        "sampling": "greedy" (default) | {"temperature": float, "seed": int, "top_k": int},
        "stop_at_eos" (default true). Returns "token_ids" (new tokens only), "text" when
        there is a tokenizer, "finish_reason" ("stop" | "length") and "prompt_tokens", each a
        list per prompt when the payload gave a list. With "export": [name, ...] (P-22) nothing
        is generated: the result is those connector tensors of the one prompt (`export_result`),
        what a TransferOut would move, for a caller that chains the stages itself.
        """
        if wants_export(payload):
            if adapter is not None:
                raise RunnerArgumentError("an export runs on the base weights; send it without an adapter")
            return export_result(self, payload)
        request = self._parse(payload)
        self._check_ready()
        with torch.no_grad(), self.lora.using(adapter) if self.lora is not None else nullcontext():
            return self._shape(request, self._generate([request]))

    def execute_batch(self, payloads: Sequence[Any]) -> list[Any]:
        """Several requests in one forward pass per token: the greedy ones packed together,
        up to `max_batch` prompts whose longest prompt and largest `max_new_tokens` fit the
        cache, each row with its own length (left padding and a mask) and its own limit, so
        each result equals the request run alone. A sampled request runs on its own: its seed
        draws for its rows only. A payload that does not parse is that request's error."""
        if any(wants_export(p) for p in payloads):  # an export generates nothing: each runs alone
            return parse_each(payloads, self.execute)
        parsed = parse_each(payloads, self._parse)
        self._check_ready()
        outputs: list[Any] = list(parsed)
        # The base weights alone: an adapter request before left its adapter set (P-20).
        with torch.no_grad(), self.lora.using(None) if self.lora is not None else nullcontext():
            for group in self._groups(parsed):
                rows = self._generate([parsed[i] for i in group])  # type: ignore[misc]
                for i in group:
                    request = parsed[i]
                    assert isinstance(request, GenerationRequest)
                    outputs[i] = self._shape(request, rows[: len(request.rows)])
                    rows = rows[len(request.rows) :]
        return outputs

    def _groups(self, parsed: Sequence[GenerationRequest | Exception]) -> list[list[int]]:
        """Indices of the requests that run together, in order."""
        groups: list[list[int]] = []
        packed: list[int] = []
        rows = longest = most_new = 0
        for i, request in enumerate(parsed):
            if not isinstance(request, GenerationRequest):
                continue
            if request.sampling.temperature is not None:
                groups.append([i])
                continue
            prompt = max(len(r) for r in request.rows)
            fits = rows + len(request.rows) <= self.max_batch
            fits = fits and max(longest, prompt) + max(most_new, request.max_new_tokens) <= self.max_seq_len
            if packed and not fits:
                groups.append(packed)
                packed, rows, longest, most_new = [], 0, 0, 0
            packed.append(i)
            rows, longest = rows + len(request.rows), max(longest, prompt)
            most_new = max(most_new, request.max_new_tokens)
        if packed:
            groups.append(packed)
        return groups

    # ------------------------------------------------------------------ the connector (P-22)

    def transfer_exports(self) -> dict[str, ConnectorSpec]:
        """A prompt's token embeddings and last hidden states (after the final norm), one row
        of any length: what a thinker hands a talker, a text encoder a diffusion decoder."""
        hidden = int(self.config.hidden_size)
        spec = ConnectorSpec(self.dtype, (1, None, hidden))
        return {"prompt_embeds": spec, "hidden_states": spec}

    def export_tensors(self, payload: Any, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """`names` for the one prompt of `payload` ({"prompt": str} or {"prompt_ids": [...]}, as
        `execute` takes it), computed on the weights held now; nothing is generated."""
        self._check_ready()
        request = self._parse(payload)
        if request.batched or len(request.rows) != 1:
            raise RunnerArgumentError("an export takes one prompt, not a list; send one TransferOut per prompt")
        ids = torch.tensor([request.rows[0]], dtype=torch.long, device=self.device)
        out: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            if "prompt_embeds" in names:
                out["prompt_embeds"] = self.model.get_input_embeddings()(ids).detach().clone()
            if "hidden_states" in names:
                base = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model
                out["hidden_states"] = base(input_ids=ids, use_cache=False).last_hidden_state.detach().clone()
        return out

    def _check_ready(self) -> None:
        if self.model is None or self.cache is None:
            raise RuntimeError("TransformersRunner.execute before load_weights/allocate_caches")
        check_resident({WEIGHTS_TAG: self.tensors(WEIGHTS_TAG), KV_CACHE_TAG: self.tensors(KV_CACHE_TAG)})

    def _shape(self, request: GenerationRequest, rows: list[tuple[list[int], str]]) -> dict[str, Any]:
        tokens = [t for t, _ in rows]
        out: dict[str, Any] = {
            "token_ids": tokens,
            "finish_reason": [reason for _, reason in rows],
            "prompt_tokens": [len(r) for r in request.rows],
        }
        if self.tokenizer is not None:
            out["text"] = [self.tokenizer.decode(t) for t in tokens]
        if not request.batched:
            out = {key: value[0] for key, value in out.items()}
        return out

    def _parse(self, payload: Any) -> GenerationRequest:
        return parse_generation(
            payload,
            tokenizer=self.tokenizer,
            vocab_size=int(self.config.vocab_size),
            max_batch=self.max_batch,
            max_seq_len=self.max_seq_len,
            model_dir=self.model_dir,
        )

    def _generate(self, requests: list[GenerationRequest]) -> list[tuple[list[int], str]]:
        """(new tokens, finish reason) per row of every request, in order. The requests share
        one sampling (greedy, or one request's seed): `_groups` sees to it."""
        rows = [row for r in requests for row in r.rows]
        limits = [r.max_new_tokens for r in requests for _ in r.rows]
        stops = [r.stop_at_eos for r in requests for _ in r.rows]
        sampling, device = requests[0].sampling, self.device
        pad = int(self.config.pad_token_id if self.config.pad_token_id is not None else 0)
        eos = self.config.eos_token_id
        eos_ids = torch.tensor(eos if isinstance(eos, list) else [] if eos is None else [eos], device=device)
        # The static cache has exactly max_batch rows: fill the spare ones with copies of the
        # last prompt (rows are independent, so the fillers change no real row's result).
        spare = self.max_batch - len(rows)
        filled = rows + [rows[-1]] * spare
        length = max(len(r) for r in filled)
        ids = torch.full((self.max_batch, length), pad, dtype=torch.long)
        mask = torch.zeros((self.max_batch, length), dtype=torch.long)
        for i, row in enumerate(filled):  # left padding: every row's last token is at the end
            ids[i, length - len(row) :] = torch.tensor(row)
            mask[i, length - len(row) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        generator = None
        if sampling.temperature is not None:
            generator = torch.Generator(device=device).manual_seed(sampling.seed)
        self.cache.reset()  # a discarded cache comes back as zeros or garbage; start clean
        limit = torch.tensor(limits + [1] * spare, device=device)  # a filler stops at once
        stop = torch.tensor(stops + [False] * spare, device=device) & bool(eos_ids.numel())
        finished = torch.zeros(self.max_batch, dtype=torch.bool, device=device)
        produced: list[torch.Tensor] = []
        out = self._forward(ids, mask, positions)
        for step in range(max(limits)):
            token = self._choose(out.logits[:, -1].float(), sampling, generator)
            token = torch.where(finished | (step >= limit), torch.full_like(token, pad), token)
            produced.append(token)
            finished |= stop & (step < limit) & torch.isin(token, eos_ids)
            if bool((finished | (step + 1 >= limit)).all()):
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = positions[:, -1:] + 1
            out = self._forward(token[:, None], mask, positions)
        table = torch.stack(produced, dim=1).tolist()
        done, eos_set = finished.tolist(), set(eos_ids.tolist())
        result = []
        for i in range(len(rows)):
            row = table[i][: limits[i]]
            if done[i]:
                row = row[: next(j for j, t in enumerate(row) if t in eos_set) + 1]
            result.append((row, "stop" if done[i] else "length"))
        return result

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> Any:
        return self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{cache_keyword(self.model.forward): self.cache},
        )

    @staticmethod
    def _choose(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
        if sampling.temperature is None:
            return logits.argmax(dim=-1)
        scaled = logits / sampling.temperature
        if sampling.top_k is not None and sampling.top_k < scaled.shape[-1]:
            kth = torch.topk(scaled, sampling.top_k, dim=-1).values[:, -1:]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)
