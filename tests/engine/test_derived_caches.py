"""Weight-derived caches follow the version: a prompt served before and after an update, a
reload or a stage-to-stage transfer equals, token state for token state, what a model that
never served it computes on the new weights. The synthetic runner's prefix cache (states at
each full 16-token block, keyed by the tokens alone, as vLLM's prefix blocks are) is what
would serve the old weights' states if the worker did not drop it before its ACK."""

from __future__ import annotations

import pytest
import torch

from omni_core.engine.errors import InvalidArgumentError
from omni_core.runners.synthetic import PREFIX_CACHE, SyntheticRunner
from omni_core.weights_sender import WeightSender
from tests.engine.conftest import SMALL_RUNNER, small_spec
from tests.engine.test_weight_updates import new_weights

CACHED = {"prefix_cache_entries": 64, "prefix_block_tokens": 16}
PROMPT = [(7 * i + 3) % 1000 for i in range(52)]  # three full blocks and a partial one
SHARING_TWO_BLOCKS = PROMPT[:32] + [999, 998, 997]


def cached_spec(name: str, seed: int):
    return small_spec(name, runner_args=dict(SMALL_RUNNER, seed=seed, **CACHED))


def fresh(seed: int) -> SyntheticRunner:
    """A model that never served a prompt: what a stage started on these weights computes."""
    runner = SyntheticRunner(torch.device("cpu"), **dict(SMALL_RUNNER, seed=seed))
    runner.load_weights()
    runner.allocate_caches()
    return runner


def served(engine, stage: str, prompt: list[int]) -> tuple[str, int]:
    out = engine.execute(stage, {"prompt": prompt})
    return out["sha256"], out["reused_tokens"]


def test_a_prompt_after_an_update_or_a_reload_equals_a_fresh_model_on_the_new_weights(engine_factory) -> None:
    engine = engine_factory(cached_spec("r", seed=1))
    ref = fresh(seed=1)
    before, _ = served(engine, "r", PROMPT)
    assert before == ref.execute({"prompt": PROMPT})["sha256"]
    assert served(engine, "r", PROMPT) == (before, 48)  # the cache serves: three blocks reused

    with WeightSender(bucket_bytes=1 << 20) as sender:
        v1 = new_weights(ref, 21)
        report = engine.update_weights("r", sender.share(v1), version=1)
    assert report.ranks[0].caches_dropped == (PREFIX_CACHE,)
    ref.update_weights(v1.items())
    after, reused = served(engine, "r", PROMPT)
    assert (after, reused) == (ref.execute({"prompt": PROMPT})["sha256"], 0) and after != before
    assert served(engine, "r", SHARING_TWO_BLOCKS)[0] == ref.execute({"prompt": SHARING_TWO_BLOCKS})["sha256"]

    # An update from disk (the runner's 'seed:N') and a reload drop it the same way.
    served(engine, "r", PROMPT)
    assert engine.update_weights("r", "seed:9", version=2).ranks[0].caches_dropped == (PREFIX_CACHE,)
    ref.reload_weights("seed:9")
    assert served(engine, "r", PROMPT) == (ref.execute({"prompt": PROMPT})["sha256"], 0)
    engine.sleep("r", 2)
    engine.wake("r")
    assert engine.reload_weights("r").ranks[0].caches_dropped == (PREFIX_CACHE,)
    ref.reload_weights(None)
    assert served(engine, "r", PROMPT) == (ref.execute({"prompt": PROMPT})["sha256"], 0)


def test_a_transfer_drops_the_receivers_prefix_cache(engine_factory) -> None:
    engine = engine_factory(cached_spec("policy", seed=4), cached_spec("rollout", seed=5))
    stale, _ = served(engine, "rollout", PROMPT)
    report = engine.transfer_weights("policy", "rollout", version=1)
    assert report.ranks[0].caches_dropped == (PREFIX_CACHE,)
    ref = fresh(seed=5)  # the rollout's calibration, the policy's weights
    ref.update_weights(fresh(seed=4).weights_to_share().items())
    after, reused = served(engine, "rollout", PROMPT)
    assert (after, reused) == (ref.execute({"prompt": PROMPT})["sha256"], 0) and after != stale


def test_flush_cache_false_is_refused_for_a_cache_keyed_by_prompt_and_nothing_is_written(engine_factory) -> None:
    engine = engine_factory(cached_spec("r", seed=1))
    before, _ = served(engine, "r", PROMPT)
    with pytest.raises(InvalidArgumentError, match=r"flush_cache false keeps only caches keyed by weights version.*"):
        engine.update_weights("r", "seed:9", version=1, flush_cache=False)
    status = engine.status()["r"]
    assert (status["state"], status["weights_version"]) == ("RUNNING", 0)
    assert served(engine, "r", PROMPT) == (before, 48)  # nothing written, nothing dropped
    # A runner with no derived cache keeps nothing and is not refused.
    plain = engine_factory(small_spec("p"))
    report = plain.update_weights("p", "seed:9", version=1, flush_cache=False)
    assert (report.weights_version, report.ranks[0].caches_dropped) == (1, ())
