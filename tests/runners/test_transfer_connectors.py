"""P-22 with real models: the transformers and diffusers runners' connectors, and a text stage
conditioning a Stable Diffusion stage through a transfer between rank processes, the image
byte for byte the one made with the same conditioning passed by hand."""

from __future__ import annotations

import pytest
import torch

from omni_core import Engine, StageSpec
from omni_core.engine import PipelineStage
from omni_core.runners.base import RunnerArgumentError
from omni_core.runners.connector import ConnectorError, ConnectorSpec, tensors_from_wire
from omni_core.runners.diffusers_runner import DiffusersRunner
from omni_core.runners.diffusion_trajectory import from_wire, wire_tensor
from omni_core.runners.transformers_runner import TransformersRunner
from tests.runners.conftest import CPU, Pools

PROMPT = {"prompt": "a cat on a mat", "negative_prompt": "blurry"}
IMAGE = {"seed": 1, "steps": 4}
EXPORT = ("prompt_embeds", "negative_prompt_embeds")


def sd_runner(checkpoints) -> DiffusersRunner:  # type: ignore[no-untyped-def]
    return Pools(DiffusersRunner(CPU, model=str(checkpoints["sd"])), ("weights", "kv_cache")).runner  # type: ignore[return-value]


def test_the_text_runner_exports_embeddings_and_hidden_states_of_its_declared_shape(checkpoints) -> None:
    runner = Pools(TransformersRunner(CPU, model=str(checkpoints["qwen2"]))).runner
    specs = runner.transfer_exports()
    out = runner.export_tensors({"prompt_ids": [1, 2, 3]}, ("prompt_embeds", "hidden_states"))
    for name, tensor in out.items():
        assert specs[name].problem(name, tensor.dtype, tuple(tensor.shape)) is None
        assert tensor.shape == (1, 3, 64)
    assert not torch.equal(out["prompt_embeds"], out["hidden_states"])
    with pytest.raises(RunnerArgumentError, match="one prompt, not a list"):
        runner.export_tensors({"prompt_ids": [[1, 2]]}, ("hidden_states",))


def test_sd_conditioning_landed_by_hand_makes_the_image_its_prompt_makes(checkpoints) -> None:
    producer, consumer = sd_runner(checkpoints), sd_runner(checkpoints)
    landed = producer.export_tensors(PROMPT, EXPORT)
    consumer.inbox.put("r1", dict(landed), 0)
    via_transfer = consumer.execute({**IMAGE, "transfer": "r1"})
    assert via_transfer["sha256"] == consumer.execute({**IMAGE, **PROMPT})["sha256"]
    with pytest.raises(ConnectorError, match="no transfer landed on this rank for request 'r1'"):
        consumer.execute({**IMAGE, "transfer": "r1"})  # taken once
    consumer.inbox.put("r2", {"prompt_embeds": landed["prompt_embeds"]}, 0)
    with pytest.raises(ValueError, match="'negative_prompt_embeds' too when guidance_scale > 1"):
        consumer.execute({**IMAGE, "transfer": "r2"})
    consumer.inbox.put("r3", {"prompt_embeds": torch.zeros(1, 77, 64)}, 0)
    with pytest.raises(ConnectorError, match=r"float32 \[1, 77, 64\]; the connector takes float32 \[1, '\*', 32\]"):
        consumer.execute({**IMAGE, "guidance_scale": 1.0, "transfer": "r3"})


@pytest.mark.timeout(900)
def test_a_text_stage_conditions_a_diffusion_stage_through_a_transfer(checkpoints) -> None:
    """Both stages asleep around it: the consumer's policy wakes it for the transfer; the image
    equals the one the consumer makes from the prompt itself (the same text encoder weights)."""
    common = {"runner": "diffusers", "backend": "portable", "deadline_s": 120.0, "start_deadline_s": 300.0}
    args = {"model": str(checkpoints["sd"]), "cpu_threads": 1}
    engine = Engine(
        [
            StageSpec("text", runner_args=args, **common),  # type: ignore[arg-type]
            StageSpec("image", runner_args=args, admission="wake", request_timeout_s=300.0, **common),  # type: ignore[arg-type]
        ]
    )
    try:
        by_hand = engine.execute("image", {**IMAGE, **PROMPT})["sha256"]
        engine.sleep("image", 1)
        result = engine.pipeline(
            [PipelineStage("text", PROMPT, export=EXPORT), PipelineStage("image", IMAGE)], timeout_s=300.0
        )
        assert result.output["sha256"] == by_hand and result.producer_versions == (0,)
        engine.sleep("text", 1)  # released: the producer sleeps, and wakes to serve again
        engine.sleep("image", 1)
        engine.wake("text")
        again = engine.pipeline([PipelineStage("text", PROMPT, export=EXPORT), PipelineStage("image", IMAGE)])
        assert again.output["sha256"] == by_hand
    finally:
        engine.shutdown()


# ---------------------------------------------------------------- chained by the caller


def test_the_text_runner_answers_an_export_with_the_tensors_a_transfer_would_move(checkpoints) -> None:
    runner = Pools(TransformersRunner(CPU, model=str(checkpoints["qwen2"]))).runner
    payload = {"prompt_ids": [1, 2, 3]}
    result = runner.execute({**payload, "export": ["prompt_embeds", "hidden_states"]})
    direct = runner.export_tensors(payload, ("prompt_embeds", "hidden_states"))
    assert set(result) == set(direct)
    for name, tensor in direct.items():
        assert torch.equal(from_wire(result[name]), tensor)
    # In a batch an export runs alone, beside generations that still run.
    batch = runner.execute_batch([{**payload, "export": ["hidden_states"]}, {**payload, "max_new_tokens": 2}])
    assert torch.equal(from_wire(batch[0]["hidden_states"]), direct["hidden_states"])
    assert len(batch[1]["token_ids"]) == 2
    for names in (["logits"], [], ["hidden_states", "hidden_states"], "hidden_states"):
        with pytest.raises(ConnectorError, match="'export' lists distinct names among"):
            runner.execute({**payload, "export": names})
    with pytest.raises(RunnerArgumentError, match="without an adapter"):
        runner.execute({**payload, "export": ["prompt_embeds"]}, "some-adapter")


def test_sd_conditioning_passed_by_the_caller_makes_the_image_its_prompt_makes(checkpoints) -> None:
    producer, consumer = sd_runner(checkpoints), sd_runner(checkpoints)
    sent = {name: wire_tensor(t) for name, t in producer.export_tensors(PROMPT, EXPORT).items()}
    by_hand = consumer.execute({**IMAGE, "conditioning": sent})
    assert by_hand["sha256"] == consumer.execute({**IMAGE, **PROMPT})["sha256"]
    with pytest.raises(ValueError, match=r"'conditioning', not also \['prompt'\]"):
        consumer.execute({**IMAGE, "conditioning": sent, "prompt": "a cat"})
    with pytest.raises(ValueError, match=r"'transfer', not also \['conditioning'\]"):
        consumer.execute({**IMAGE, "conditioning": sent, "transfer": "r9"})
    with pytest.raises(ValueError, match="'negative_prompt_embeds' too when guidance_scale > 1"):
        consumer.execute({**IMAGE, "conditioning": {"prompt_embeds": sent["prompt_embeds"]}})


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda w: {"logits": w}, r"'logits' is not among its connector's names"),
        (lambda w: {"prompt_embeds": {**w, "extra": 1}}, "exactly 'dtype', 'shape' and 'data'"),
        (lambda w: {"prompt_embeds": {**w, "dtype": "float64"}}, r"is float64 \[1, 4, 32\]; the connector takes"),
        (lambda w: {"prompt_embeds": {**w, "shape": [1, 4, 16]}}, r"\[1, 4, 16\]; the connector takes float32"),
        (lambda w: {"prompt_embeds": {**w, "shape": [1, -4, 32]}}, "a list of sizes >= 0"),
        (lambda w: {"prompt_embeds": {**w, "shape": "1x4x32"}}, "a list of sizes >= 0"),
        (lambda w: {"prompt_embeds": {**w, "data": w["data"][:-1]}}, "carries 512 bytes, not 511"),
        (lambda w: {"prompt_embeds": {**w, "data": "text"}}, "carries 512 bytes"),
        (lambda w: [w], "a dict of name ->"),
        (lambda w: {}, "a dict of name ->"),
    ],
)
def test_conditioning_from_the_caller_is_checked_before_its_bytes_are_read(change, needle) -> None:
    specs = {"prompt_embeds": ConnectorSpec(torch.float32, (1, None, 32))}
    wire = wire_tensor(torch.ones(1, 4, 32))
    with pytest.raises(ConnectorError, match=needle):
        tensors_from_wire("the conditioning", specs, change(wire), 1 << 20)
    assert torch.equal(
        tensors_from_wire("c", specs, {"prompt_embeds": wire}, 512)["prompt_embeds"], torch.ones(1, 4, 32)
    )
    with pytest.raises(ConnectorError, match="over 511 bytes in all"):
        tensors_from_wire("c", specs, {"prompt_embeds": wire}, 511)
