"""`omni-core serve` as an operator meets it: a port in use ends it at once, and its log has
one line per lifecycle event, failure and dead rank (`--log-json`: one JSON object each)."""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

import omni_core.serve.server as server_module
from omni_core.cli import main
from omni_core.serve.auth import ServeRefusedError
from omni_core.serve.logs import JsonFormatter, TextFormatter

ROOT = Path(__file__).resolve().parents[2]
LOG_WAIT_S = 120.0  # only turns a hang into a failure; each line comes in well under a second


def test_a_port_in_use_ends_serve_in_one_line_before_any_rank_starts(monkeypatch, capsys) -> None:
    def no_engine(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a rank was started although the port is taken")

    monkeypatch.setattr(server_module, "Engine", no_engine)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        code = main(["serve", "--config", str(ROOT / "examples/two_stages.toml"), "--port", str(port)])
    assert code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert f"cannot listen on 127.0.0.1:{port}: the address is already in use" in err
    assert "pass another --port" in err and "stop the other process" in err


@pytest.mark.parametrize(
    ("host", "words"),
    [
        ("192.0.2.1", "cannot listen on 192.0.2.1:0: "),  # TEST-NET-1: no address of this machine
        ("no-such-host.invalid", "the host 'no-such-host.invalid' does not resolve"),
    ],
)
def test_an_address_that_is_not_this_machines_is_refused_naming_it(host: str, words: str) -> None:
    with pytest.raises(ServeRefusedError, match=r"pass (a )?--host") as info:
        server_module.bind_listener(host, 0)
    assert words in str(info.value)


def test_formatters_keep_one_event_on_one_line() -> None:
    try:
        raise ValueError("first\nsecond")
    except ValueError:
        record = logging.LogRecord(
            "omni_core.serve", logging.ERROR, __file__, 1, "rank said:\n%s", ("boom",), sys.exc_info()
        )
    record.omni_event = {"event": "rank_gone", "stage": "talker", "rank": 1, "level": "not the level"}
    text = TextFormatter().format(record)
    assert "\n" not in text and "ERROR omni_core.serve: rank said: | boom" in text and "first | second" in text
    line = JsonFormatter().format(record)
    assert "\n" not in line
    parsed = json.loads(line)
    assert (parsed["level"], parsed["event"], parsed["stage"], parsed["rank"]) == ("ERROR", "rank_gone", "talker", 1)
    assert parsed["message"] == "rank said:\nboom" and "ValueError: first" in parsed["exception"]


CONFIG = """
[[stages]]
name = "solo"
runner = "synthetic"
ranks = 2
device = "cpu"
backend = "portable"
deadline_s = 30.0
[stages.runner_args]
weights_bytes = 2097152
tensor_count = 4
kv_bytes = 262144
cpu_threads = 1
"""


class _Lines:
    """A child's stderr, one parsed JSON line at a time, read on a thread of its own."""

    def __init__(self, stream: Any) -> None:
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        self.raw: list[str] = []
        threading.Thread(target=lambda: [self.lines.put(line) for line in stream], daemon=True).start()

    def until(self, event: str, **fields: Any) -> dict[str, Any]:
        def wanted(parsed: dict[str, Any]) -> bool:
            return parsed.get("event") == event and all(parsed.get(k) == v for k, v in fields.items())

        for parsed in self.seen:  # one status poll may bring several lines
            if wanted(parsed):
                return parsed
        deadline = time.monotonic() + LOG_WAIT_S
        while time.monotonic() < deadline:
            try:
                raw = self.lines.get(timeout=1.0)
            except queue.Empty:
                continue
            self.raw.append(raw)
            parsed = json.loads(raw)  # every line is one JSON object, or this fails
            self.seen.append(parsed)
            if wanted(parsed):
                return parsed
        raise AssertionError(f"no {event} {fields} in the log within {LOG_WAIT_S} s: {self.raw}")


@pytest.mark.slow
def test_serve_logs_every_lifecycle_event_failure_and_dead_rank_as_json(tmp_path: Path) -> None:
    config = tmp_path / "solo.toml"
    config.write_text(CONFIG)
    env = {k: v for k, v in os.environ.items() if k != "OMNI_CORE_API_KEY"}
    child = subprocess.Popen(
        [sys.executable, "-m", "omni_core.cli", "serve", "--config", str(config), "--port", "0", "--log-json"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    log = _Lines(child.stderr)
    try:
        url = log.until("listening")["url"]
        with httpx.Client(base_url=url, timeout=120) as client:
            assert client.post("/v1/stages/solo/sleep", json={"level": 1}).status_code == 200
            slept = log.until("lifecycle", command="sleep")
            assert (slept["stage"], slept["outcome"], slept["state"]) == ("solo", "ok", "SLEEPING")
            assert slept["freed_bytes"] > 0 and slept["sleep_level"] == 1 and slept["level"] == "INFO"
            assert client.post("/v1/stages/solo/wake").status_code == 200
            assert log.until("lifecycle", command="wake")["state"] == "RUNNING"
            refused = client.post("/v1/stages/solo/reload")  # RUNNING: nothing to reload
            assert refused.status_code == 409
            failed = log.until("lifecycle", command="reload")
            assert failed["level"] == "WARNING" and failed["outcome"] != "ok" and "cannot reload" in failed["error"]
            pid = client.get("/v1/stages/solo").json()["ranks"]["1"]["pid"]
            os.kill(pid, signal.SIGKILL)
            gone = log.until("rank_gone", stage="solo", rank=1)
            assert gone["pid"] == pid and gone["level"] == "ERROR"
            down = log.until("stage_failed", stage="solo")
            assert down["state"] == "FAILED" and down["failure"] and "omni-core restart solo" in down["message"]
    finally:
        child.send_signal(signal.SIGINT)
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
    log.until("stopped")
    assert child.returncode == 0
    assert [e for e in log.seen if e.get("event") == "lifecycle" and e["command"] == "sleep"] == [slept]  # once each


def _snapshot(state: str, alive: bool, epoch: int = 1, pid: int = 41) -> dict[str, Any]:
    rank = {"pid": pid, "alive": alive}
    return {
        "engine_up": True,
        "stages": {"solo": {"state": state, "epoch": epoch, "failure": "rank 0: died", "ranks": {"0": rank}}},
    }


def test_each_failure_and_dead_rank_is_one_line_even_when_refreshes_end_out_of_order(caplog) -> None:
    from omni_core.serve.feed import _log_changes

    logged: dict[tuple[str, str], Any] = {}
    running, failed = _snapshot("RUNNING", True), _snapshot("FAILED", False)
    with caplog.at_level(logging.INFO, logger="omni_core.serve.events"):
        said = [_log_changes(before, after, logged) for before, after in [(running, failed), (failed, running)]]
        said += [_log_changes(before, after, logged) for before, after in [(running, failed), (failed, failed)]]
        assert [r.omni_event["event"] for r in caplog.records] == ["stage_failed", "rank_gone"]
        # What was said is also the status page's events, once each: the stage's failure, the rank's death.
        assert [[(e["command"], e["outcome"], e["state"]) for e in events] for events in said] == [
            [("stage_failed", "failed", "FAILED"), ("rank_gone", "failed", "FAILED")],
            [],
            [],
            [],
        ]
        assert said[0][1]["error"] == "rank 0 (pid 41) exited" and "omni-core restart solo" in said[0][0]["error"]
        _log_changes(_snapshot("RUNNING", True, 2, 42), _snapshot("FAILED", False, 2, 42), logged)  # a new epoch
    assert [(r.omni_event["event"], r.omni_event.get("pid")) for r in caplog.records[2:]] == [
        ("stage_failed", None),
        ("rank_gone", 42),
    ]


BAD_STAGE = """
[[stages]]
name = "talker"
runner = "synthetic"
backend = "portable"
[stages.runner_args]
weights_bytes = 1048576
{field} = 4
"""


def test_a_config_mistake_the_ranks_find_is_one_line_naming_the_stage_and_field(tmp_path: Path) -> None:
    """A runner argument typo is found only when the rank builds its runner: serve exits 2 with
    one line naming the stage and the field, not the engine's traceback."""
    config = tmp_path / "bad.toml"
    config.write_text(BAD_STAGE.format(field="tensor_cont"), encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "omni_core.cli", "serve", "--config", str(config), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=LOG_WAIT_S,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    served = [line for line in lines if " omni_core.serve: " in line]
    assert served[-1].endswith(
        f"runner_args.tensor_cont is not an argument of runner 'synthetic': fix or remove it "
        f"([[stages]] name = 'talker' in {config}, [stages.runner_args])"
    ), done.stderr
    assert "stage 'talker' did not start" in served[-1]
    assert not any(line.startswith("Traceback") for line in lines), done.stderr  # only the rank's line holds one
    assert len(lines) <= 3, done.stderr  # starting, the rank's one line, the refusal


@pytest.mark.parametrize(
    ("reason", "words"),
    [
        ("TypeError: Runner.__init__() missing 1 required keyword-only argument: 'model'", "needs runner_args 'model'"),
        ("OSError: /models/qwen does not exist", "check runner_args.model"),
        ("RuntimeError: CUDA error: invalid device ordinal", "device 'cpu' is not usable here"),
        ("ValueError: something else", "the rank's log line above has its traceback"),
    ],
)
def test_each_kind_of_start_failure_names_what_to_change(reason: str, words: str) -> None:
    from omni_core.config import parse_config
    from omni_core.engine.errors import StageFailedError
    from omni_core.serve.start_errors import start_failure

    config = parse_config({"stages": [{"name": "talker", "backend": "portable"}]}, "/etc/omni.toml")
    line = start_failure(
        StageFailedError("talker", "stage 'talker' FAILED", {0: f"started in FAILED: {reason}"}), config
    )
    assert "\n" not in line and line.startswith("stage 'talker' did not start (rank 0: ")
    assert words in line and "/etc/omni.toml" in line, line


def test_the_access_log_keeps_a_line_budget_and_escapes_the_callers_path(caplog) -> None:
    from omni_core.serve.access_log import PATH_CHARS, AccessLog

    now = [0.0]
    access = AccessLog(rate_per_s=1.0, burst=3, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="omni_core.serve.access"):
        for _ in range(5):  # a burst of 3 lines, then 2 over the budget
            access.answered("GET", "/health", "/health", 200, 0.0012, "127.0.0.1:5000")
        now[0] = 2.0  # two tokens back
        access.answered("POST", "/x\n\x1b[31m" + "y" * 400, "unmatched", 404, 0.002, "127.0.0.1:5001")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:3] == ["GET /health -> 200 in 1.2 ms (127.0.0.1:5000)"] * 3 and len(lines) == 4
    last = lines[3]
    assert last.startswith("POST /x\\n\\x1b[31m") and "\n" not in last and "\x1b" not in last
    assert "y" * (PATH_CHARS - len("/x\n\x1b[31m")) in last and "y" * PATH_CHARS not in last
    assert last.endswith("(2 requests before this one not logged: over 1 lines/s)")
    assert caplog.records[3].omni_event["route"] == "unmatched" and caplog.records[3].omni_event["code"] == 404


def test_access_log_on_writes_a_line_per_answer_and_off_writes_none(caplog) -> None:
    from tests.serve.conftest import make_config, serving, stage_table, wait_for

    for on in (True, False):
        caplog.clear()
        with (
            serving(make_config(stage_table("solo"), access_log=on)) as served,
            caplog.at_level(logging.INFO, logger="omni_core.serve.access"),
        ):
            assert served.client.post("/v1/stages/nope/sleep").status_code == 404
            assert served.client.get("/health").status_code == 200

            def lines() -> list[str]:
                return [r.getMessage() for r in caplog.records if r.name == "omni_core.serve.access"]

            # The line is written once the answer is sent, so it may follow the client's read.
            metrics = served.client.get("/metrics")  # a third answer: the first two are done by now
            assert metrics.status_code == 200
            if on:
                for start in ("POST /v1/stages/nope/sleep -> 404 in ", "GET /health -> 200 in "):
                    wait_for(lambda s=start: any(line.startswith(s) for line in lines()), what=start)
            else:
                assert lines() == []
