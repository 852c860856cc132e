"""The demo's pipeline scene (P-22): the LLM conditions a diffusion model through a transfer.

The demo's DiT is class-conditional: it takes a label, not embeddings, and the diffusers
runner's connector (omni_core/runners/diffusion_connector.py) imports conditioning into a
Stable Diffusion pipeline only. So the scene has a third stage, `sd`: a tiny Stable Diffusion
whose UNet attends to a 64-wide text (`sd tiny-64`, the tiny Qwen2's hidden size), taking the
LLM's `prompt_embeds` (its token embeddings of the prompt) in place of its own CLIP encoder's.

Both stages sleep (level 1); the LLM wakes to export, the transfer wakes `sd` (its admission
policy is `wake`), the hop is released so the LLM sleeps again at once; then both wake and the
caller chains them by hand (the LLM's `{"export": [...]}` result carried into `sd`'s
`"conditioning"`), and the two images must be equal byte for byte.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omni_core.engine import Engine, PipelineStage

if TYPE_CHECKING:
    from omni_core.demo_real import Image, RealDemo

SD_FAMILY = "sd"
# The SD size whose conditioning width is the demo LLM's hidden size, by the demo's --size;
# None: the catalog has none (Qwen2 1.5B is 1536 wide, SD 1B's text 768), the scene is skipped.
SD_SIZES: dict[str, str | None] = {"tiny": "tiny-64", "large": None}
EXPORT = ("prompt_embeds",)  # the names both connectors share (the LLM has no negative prompt)
SD_STEPS = 4
# guidance 1: unguided, so the one row of embeddings the LLM exports is all a request needs.
SD_REQUEST = {"seed": 7, "steps": SD_STEPS, "guidance_scale": 1.0}
PIPELINE_IMAGE, BY_HAND_IMAGE = "06-pipeline.png", "06-by-hand.png"


def pipeline_scene(demo: RealDemo, engine: Engine, prompt: str) -> None:
    """Step 6: the pipeline through a transfer around both stages' sleeps, against the same
    conditioning passed by hand."""
    from omni_core.demo_real import Image  # the demo imports this module

    for stage in ("llm", "sd"):
        demo.expect_state(demo.record("6 sleep L1", engine.sleep(stage, level=1), over_link=True), "SLEEPING")
    demo.expect_state(demo.record("6 wake", engine.wake("llm"), over_link=True), "RUNNING")
    stages = [PipelineStage("llm", {"prompt": prompt}, export=EXPORT), PipelineStage("sd", SD_REQUEST)]
    result, t = demo.timed(lambda: engine.pipeline(stages))
    woke = engine.status()["sd"]["state"] == "RUNNING"
    mark = demo.check("the transfer woke the sleeping sd stage (admission 'wake')", woke)
    through = _keep(demo, Image(PIPELINE_IMAGE, bytes(result.output["png"]), str(result.output["sha256"])))
    demo.note(
        "6 pipeline",
        "llm>sd",
        "RUNNING",
        t,
        f"{'+'.join(EXPORT)} moved by a transfer at llm v{result.producer_versions[0]}, sd woken {mark}: "
        f"{PIPELINE_IMAGE}",
    )
    # The hop is released: nothing holds the producer awake.
    demo.expect_state(demo.record("6 sleep L1", engine.sleep("llm", level=1), over_link=True), "SLEEPING")
    demo.expect_state(demo.record("6 wake", engine.wake("llm"), over_link=True), "RUNNING")
    by_hand, t = demo.timed(lambda: chained_by_hand(engine, prompt))
    image = _keep(demo, Image(BY_HAND_IMAGE, bytes(by_hand["png"]), str(by_hand["sha256"])))
    same = image.png == through.png and image.sha256 == through.sha256
    mark = demo.check(f"image {BY_HAND_IMAGE} equals {PIPELINE_IMAGE}", same)
    demo.note("6 by hand", "llm>sd", "RUNNING", t, f"{BY_HAND_IMAGE} == {PIPELINE_IMAGE}, bytes and tensor {mark}")


def chained_by_hand(engine: Engine, prompt: str) -> dict[str, Any]:
    """The same two stages chained by the caller: the LLM's tensors in its result, through
    this process, into the diffusion stage's payload."""
    conditioning = engine.execute("llm", {"prompt": prompt, "export": list(EXPORT)})
    image: Any = engine.execute("sd", {**SD_REQUEST, "conditioning": conditioning})
    return dict(image)


def _keep(demo: RealDemo, image: Image) -> Image:
    demo.out_dir.mkdir(parents=True, exist_ok=True)
    (demo.out_dir / image.name).write_bytes(image.png)
    demo.images.append(image)
    return image
