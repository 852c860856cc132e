"""`python -m benchmarks.pipeline` at a tiny size, so it cannot rot: both paths run on the
real tiny stages, their images are compared, the file renders with its targets. No timing is
asserted (the committed run is benchmarks/results/pipeline.md)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="needs the models extra: pip install -e '.[models]'")
pytest.importorskip("diffusers", reason="needs the models extra: pip install -e '.[models]'")

from benchmarks import pipeline
from omni_core.engine import Engine


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    llm, sd = pipeline.make_models(tmp_path_factory.mktemp("models"))
    with Engine(pipeline.specs(llm, sd)) as engine:
        yield engine


def test_both_paths_run_and_the_results_file_renders(engine) -> None:
    result = pipeline.measure(engine, steps=1, requests=2, warmup=1)
    assert len(result["pipeline_ms"]) == len(result["hand_ms"]) == 2 and result["exported_bytes"] > 0
    ours, theirs = result["parts_ms"]["pipeline"], result["parts_ms"]["hand"]
    assert {"TransferOut", "TransferIn", "TransferRelease", "execute image"} <= set(ours)
    assert "status" not in ours and "execute text" not in ours  # the consumer's state: no round trip
    assert set(theirs) == {"execute text", "execute image"}
    machine = {"host": "h", "cpus": 2, "platform": "p", "python": "3", "commit": "abc"}
    text = pipeline.render_markdown([result], machine, "python -m benchmarks.pipeline")
    assert "commit `abc`; command `python -m benchmarks.pipeline`" in text
    targets = text.split("## Targets", 1)[1]
    assert "| pipeline p50 <= 1.0x by-hand p50, image at 1 steps |" in targets
    assert "| pipeline and by-hand images equal byte for byte | every pair of 2 requests | met |" in targets
    assert "_lifecycle" not in vars(engine)  # the timing wrappers are gone: the class's methods again
    assert pipeline.pipeline_module._release_hops.__name__ == "_release_hops"


def test_a_pair_whose_images_differ_fails_the_run(engine, monkeypatch) -> None:
    another_seed_of = pipeline.by_hand
    monkeypatch.setattr(pipeline, "by_hand", lambda engine, steps, i: another_seed_of(engine, steps, i + 1))
    with pytest.raises(AssertionError, match="request 0 at 1 steps: the pipeline's image differs"):
        pipeline.measure(engine, steps=1, requests=1, warmup=0)


def test_a_miss_is_explained_from_the_timed_calls() -> None:
    result = {
        "steps": 8,
        "requests": 3,
        "pipeline_ms": [12.0, 13.0, 14.0],
        "hand_ms": [10.0, 10.0, 10.0],
        "exported_bytes": 7424,
        "parts_ms": {
            "pipeline": {
                "TransferOut": 2.0,
                "TransferIn": 1.0,
                "TransferRelease": 2.0,
                "execute image": 6.0,
            },
            "hand": {"execute text": 2.0, "execute image": 6.0},
        },
    }
    why = pipeline._targets([result])[-2]
    assert "missed by 1.30x: 3.0 ms a request (paired)" in why
    assert "3.0 ms (TransferIn 1.0, TransferRelease 2.0); +0.0 ms is the rest" in why
    met = dict(result, pipeline_ms=[9.0, 10.0, 11.0])
    assert pipeline._targets([met])[-2].endswith("(1.00x) | met |")
