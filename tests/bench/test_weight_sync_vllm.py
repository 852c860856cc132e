"""The weight-sync bench's vLLM part off the GPU: the child's pipe (replies among other
output, a child that ends), the skip without vLLM, and the table."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from benchmarks import weight_sync_vllm as wv

ECHO_CHILD = textwrap.dedent(
    """
    import json, sys
    print("vLLM says something on stdout first", flush=True)
    print("VLLM_REPLY " + json.dumps({"ready": True, "tokens": [1], "stand_ins": ["ray"]}), flush=True)
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["op"] == "update":
            print("VLLM_REPLY " + json.dumps({"update_s": 0.5, "got": msg["info"]}), flush=True)
        elif msg["op"] == "stop":
            break
    """
)


def test_the_child_answers_over_the_pipe_and_a_child_that_ends_is_named(tmp_path: Path) -> None:
    child = wv.PlainVllm(tmp_path, None, tmp_path / "child.log", script=ECHO_CHILD)
    try:
        assert child.ready == {"ready": True, "tokens": [1], "stand_ins": ["ray"]}
        assert child.ask(op="update", info="abc") == {"update_s": 0.5, "got": "abc"}
    finally:
        child.close()
    assert child.proc.returncode == 0
    with pytest.raises(RuntimeError, match=r"ended or said nothing .* its log: .*gone\.log"):
        wv.PlainVllm(tmp_path, None, tmp_path / "gone.log", script="import sys; sys.exit(3)")


def test_without_vllm_the_part_is_skipped_and_says_why(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(wv, "vllm_available", lambda: "no vllm on the path")
    said: list[str] = []
    part = wv.run_vllm_part("tiny", tmp_path, said.append)
    assert part == {"skipped": "no vllm on the path"}
    assert "skipped" in said[0]
    assert wv.render_vllm(part) == ["", "vLLM's own update path: not measured (no vllm on the path)."]


def test_the_table_has_both_methods_and_says_whether_their_tokens_agree() -> None:
    row = {"case": "first", "update_wall_s": 0.01, "own_s": 0.008, "gbps_wall": 300.0, "share_s": 0.002}
    part = {
        "model": "qwen2 1.5b",
        "bytes": 3.09e9,
        "tensors": 338,
        "rows": [
            {**row, "method": "omni-core", "tokens": [1, 2]},
            {**row, "method": "vLLM", "tokens": [1, 2]},
            {"method": "vLLM", "error": "RuntimeError: child died"},
        ],
        "tokens_agree": {"1": True},
    }
    text = "\n".join(wv.render_vllm(part))
    assert "| omni-core | first | 10.0 ms | 8.0 ms | 300 | 2.0 ms | [1, 2] |" in text
    assert "| vLLM | error: RuntimeError: child died |" in text
    assert "per version: {'1': True}" in text


def test_tokens_agree_only_when_both_methods_generated_the_same() -> None:
    rows = [
        {"version": 1, "tokens": [1, 2]},
        {"version": 1, "tokens": [1, 2]},
        {"version": 2, "tokens": [1, 2]},
        {"version": 2, "tokens": [1, 3]},
        {"version": 3, "tokens": [4]},
        {"method": "vLLM", "error": "gone"},
    ]
    assert wv.tokens_agree(rows) == {"1": True, "2": False, "3": False}


FAKE_VLLM = {
    "vllm/__init__.py": '''
from types import SimpleNamespace


class SamplingParams:
    def __init__(self, **fields):
        self.fields = fields


class LLM:
    """What the child calls of vLLM's LLM, recording the order of the update calls."""

    def __init__(self, **fields):
        assert fields["weight_transfer_config"] == {"backend": "ipc"}, fields
        import vllm.distributed.weight_transfer.ipc_engine  # as vLLM's factory does, lazily

        self.updating, self.names = False, 0

    def start_weight_update(self):
        assert not self.updating
        self.updating = True

    def update_weights(self, request):
        assert self.updating, "update_weights outside start/finish"
        self.names = len(request["update_info"]["names"])

    def finish_weight_update(self):
        assert self.updating
        self.updating = False

    def generate(self, prompts, params, use_tqdm=False):
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[self.names, *prompts[0]["prompt_token_ids"][:1]])])]
''',
    "vllm/distributed/__init__.py": "",
    "vllm/distributed/weight_transfer/__init__.py": "",
    # vLLM 0.26's module imports both at its top, for send modes the child never uses.
    "vllm/distributed/weight_transfer/ipc_engine.py": "import ray\nimport requests\n",
}


def test_the_child_drives_vllms_update_calls_in_order_with_stand_ins(tmp_path: Path, monkeypatch) -> None:
    import base64
    import importlib.util
    import os
    import pickle

    for name, text in FAKE_VLLM.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    child = wv.PlainVllm(tmp_path / "model", None, tmp_path / "child.log")
    try:
        absent = [n for n in ("ray", "requests") if importlib.util.find_spec(n) is None]
        assert child.ready == {"ready": True, "tokens": [0, wv.PROMPT[0]], "stand_ins": absent}
        info = {"names": ["a", "b", "c"], "dtype_names": [], "shapes": [], "ipc_handles": []}
        answer = child.ask(op="update", info=base64.b64encode(pickle.dumps(info)).decode("ascii"))
        assert answer["update_s"] >= 0
        assert child.ask(op="tokens") == {"tokens": [3, wv.PROMPT[0]]}
    finally:
        child.close()
    assert child.proc.returncode == 0, (tmp_path / "child.log").read_text()
