"""A tensor-parallel synthetic runner: the stage's ranks shard every layer and all-reduce.

Megatron-style MLP blocks: `w_in` is split by output rows (column parallel), `w_out` by
input columns (row parallel), so each block costs one all-reduce of the activations:

    h_r = tanh(x @ w_in_r.T)          # [batch, hidden / world]  (rank r's shard)
    x   = x + all_reduce(h_r @ w_out_r.T)

The orchestrator sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for every rank of a
stage (as torchrun does); this runner joins that process group (NCCL on CUDA, gloo on
CPU), so sleep and wake are exercised with a live communicator between the ranks. Every
rank returns the same, deterministic output; `reference_output` recomputes it in one
process from the same seeds, which proves the shards and the all-reduce are real.
"""

from __future__ import annotations

import datetime
import hashlib
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from omni_core.fsm.tags import KV_CACHE_TAG, WEIGHTS_TAG
from omni_core.runners.base import ModelRunner
from omni_core.runners.synthetic import MAX_BATCH, tensor_bytes, torch_dtype


def _shard_seed(seed: int, layer: int, which: int, rank: int) -> int:
    return (seed * 1_000_003 + layer * 101 + which * 11 + rank) % (1 << 63)


def make_shard(
    seed: int, layer: int, which: int, rank: int, rows: int, cols: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The shard (layer, which: 0 = w_in, 1 = w_out) of `rank`, on `device`."""
    gen = torch.Generator(device="cpu").manual_seed(_shard_seed(seed, layer, which, rank))
    std = 1.0 / (rows * cols) ** 0.25
    return (torch.randn(rows, cols, generator=gen) * std).to(device=device, dtype=dtype)


def make_input(seed: int, batch: int, hidden: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(seed * 7 + 1)
    return torch.randn(batch, hidden, generator=gen).to(device=device, dtype=dtype)


def stage_rank_and_world(who: str) -> tuple[int, int]:
    """This rank's RANK and the stage's WORLD_SIZE, as the engine (or torchrun) sets them."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"{who} needs {missing} in the environment; the omni-core engine sets them for "
            "every rank of a stage (or run under torchrun)"
        )
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def join_process_group(device: torch.device, init_timeout_s: float) -> None:
    """Join the stage's process group (NCCL on CUDA, gloo on CPU) at MASTER_ADDR:MASTER_PORT."""
    rank, world = stage_rank_and_world("joining the stage's process group")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=init_timeout_s),
    )


class TensorParallelRunner(ModelRunner):
    def __init__(
        self,
        device: torch.device,
        *,
        hidden: int = 256,
        layers: int = 4,
        dtype: str = "float32",
        seed: int = 0,
        kv_rows: int = 64,
        init_timeout_s: float = 120.0,
        cpu_threads: int | None = None,
    ) -> None:
        super().__init__(device)
        self.rank, self.world = stage_rank_and_world("TensorParallelRunner")
        if hidden % self.world:
            raise ValueError(f"hidden={hidden} must be divisible by the stage's {self.world} ranks")
        if cpu_threads is not None and self.device.type == "cpu":
            torch.set_num_threads(cpu_threads)
        self.hidden, self.layers, self.seed, self.kv_rows = hidden, layers, seed, kv_rows
        self.dtype = torch_dtype(dtype)
        join_process_group(self.device, init_timeout_s)
        self.w_in: list[torch.Tensor] = []
        self.w_out: list[torch.Tensor] = []
        self.kv: torch.Tensor | None = None

    def load_weights(self) -> None:
        shard = self.hidden // self.world
        self.w_in = [torch.empty(shard, self.hidden, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        self.w_out = [torch.empty(self.hidden, shard, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        self.reload_weights(None)

    def allocate_caches(self) -> None:
        self.kv = torch.zeros(self.kv_rows, self.hidden, dtype=self.dtype, device=self.device)

    def tensors(self, tag: str) -> list[torch.Tensor]:
        if tag == WEIGHTS_TAG:
            return [*self.w_in, *self.w_out]
        if tag == KV_CACHE_TAG:
            return [self.kv] if self.kv is not None else []
        raise ValueError(f"TensorParallelRunner has no tag {tag!r}")

    def buffers_to_save(self) -> Mapping[str, torch.Tensor]:
        return {}

    def reload_weights(self, source: str | None) -> None:
        seed = self.seed if source is None else int(source.removeprefix("seed:"))
        shard = self.hidden // self.world
        with torch.no_grad():
            for layer in range(self.layers):
                self.w_in[layer].copy_(
                    make_shard(seed, layer, 0, self.rank, shard, self.hidden, self.dtype, self.device)
                )
                self.w_out[layer].copy_(
                    make_shard(seed, layer, 1, self.rank, self.hidden, shard, self.dtype, self.device)
                )

    def execute(self, payload: Any) -> dict[str, Any]:
        if not isinstance(payload, dict):
            raise TypeError(f"payload must be a dict like {{'seed': 1, 'batch': 2}}, got {payload!r}")
        batch = int(payload.get("batch", 1))
        if not 1 <= batch <= min(MAX_BATCH, self.kv_rows):
            raise ValueError(f"batch must be in 1..{min(MAX_BATCH, self.kv_rows)}, got {batch}")
        assert self.kv is not None
        x = make_input(int(payload.get("seed", 0)), batch, self.hidden, self.dtype, self.device)
        with torch.no_grad():
            for layer in range(self.layers):
                partial = torch.tanh(x @ self.w_in[layer].T) @ self.w_out[layer].T
                dist.all_reduce(partial)
                cache = self.kv[:batch]
                cache.copy_(partial)  # the KV pool must be mapped to run
                x = x + cache
        data = tensor_bytes(x)
        return {
            "shape": list(x.shape),
            "dtype": str(x.dtype).removeprefix("torch."),
            "sha256": hashlib.sha256(data).hexdigest(),
            "data": data,
            "rank": self.rank,
            "world": self.world,
        }

    def close(self) -> None:
        self.w_in, self.w_out, self.kv = [], [], None
        if dist.is_initialized():
            dist.destroy_process_group()


def reference_output(
    payload: Mapping[str, Any], *, world: int, hidden: int = 256, layers: int = 4, seed: int = 0, dtype: str = "float32"
) -> torch.Tensor:
    """The same model computed in one process on CPU, summing the shards' partials in rank
    order: what the stage must return."""
    elem_type = torch_dtype(dtype)
    cpu = torch.device("cpu")
    shard = hidden // world
    x = make_input(int(payload.get("seed", 0)), int(payload.get("batch", 1)), hidden, elem_type, cpu)
    for layer in range(layers):
        total = None
        for rank in range(world):
            w_in = make_shard(seed, layer, 0, rank, shard, hidden, elem_type, cpu)
            w_out = make_shard(seed, layer, 1, rank, hidden, shard, elem_type, cpu)
            part = torch.tanh(x @ w_in.T) @ w_out.T
            total = part if total is None else total + part
        if total is None:
            raise ValueError(f"a reference over {world} ranks: world must be at least 1")
        x = x + total
    return x
