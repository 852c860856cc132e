"""DiffusersRunner in the pools of a portable backend: the pipelines' own results, step-wise
requests across sleeps, reloads."""

from __future__ import annotations

import hashlib
import io
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from omni_core.runners.base import RunnerArgumentError, load_runner_class
from omni_core.runners.diffusers_runner import DiffusersRunner, RequestLostError
from omni_core.runners.synthetic import tensor_bytes
from omni_core.runners.weights import own_storage

from .conftest import CPU, Pools

ALL_TAGS = ("weights", "kv_cache", "requests")
DIT = {"class_label": 3, "seed": 1, "steps": 8}
DDPM = {"seed": 1, "steps": 8}
SD = {"prompt": "a cat on a mat", "negative_prompt": "blurry", "seed": 1, "steps": 8}
DPM_SOLVER = "DPMSolverMultistepScheduler"  # multistep: keeps past model outputs between steps


def runner_in_pools(directory: Path, tags: tuple[str, ...] = ALL_TAGS, **args) -> Pools:
    return Pools(DiffusersRunner(CPU, model=str(directory), **{"max_requests": 4, **args}), tags)


@pytest.fixture(scope="module")
def dit(checkpoints) -> Pools:
    return runner_in_pools(checkpoints["dit"], scheduler=DPM_SOLVER)


def test_registered_as_builtin():
    assert load_runner_class("diffusers") is DiffusersRunner


@pytest.mark.parametrize(
    ("family", "scheduler", "request_"),
    [("dit", None, DIT), ("dit", DPM_SOLVER, DIT), ("ddpm", None, DDPM), ("sd", None, SD)],
)
def test_one_call_equals_the_stock_pipeline(family, scheduler, request_, checkpoints):
    import diffusers

    pools = runner_in_pools(checkpoints[family], scheduler=scheduler)
    out = pools.runner.execute(dict(request_))
    pipeline = diffusers.DiffusionPipeline.from_pretrained(str(checkpoints[family]), local_files_only=True)
    own_storage(
        [
            component
            for name, component in pipeline.components.items()
            if name in ("transformer", "vae", "unet", "text_encoder")
        ]
    )
    if scheduler:
        pipeline.scheduler = getattr(diffusers, scheduler).from_config(pipeline.scheduler.config)
    pipeline.set_progress_bar_config(disable=True)
    kwargs = {
        "dit": {"class_labels": [DIT["class_label"]]},
        "ddpm": {},
        "sd": {"prompt": SD["prompt"], "negative_prompt": SD["negative_prompt"]},
    }[family]
    images = pipeline(
        generator=torch.Generator().manual_seed(request_["seed"]), num_inference_steps=8, output_type="pt", **kwargs
    ).images
    assert out["sha256"] == hashlib.sha256(tensor_bytes(images)).hexdigest()
    assert out["shape"] == [1, 3, 16, 16] and out["dtype"] == "float32"
    png = Image.open(io.BytesIO(out["png"]))
    assert png.size == (16, 16) and png.mode == "RGB"
    assert png.tobytes() == pipeline.numpy_to_pil(images.permute(0, 2, 3, 1).numpy())[0].tobytes()
    assert pools.runner.execute({**request_, "seed": 2})["sha256"] != out["sha256"]


@pytest.mark.parametrize(
    ("family", "scheduler", "request_"), [("dit", DPM_SOLVER, DIT), ("ddpm", None, DDPM), ("sd", DPM_SOLVER, SD)]
)
def test_stepwise_request_survives_a_level1_sleep_bit_identical(family, scheduler, request_, checkpoints):
    pools = runner_in_pools(checkpoints[family], scheduler=scheduler)
    runner = pools.runner
    whole = {seed: runner.execute({**request_, "seed": seed})["sha256"] for seed in (1, 2)}
    first = runner.execute({"op": "start", **request_})
    second = runner.execute({"op": "start", **request_, "seed": 2})  # interleaved: state is per request
    assert runner.execute({"op": "step", "request_id": first["request_id"], "steps": 3})["steps_done"] == 3
    # Between ops the request's device state is in its slot only: what the scheduler keeps
    # (DPM-Solver's past outputs) was moved there too, so a sleep releases all of it.
    request = runner.requests[first["request_id"]]
    assert all(output is None for output in getattr(request.scheduler, "model_outputs", []))
    parked = {p.attribute for p in request.parked}
    assert parked == ({"sample", "model_outputs"} if scheduler == DPM_SOLVER else {"sample"})
    pools.sleep(1)
    assert pools.backend.usage()["requests"] == 0  # the slab itself was released
    pools.wake()
    progress = runner.execute({"op": "step", "request_id": second["request_id"], "steps": 5})
    assert progress == {"request_id": second["request_id"], "steps_done": 5, "steps_total": 8}
    assert runner.execute({"op": "finish", "request_id": first["request_id"]})["sha256"] == whole[1]
    assert runner.execute({"op": "finish", "request_id": second["request_id"]})["sha256"] == whole[2]
    assert runner.requests == {}


def test_level2_sleep_aborts_stepwise_requests(dit):
    runner = dit.runner
    whole = runner.execute(DIT)["sha256"]
    started = runner.execute({"op": "start", **DIT})
    runner.execute({"op": "step", "request_id": started["request_id"], "steps": 2})
    dit.sleep(2)
    dit.wake()
    dit.reload()
    for op in ("step", "finish"):
        with pytest.raises(
            RequestLostError,
            match=f"request {started['request_id']} was aborted: the weights were reloaded while it was in flight",
        ):
            runner.execute({"op": op, "request_id": started["request_id"]})
    again = runner.execute({"op": "start", **DIT})
    assert runner.execute({"op": "finish", "request_id": again["request_id"]})["sha256"] == whole


def test_state_that_did_not_come_back_fails_the_request(dit):
    runner = dit.runner
    started = runner.execute({"op": "start", **DIT})
    request = runner.requests[started["request_id"]]
    runner.slab[request.slot].zero_()  # what a discard without a restore leaves on the portable backend
    with pytest.raises(RequestLostError, match="its state in the 'requests' pool did not survive"):
        runner.execute({"op": "step", "request_id": started["request_id"]})
    assert started["request_id"] not in runner.requests  # its slot is free again


def test_request_slots_are_bounded(checkpoints):
    runner = runner_in_pools(checkpoints["ddpm"], max_requests=2).runner
    ids = [runner.execute({"op": "start", **DDPM})["request_id"] for _ in range(2)]
    with pytest.raises(RuntimeError, match="all 2 request slots are in use; finish or cancel a request"):
        runner.execute({"op": "start", **DDPM})
    assert runner.execute({"op": "cancel", "request_id": ids[0]}) == {"request_id": ids[0], "cancelled": True}
    runner.execute({"op": "start", **DDPM})
    with pytest.raises(ValueError, match="steps must be an int >= 1, got 0"):
        runner.execute({"op": "step", "request_id": ids[1], "steps": 0})
    with pytest.raises(ValueError, match=r"unknown request_id 'r9'; live requests: \['r2', 'r3'\]"):
        runner.execute({"op": "step", "request_id": "r9"})


def test_stepwise_needs_the_requests_pool(checkpoints):
    runner = runner_in_pools(checkpoints["ddpm"], tags=("weights", "kv_cache")).runner
    with pytest.raises(ValueError, match=r"add 'requests' to StageSpec\.tags"):
        runner.execute({"op": "start", **DDPM})
    assert len(runner.execute(dict(DDPM))["png"]) > 0  # one call needs no request state


def test_partial_wake_refuses_to_execute(dit):
    started = dit.runner.execute({"op": "start", **DIT})
    dit.sleep(1)
    dit.wake(("weights",))
    for payload in (DIT, {"op": "step", "request_id": started["request_id"]}):
        with pytest.raises(RuntimeError, match=r"a requests tensor .* holds no memory: its pool is asleep"):
            dit.runner.execute(payload)
    dit.wake(("kv_cache", "requests"))
    dit.runner.execute({"op": "cancel", "request_id": started["request_id"]})


def test_pools_hold_every_component(dit):
    runner = dit.runner
    modules = [runner.pipeline.transformer, runner.pipeline.vae]
    expected = {id(t) for m in modules for t in [*m.parameters(), *m.buffers()]}
    assert {id(t) for t in runner.tensors("weights")} == expected
    assert list(runner.buffers_to_save()) == ["transformer.pos_embed.pos_embed"]  # sin-cos table, not in the file
    assert dit.backend.usage()["requests"] == runner.max_requests * runner.slot_bytes
    assert runner.tensors("kv_cache") == []


def test_reload_from_another_checkpoint_and_back(checkpoints):
    pools, other = runner_in_pools(checkpoints["dit"]), runner_in_pools(checkpoints["dit-seed1"])
    original = pools.runner.execute(DIT)["sha256"]
    pools.reload(str(checkpoints["dit-seed1"]))
    assert pools.runner.execute(DIT)["sha256"] == other.runner.execute(DIT)["sha256"] != original
    assert pools.runner.last_reload.tensors == len(pools.runner.weights.tensors())
    pools.reload(None)
    assert pools.runner.execute(DIT)["sha256"] == original


def test_unusable_reload_is_refused_before_any_write(checkpoints, tmp_path):
    pools = runner_in_pools(checkpoints["dit"])
    original = pools.runner.execute(DIT)["sha256"]
    broken = tmp_path / "broken"
    shutil.copytree(checkpoints["dit-seed1"], broken)
    vae_file = broken / "vae" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(vae_file)
    tensors["decoder.conv_out.weight"] = tensors["decoder.conv_out.weight"][:2].clone()
    save_file(tensors, str(vae_file), metadata={"format": "pt"})
    with pytest.raises(
        RunnerArgumentError,
        match=r"tensor vae/'decoder.conv_out.weight' has shape \[2, 8, 3, 3\], "
        r"the model's is \[3, 8, 3, 3\]",
    ):
        pools.runner.reload_weights(str(broken))
    with pytest.raises(RunnerArgumentError, match=r"ddpm.*transformer' does not exist"):
        pools.runner.reload_weights(str(checkpoints["ddpm"]))
    assert pools.runner.execute(DIT)["sha256"] == original  # the transformer's seed-1 tensors were not written


@pytest.mark.parametrize(
    ("payload", "error", "message"),
    [
        ("draw", TypeError, "payload must be a dict"),
        ({"op": "pause"}, ValueError, r"unknown op 'pause'; ops are \['start', 'step', 'finish', 'cancel', "),
        ({**DIT, "prompt": "a cat"}, ValueError, r"unknown payload key\(s\) \['prompt'\]"),
        ({**DIT, "class_label": 1000}, ValueError, r"class_label must be an int in 0..999 or a label name"),
        ({**DIT, "class_label": "unicorn"}, ValueError, "'unicorn' is not a label of this pipeline"),
        ({**DIT, "steps": 0}, ValueError, r"steps must be an int in 1..1000"),
        ({**DIT, "guidance_scale": "high"}, ValueError, "guidance_scale must be a number"),
    ],
)
def test_bad_payloads_say_what_is_wrong(dit, payload, error, message):
    with pytest.raises(error, match=message):
        dit.runner.execute(payload)


def test_label_names_and_unconditional_pipelines(dit, checkpoints):
    assert dit.runner.execute({**DIT, "class_label": "class 3"})["sha256"] == dit.runner.execute(DIT)["sha256"]
    ddpm = runner_in_pools(checkpoints["ddpm"]).runner
    with pytest.raises(ValueError, match=r"unknown payload key\(s\) \['class_label'\]"):
        ddpm.execute({**DDPM, "class_label": 1})
    with pytest.raises(ValueError, match="this ddpm pipeline has no text encoder, so no prompt cache"):
        ddpm.execute({"op": "prompt_cache"})


SD_TAGS = ("weights", "kv_cache", "prompt_cache")
SD_SLOT_BYTES = 2 * 77 * 32 * 4  # both guidance halves of the tiny CLIP's 77 x 32 float32 output


def test_prompt_embeddings_are_cached_in_their_own_pool(checkpoints):
    pools = runner_in_pools(checkpoints["sd"], tags=SD_TAGS, prompt_cache_bytes=2 * SD_SLOT_BYTES + 100)
    runner = pools.runner
    assert [t.numel() for t in runner.tensors("prompt_cache")] == [2 * SD_SLOT_BYTES]
    assert pools.backend.usage()["prompt_cache"] == 2 * SD_SLOT_BYTES  # the pool holds the slab
    first = runner.execute(dict(SD))["sha256"]
    stats = runner.execute({"op": "prompt_cache"})
    assert (stats["entries"], stats["slots"], stats["hits"], stats["misses"]) == (1, 2, 0, 1)
    assert stats["capacity_bytes"] == 2 * SD_SLOT_BYTES
    assert runner.execute(dict(SD))["sha256"] == first  # a hit: the same image
    assert runner.execute({"op": "prompt_cache"})["hits"] == 1
    pools.sleep(1)  # the slab is discarded, and the entries with it
    pools.wake()
    assert runner.execute({"op": "prompt_cache"})["entries"] == 0
    assert runner.execute(dict(SD))["sha256"] == first  # a miss, computed again
    for prompt in ("a dog", "a bird"):  # two more prompts, two slots: the least recent goes
        runner.execute({**SD, "prompt": prompt, "steps": 1})
    assert [key[0] for key in runner.prompt_cache.entries] == ["a dog", "a bird"]
    assert runner.execute({"op": "prompt_cache"})["evictions"] == 1
    runner.execute({**SD, "guidance_scale": 1.0, "steps": 1})  # unguided: another entry
    assert next(reversed(runner.prompt_cache.entries))[2] is False
    assert runner.execute({"op": "prompt_cache", "clear": True})["entries"] == 0
    with pytest.raises(ValueError, match="text-conditioned: give 'prompt' as a non-empty string"):
        runner.execute({"seed": 1})


def test_reset_prefix_cache_empties_the_prompt_cache_and_keeps_its_slab(checkpoints):
    pools = runner_in_pools(checkpoints["sd"], tags=SD_TAGS, prompt_cache_bytes=2 * SD_SLOT_BYTES + 100)
    runner = pools.runner
    first = runner.execute({**SD, "steps": 1})["sha256"]
    runner.execute({**SD, "prompt": "a dog", "steps": 1})
    usage, slab = pools.backend.usage(), runner.prompt_cache.slab
    assert runner.reset_prefix_cache() == 2
    assert runner.execute({"op": "prompt_cache"})["entries"] == 0
    assert pools.backend.usage() == usage and runner.prompt_cache.slab is slab  # nothing released
    assert runner.execute({**SD, "steps": 1})["sha256"] == first  # a miss, computed again
    assert runner.execute({"op": "prompt_cache"})["misses"] == 3
    assert runner.reset_prefix_cache() == 1
    assert runner_in_pools(checkpoints["ddpm"]).runner.reset_prefix_cache() == 0  # no text encoder


def test_without_the_tag_nothing_is_cached_and_a_too_small_pool_is_refused(checkpoints):
    runner = runner_in_pools(checkpoints["sd"]).runner  # no prompt_cache tag
    image = runner.execute({**SD, "steps": 1})["sha256"]
    assert runner.execute({**SD, "steps": 1})["sha256"] == image
    stats = runner.execute({"op": "prompt_cache"})
    assert (stats["entries"], stats["slots"], stats["hits"], stats["misses"]) == (0, 0, 0, 2)
    with pytest.raises(ValueError, match=rf"holds no embedding .*{SD_SLOT_BYTES} bytes each"):
        runner_in_pools(checkpoints["sd"], tags=SD_TAGS, prompt_cache_bytes=SD_SLOT_BYTES - 1)
    with pytest.raises(ValueError, match="no text encoder: leave 'prompt_cache' out"):
        runner_in_pools(checkpoints["ddpm"], tags=("weights", "kv_cache", "prompt_cache"))


@pytest.mark.parametrize("change", ["update", "reload"])
def test_a_cached_embedding_of_older_weights_is_never_served(checkpoints, tmp_path, change):
    """An update of the text encoder (or a reload from another directory, which is weights
    version 0 again) between two requests with the same prompt: the second is a miss, and its
    image equals that of a runner that only ever held the new weights."""
    pools = runner_in_pools(checkpoints["sd"], tags=SD_TAGS)
    runner = pools.runner
    before = runner.execute(dict(SD))["sha256"]
    trained = {
        name: tensor * 1.5 for name, tensor in runner.weights_to_share().items() if name.startswith("text_encoder/")
    }
    fresh = runner_in_pools(checkpoints["sd"]).runner  # never cached anything
    fresh.update_weights(trained.items())
    if change == "update":
        runner.update_weights(trained.items())
    else:
        other = tmp_path / "sd-trained"
        shutil.copytree(checkpoints["sd"], other)
        folder = other / "text_encoder"
        (path,) = folder.glob("*.safetensors")
        save_file({n.removeprefix("text_encoder/"): t.contiguous() for n, t in trained.items()}, path)
        pools.reload(str(other))
    after = runner.execute(dict(SD))["sha256"]
    stats = runner.execute({"op": "prompt_cache"})
    assert after == fresh.execute(dict(SD))["sha256"] != before
    assert (stats["hits"], stats["misses"], stats["stale_dropped"]) == (0, 2, 1)


def test_a_request_whose_state_does_not_fit_its_slot_fails_clearly(checkpoints):
    # Two latents per slot; DPM-Solver keeps the sample and two past outputs after step 2.
    runner = runner_in_pools(checkpoints["dit"], scheduler=DPM_SOLVER, state_tensors=2).runner
    started = runner.execute({"op": "start", **DIT})
    runner.execute({"op": "step", "request_id": started["request_id"]})
    with pytest.raises(RuntimeError, match=r"more than a request slot holds .*; raise the runner.s state_tensors"):
        runner.execute({"op": "step", "request_id": started["request_id"]})
    with pytest.raises(RequestLostError, match="its state needs"):
        runner.execute({"op": "finish", "request_id": started["request_id"]})


def test_an_op_that_fails_half_way_ends_its_request(checkpoints, monkeypatch):
    runner = runner_in_pools(checkpoints["dit"], scheduler=DPM_SOLVER).runner
    started = runner.execute({"op": "start", **DIT})
    transformer = runner.modules["transformer"]
    calls = []

    def flaky_forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the scheduler has already taken one step of this op
            raise RuntimeError("CUDA out of memory (simulated)")
        return type(transformer).forward(transformer, *args, **kwargs)

    monkeypatch.setattr(transformer, "forward", flaky_forward)
    with pytest.raises(RuntimeError, match="simulated"):
        runner.execute({"op": "step", "request_id": started["request_id"], "steps": 3})
    with pytest.raises(RequestLostError, match=r"its step op failed \(RuntimeError: CUDA out of memory"):
        runner.execute({"op": "step", "request_id": started["request_id"]})


def test_a_shared_memory_update_equals_the_other_checkpoint_and_drops_derived_state(checkpoints):
    """P-17 for a pipeline: `component/name` tensors over shm buckets; the images equal the
    other checkpoint's, and what came from the old weights (the generation) moves on."""
    from safetensors.torch import load_file

    from omni_core.weights_sender import WeightSender
    from omni_core.workers.weight_receiver import WeightReceiver

    pools, other = runner_in_pools(checkpoints["dit"]), runner_in_pools(checkpoints["dit-seed1"])
    runner = pools.runner
    original, generation = runner.execute(DIT)["sha256"], runner.generation
    trained = {
        f"{folder}/{name}": tensor
        for folder in runner.weights.folders
        for path in sorted((checkpoints["dit-seed1"] / folder).glob("*.safetensors"))
        for name, tensor in load_file(path).items()
    }
    assert set(trained) <= set(runner.weight_specs())
    with WeightSender() as sender:
        WeightReceiver(CPU, 0).apply(sender.share(trained), runner)
    assert runner.execute(DIT)["sha256"] == other.runner.execute(DIT)["sha256"] != original
    assert runner.generation == generation + 1


@pytest.mark.parametrize(("family", "request_"), [("dit", DIT), ("sd", SD)])
def test_a_save_loads_as_the_runners_own_pipeline_and_reloads_bit_for_bit(family, request_, checkpoints, tmp_path):
    """SaveWeights' runner half: an updated pipeline saves as diffusers lays one out (each
    component's weights under its own file name beside its config), loads as this runner's
    `model`, and reloads into another runner, each giving the updated result."""
    pools = runner_in_pools(checkpoints[family])
    runner = pools.runner
    with torch.no_grad():  # an update: every weight of the denoiser scaled, as a trainer's step would
        denoiser = "transformer" if family == "dit" else "unet"
        for tensor in runner.weights.folders[denoiser]:
            tensor.tensor.mul_(1.01)
    updated = runner.execute(request_)["sha256"]
    saved = tmp_path / "saved"
    saved.mkdir()
    files = runner.save_weights(saved, 1 << 30)
    assert "model_index.json" in files and f"{denoiser}/diffusion_pytorch_model.safetensors" in files
    if family == "sd":
        assert "text_encoder/model.safetensors" in files and "tokenizer/tokenizer.json" in files
    assert runner.weights_origin() == str(checkpoints[family])
    assert runner_in_pools(saved).runner.execute(request_)["sha256"] == updated
    other = runner_in_pools(checkpoints[family])
    other.reload(str(saved))
    assert other.runner.execute(request_)["sha256"] == updated
