"""omni_core.client, the CLI verbs on top of it, the README's client example, and
`omni-core demo --config`."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from omni_core.client import OmniClient, ServeError
from tests.serve.conftest import PROBE, Served

ROOT = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("settled")  # every stage RUNNING at each test's start


def test_client_round_trip(served: Served) -> None:
    client = OmniClient(served.url)
    assert client.health()["status"] == "ok"
    assert [s["name"] for s in client.stages()] == ["talker", "decoder"]
    reference = client.execute("decoder", PROBE)
    assert client.sleep("decoder", level=2)["state"] == "SLEEPING"
    assert client.is_sleeping() is False  # vLLM's route looks at the default stage, talker
    assert client.wake("decoder", idempotency_key="client-wake")["state"] == "NEEDS_RELOAD"
    assert client.wake("decoder", idempotency_key="client-wake")["task_id"] == "idem-client-wake"
    assert client.reload_weights("decoder")["state"] == "RUNNING"
    assert client.execute("decoder", PROBE) == reference
    assert client.restart("decoder")["epoch"] == client.stage("decoder")["epoch"]
    with pytest.raises(ServeError) as info:
        client.sleep("nope")
    assert (info.value.status, info.value.type) == (404, "InvalidArgumentError")
    assert str(info.value) == "unknown stage 'nope'; stages are ['decoder', 'talker']"


def test_unreachable_server_says_so() -> None:
    expected = r"cannot reach http://127\.0\.0\.1:9: .*; is `omni-core serve` running there\?"
    with pytest.raises(ServeError, match=expected):
        OmniClient("http://127.0.0.1:9", timeout_s=5).stages()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "omni_core.cli", *args], capture_output=True, text=True, cwd=ROOT, timeout=120
    )


def test_cli_verbs(served: Served) -> None:
    slept = _cli("sleep", "talker", "--level", "1", "--url", served.url)
    assert slept.returncode == 0, slept.stderr
    assert re.match(r"talker: Sleep -> SLEEPING in [\d.]+ ms, freed [\d.]+ MiB over 2 rank\(s\)", slept.stdout)
    status = _cli("status", "--url", served.url)
    assert status.returncode == 0 and re.search(r"0\s+talker\s+SLEEPING", status.stdout), status.stdout
    woken = _cli("wake", "talker", "--url", served.url, "--json")
    assert woken.returncode == 0 and json.loads(woken.stdout)["state"] == "RUNNING"
    refused = _cli("wake", "nope", "--url", served.url)
    assert refused.returncode == 1 and "HTTP 404 InvalidArgumentError: unknown stage 'nope'" in refused.stderr


def test_readme_client_example_runs(served: Served) -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Serving over HTTP", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1).replace("http://127.0.0.1:8000", served.url)
    for _ in range(2):  # run again as a user would: its keys are fresh, so nothing is an old answer
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, "README.md", "exec"), {"__name__": "readme_client"})
        lines = out.getvalue().splitlines()
        assert lines[0] == "[('talker', 'RUNNING'), ('decoder', 'RUNNING')]"
        assert lines[1].startswith("SLEEPING False {'0': "), lines
        assert lines[2] == "SLEEPING True", lines
        assert lines[3].startswith("409 InvalidArgumentError stage 'talker' cannot reload weights in RUNNING")


def test_client_says_when_an_answer_is_a_replay(served: Served) -> None:
    client = OmniClient(served.url)
    first = client.sleep("decoder", idempotency_key="replay-seen-sleep")
    assert first["state"] == "SLEEPING" and first.replayed is False
    client.wake("decoder")
    again = client.sleep("decoder", idempotency_key="replay-seen-sleep")
    assert again == first and again.replayed is True  # the old SLEEPING while the stage runs: said so
    now = client.stage("decoder")
    assert now["state"] == "RUNNING" and now.replayed is False


def test_demo_config_runs_the_example(tmp_path: Path) -> None:
    done = _cli("demo", "--config", "examples/two_stages.toml")
    assert done.returncode == 0, done.stdout + done.stderr
    for stage in ("talker", "decoder"):
        assert re.search(rf"{stage}\s+reload\s+-> RUNNING .* output identical", done.stdout), done.stdout
    assert "verdict: PASS" in done.stdout
    broken = tmp_path / "broken.toml"
    broken.write_text('[[stages]]\nname = "solo"\nranks = 0\n')
    failed = _cli("demo", "--config", str(broken))
    assert failed.returncode == 2 and "stage 'solo' (stages[0]): field 'ranks'" in failed.stderr
