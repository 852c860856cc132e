"""TransformersRunner.execute_batch: requests of a rank's batch generated together, each
result equal, token for token, to the request run alone."""

from __future__ import annotations

import pytest

from .test_transformers_runner import GREEDY, PROMPT, SAMPLED, runner_in_pools


@pytest.fixture(scope="module")
def wide(checkpoints):
    return runner_in_pools(checkpoints["qwen2"], max_batch=6)


def _alone(runner, payloads):
    return [runner.execute(p) for p in payloads]


def test_a_batch_of_greedy_requests_equals_each_run_alone(wide):
    payloads = [
        GREEDY,
        {"prompt_ids": [40, 41], "max_new_tokens": 3, "stop_at_eos": False},  # leaves early: its own limit
        {"prompt_ids": [[100, 3, 4, 5], [9]], "max_new_tokens": 9, "stop_at_eos": False},  # two rows
        {"prompt_ids": [7, 8, 9, 10, 11, 12, 13, 14, 15], "max_new_tokens": 5},
    ]
    alone = _alone(wide.runner, payloads)
    batch = wide.runner.execute_batch(payloads)
    assert batch == alone
    assert len(batch[1]["token_ids"]) == 3 and len(batch[2]["token_ids"][0]) == 9


def test_more_rows_than_max_batch_run_in_several_passes(wide):
    payloads = [{"prompt_ids": [5 + i, 6, 7 + i], "max_new_tokens": 4 + i % 3, "stop_at_eos": False} for i in range(9)]
    assert wide.runner.execute_batch(payloads) == _alone(wide.runner, payloads)
    assert wide.runner._groups([wide.runner._parse(p) for p in payloads]) == [[0, 1, 2, 3, 4, 5], [6, 7, 8]]


def test_an_end_of_sequence_stops_its_row_only(wide, monkeypatch):
    # The tiny model never says EOS by itself: declare the third token it picks EOS.
    third = wide.runner.execute(GREEDY)["token_ids"][2]
    first_seen = wide.runner.execute(GREEDY)["token_ids"].index(third)
    monkeypatch.setattr(wide.runner.config, "eos_token_id", third)
    stopping = {"prompt_ids": PROMPT, "max_new_tokens": 12}
    other = {"prompt_ids": [40, 41, 42], "max_new_tokens": 12, "stop_at_eos": False}
    alone = _alone(wide.runner, [stopping, other])
    assert alone[0]["finish_reason"] == "stop" and len(alone[0]["token_ids"]) == first_seen + 1
    assert wide.runner.execute_batch([stopping, other]) == alone


def test_sampled_requests_run_alone_and_a_bad_payload_fails_only_itself(wide):
    payloads = [SAMPLED, {"prompt_ids": "not ids"}, GREEDY, {**SAMPLED, "sampling": {"temperature": 1.0, "seed": 9}}]
    out = wide.runner.execute_batch(payloads)
    assert isinstance(out[1], TypeError) and "prompt_ids" in str(out[1])
    assert [out[i] for i in (0, 2, 3)] == _alone(wide.runner, [payloads[i] for i in (0, 2, 3)])


def test_a_cache_too_short_for_two_requests_together_splits_them(checkpoints):
    pools = runner_in_pools(checkpoints["qwen2"], max_batch=4, max_seq_len=16)
    long_prompt = {"prompt_ids": list(range(3, 15)), "max_new_tokens": 2, "stop_at_eos": False}  # 12 + 2
    long_output = {"prompt_ids": [3, 4], "max_new_tokens": 12, "stop_at_eos": False}  # 2 + 12; together 24
    runner = pools.runner
    assert runner._groups([runner._parse(p) for p in (long_prompt, long_output)]) == [[0], [1]]
    assert runner.execute_batch([long_prompt, long_output]) == _alone(runner, [long_prompt, long_output])
