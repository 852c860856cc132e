"""Sequence-parallel DiT denoising (vLLM-Omni's Ulysses and ring attention) and batches that a
stage's ranks agree on before they step them together.

Sequence-parallel (`parallel="ulysses"` or `"ring"`): after the patch embedding, every rank
keeps one contiguous part of each image's tokens and runs every transformer block over that
part only (the norms, the MLP and the projections are per token); only the attention needs
the whole sequence:

- Ulysses (DeepSpeed-Ulysses): one all-to-all turns each rank's query, key and value for its
  tokens and every head into every token for its heads (heads / world of them), the attention
  runs whole per head, and a second all-to-all brings the output back to the rank's tokens;
- ring: each rank keeps its queries and passes its keys and values around the ring, one
  neighbour exchange per rank (send and receive); the attention over each arriving part is
  merged into the running output by its log-sum-exp (the online softmax), so no rank ever
  holds more than two parts of the keys and values.

After the blocks one all-gather joins the tokens for the output head. Every rank holds the
whole model (the sequence is what is split), sleeps, wakes and reloads it as a single rank
does, and makes the same scheduler steps on the same latents, so the stage's result is rank
0's. The image is one process's within the tolerance of a softmax summed in another order
(the tests state it).

Agreed batches (`run_agreed`): the ranks of a parallel stage each batch what waits on their
own socket, so rank 0 may hold [a, b] while rank 1 holds [a] and gets b next. Before each
group, the ranks all-gather the fingerprints of what they hold; the group is the longest
prefix every rank holds (the engine sends every request to every rank in the same order), so
each request's collectives meet the same request's on every other rank. A rank whose batch
ends first finds the rest in its next batch, whose first group agrees the same way.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

SEQUENCE_MODES = ("ulysses", "ring")
MAX_AGREED = 64  # payloads agreed per collective: a larger batch takes several groups


def check_sequence_split(transformer: Any, world: int, mode: str) -> None:
    """Refuse a split that leaves a rank a part of a token or of a head."""
    tokens = (int(transformer.config.sample_size) // int(transformer.config.patch_size)) ** 2
    heads = int(transformer.config.num_attention_heads)
    if tokens % world:
        raise ValueError(
            f"parallel={mode!r} over {world} ranks splits the DiT's {tokens} tokens: use a number of ranks that "
            "divides them"
        )
    if mode == "ulysses" and heads % world:
        raise ValueError(
            f"parallel='ulysses' over {world} ranks gives each rank heads / ranks of the DiT's {heads} attention "
            "heads: use a number of ranks that divides them, or parallel='ring'"
        )


def _all_to_all(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Part j of this rank to rank j; what each rank sent here, in rank order."""
    received = [torch.empty_like(parts[0]) for _ in parts]
    dist.all_to_all(received, [part.contiguous() for part in parts])
    return received


def _projections(attn: Any, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Query, key and value of this rank's tokens, [batch, tokens, heads, head_dim]."""
    batch, tokens, _ = hidden_states.shape
    out = []
    for projection in (attn.to_q, attn.to_k, attn.to_v):
        value = projection(hidden_states)
        out.append(value.view(batch, tokens, attn.heads, value.shape[-1] // attn.heads))
    return tuple(out)


def _finish(attn: Any, out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """AttnProcessor2_0's tail: the output projection, dropout, residual and rescale."""
    out = attn.to_out[1](attn.to_out[0](out))
    if attn.residual_connection:
        out = out + residual
    return out / attn.rescale_output_factor


def _check_self_attention(attn: Any, encoder_hidden_states: Any, attention_mask: Any) -> None:
    if encoder_hidden_states is not None or attention_mask is not None or attn.norm_q is not None:
        raise NotImplementedError(
            "sequence-parallel attention covers a DiT's unmasked self-attention only (no cross-attention, "
            "mask or query norm); run this model with parallel='cfg' or 'tensor'"
        )


class UlyssesAttention:
    """An attention processor for a DiT's `attn1`: the heads redistributed by all-to-all."""

    def __call__(
        self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: Any = None, attention_mask: Any = None
    ) -> torch.Tensor:
        _check_self_attention(attn, encoder_hidden_states, attention_mask)
        world = dist.get_world_size()
        batch, tokens, _ = hidden_states.shape
        # [batch, local tokens, heads, d] -> [batch, all tokens, local heads, d]
        whole = [torch.cat(_all_to_all(list(x.chunk(world, dim=2))), dim=1) for x in _projections(attn, hidden_states)]
        query, key, value = (x.transpose(1, 2) for x in whole)
        out = F.scaled_dot_product_attention(query, key, value, dropout_p=0.0, is_causal=False).transpose(1, 2)
        out = torch.cat(_all_to_all(list(out.chunk(world, dim=1))), dim=2)  # back: local tokens, every head
        return _finish(attn, out.reshape(batch, tokens, -1).to(query.dtype), hidden_states)


def _attention_with_lse(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """softmax(q k^T / sqrt(d)) v and the rows' log-sum-exp, [batch, heads, tokens, ...]."""
    scores = (query @ key.transpose(-1, -2)) * query.shape[-1] ** -0.5
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.exp(scores - lse) @ value, lse


def _exchange(key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Send this part of the keys and values to the next rank, take the previous rank's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sent = torch.stack([key, value]).contiguous()
    received = torch.empty_like(sent)
    requests = dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, sent, (rank + 1) % world), dist.P2POp(dist.irecv, received, (rank - 1) % world)]
    )
    for request in requests:
        request.wait()
    return received[0], received[1]


class RingAttention:
    """An attention processor for a DiT's `attn1`: the keys and values passed round the ring."""

    def __call__(
        self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: Any = None, attention_mask: Any = None
    ) -> torch.Tensor:
        _check_self_attention(attn, encoder_hidden_states, attention_mask)
        batch, tokens, _ = hidden_states.shape
        query, key, value = (x.transpose(1, 2) for x in _projections(attn, hidden_states))
        out, lse = _attention_with_lse(query, key, value)
        for _ in range(dist.get_world_size() - 1):
            key, value = _exchange(key, value)
            part, part_lse = _attention_with_lse(query, key, value)
            merged = torch.logaddexp(lse, part_lse)
            out = out * torch.exp(lse - merged) + part * torch.exp(part_lse - merged)
            lse = merged
        out = out.transpose(1, 2).reshape(batch, tokens, -1).to(query.dtype)
        return _finish(attn, out, hidden_states)


class _Output:
    """What the pipelines read of a denoiser's output."""

    def __init__(self, sample: torch.Tensor) -> None:
        self.sample = sample


class SequenceParallelDiT:
    """A DiT called as the pipelines call it, its blocks over this rank's part of the tokens."""

    def __init__(self, transformer: Any) -> None:
        self.transformer = transformer

    def __call__(self, hidden_states: torch.Tensor, timestep: torch.Tensor, class_labels: torch.Tensor) -> _Output:
        from omni_core.runners.step_cache import dit_output

        transformer = self.transformer
        rank, world = dist.get_rank(), dist.get_world_size()
        hidden_states = transformer.pos_embed(hidden_states)
        local = hidden_states.chunk(world, dim=1)[rank].contiguous()
        for block in transformer.transformer_blocks:
            local = block(local, timestep=timestep, class_labels=class_labels)
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local)
        return _Output(dit_output(transformer, torch.cat(parts, dim=1), timestep, class_labels))


def attach_sequence_parallel(transformer: Any, world: int, mode: str) -> None:
    """Every block's self-attention through the mode's processor, in place."""
    check_sequence_split(transformer, world, mode)
    processor = UlyssesAttention() if mode == "ulysses" else RingAttention()
    for block in transformer.transformer_blocks:
        block.attn1.set_processor(processor)


# ---------------------------------------------------------------------- agreed batches


def _group_device() -> torch.device:
    """Where the stage's collectives take their tensors: NCCL's on this rank's GPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def fingerprint(payload: Any) -> int:
    """A payload's identity as every rank computes it (the same decoded frame, the same repr)."""
    return int.from_bytes(hashlib.sha256(repr(payload).encode()).digest()[:7], "little")


def agreed_prefix(payloads: Sequence[Any]) -> int:
    """How many of `payloads`, from the first, every rank of the stage holds in this order
    (0: the ranks' first payloads differ). One all-gather; every rank gets the same figure."""
    held = [fingerprint(p) for p in payloads[:MAX_AGREED]]
    mine = torch.full((MAX_AGREED + 1,), -1, dtype=torch.int64)
    mine[0] = len(held)
    mine[1 : 1 + len(held)] = torch.tensor(held, dtype=torch.int64)
    mine = mine.to(_group_device())
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    every = [t.cpu() for t in every]
    count = min(int(t[0]) for t in every)
    same = 0
    while same < count and all(int(t[1 + same]) == int(every[0][1 + same]) for t in every):
        same += 1
    return same


def agreed_flags(flags: Sequence[bool]) -> list[bool]:
    """Each flag true on every rank (one all-reduce): which requests every rank can step."""
    values = torch.tensor([1 if flag else 0 for flag in flags], dtype=torch.int64, device=_group_device())
    dist.all_reduce(values, op=dist.ReduceOp.MIN)
    return [bool(v) for v in values.tolist()]


def run_agreed(payloads: Sequence[Any], run: Callable[[list[Any]], list[Any]]) -> list[Any]:
    """`run` over groups every rank holds alike, in order; one output per payload."""
    outputs: list[Any] = []
    position = 0
    while position < len(payloads):
        size = agreed_prefix(payloads[position:])
        if size == 0:  # the ranks diverged: this payload fails on each, nothing collective runs
            outputs.append(
                RuntimeError(
                    "the stage's ranks received different requests at this point of their batches, so they "
                    "cannot step them together; the request failed on every rank: send it again"
                )
            )
            position += 1
            continue
        outputs.extend(run(list(payloads[position : position + size])))
        position += size
    return outputs
