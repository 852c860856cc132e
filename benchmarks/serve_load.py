"""Load and fault test of `omni-core serve`: many HTTP clients send requests while one client
cycles a stage through sleep and wake; some requests are retried with their Idempotency-Key
and one client disconnects in the middle of its call. Every request must be answered exactly
once: the client side checks each answer (status, output bit for bit against a reference),
the server side (its metrics) checks that each request ran once, retries none, and that the
abandoned call still ran to its end.

`tests/serve/test_load.py` runs a reduced count in CI; the full run is a benchmark:

    python -m benchmarks.serve_load --clients 50 --cycles 100 --out benchmarks/results/serve.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from omni_core.provenance import git_commit

SEEDS = 8  # distinct payloads, each with a reference output taken before the load
RETRY_EVERY = 10  # every tenth request of a client is sent twice with the same key
HTTP_TIMEOUT_S = 300.0  # far above any engine deadline: a lost answer shows as an error, not a hang
DOCUMENTED = {200, 429, 503, 504}
BASELINE_REQUESTS = 50
TRANSPORT_ATTEMPTS = 3  # what a request may get under this load (README, errors table)


@dataclass
class LoadResult:
    clients: int
    cycles: int
    requests: int = 0  # distinct requests sent by the clients
    retries: int = 0  # second sends with the same Idempotency-Key
    transport_retries: int = 0  # sends repeated (same key) after a connection error: safe because of the key
    answered_attempts: int = 0  # sends that got an HTTP answer
    statuses: dict[str, int] = field(default_factory=dict)
    wrong_outputs: int = 0
    transport_errors: list[str] = field(default_factory=list)  # calls that got no answer in any attempt
    transport_notes: list[str] = field(default_factory=list)  # every connection error, repeated or not
    retry_mismatches: int = 0
    cycle_failures: list[str] = field(default_factory=list)
    server_runs: float = 0  # requests the server ran (omni_core_requests_total, this stage)
    server_replays: float = 0  # answers it served from the Idempotency-Key record
    server_execute_answers: float = 0  # HTTP answers on the execute route, every stage
    disconnect_counted: bool = False
    disconnected_call_ran_once: bool = False
    stage_idle_after: bool = False
    wall_s: float = 0.0
    execute_ms: dict[str, float] = field(default_factory=dict)
    sleep_ms: dict[str, float] = field(default_factory=dict)
    wake_ms: dict[str, float] = field(default_factory=dict)
    baseline_ms: dict[str, float] = field(default_factory=dict)  # one client, sequential, before the load
    load_average: list[float] = field(default_factory=list)  # the host's, before and after (shared machines)

    def problems(self) -> list[str]:
        """Everything that breaks "answered exactly once"; empty when the run is clean."""
        out = []
        undocumented = {s: n for s, n in self.statuses.items() if int(s) not in DOCUMENTED}
        if undocumented:
            out.append(f"undocumented statuses {undocumented}")
        if self.transport_errors:
            out.append(f"{len(self.transport_errors)} requests got no HTTP answer: {self.transport_errors[:3]}")
        if self.wrong_outputs:
            out.append(f"{self.wrong_outputs} answers carried another request's output")
        if self.retry_mismatches:
            out.append(f"{self.retry_mismatches} retries got a different answer than the first send")
        if self.cycle_failures:
            out.append(f"sleep/wake cycles failed: {self.cycle_failures[:3]}")
        if self.server_runs != self.requests:
            out.append(f"the server ran {self.server_runs:.0f} requests for {self.requests} sent (lost or duplicated)")
        # A send lost to a connection error may or may not have reached the server; its
        # repeat (same key) is then a replay or the first run. Hence ranges, never more.
        if not self.retries <= self.server_replays <= self.retries + self.transport_retries:
            out.append(
                f"the server replayed {self.server_replays:.0f} answers for {self.retries} retries "
                f"(+ up to {self.transport_retries} after connection errors)"
            )
        answered = self.answered_attempts + 1  # + the disconnected client's call
        if not answered <= self.server_execute_answers <= answered + self.transport_retries:
            out.append(
                f"{self.server_execute_answers:.0f} HTTP answers on execute for {answered} answered calls "
                f"(+ up to {self.transport_retries} lost to connection errors)"
            )
        if not self.disconnect_counted:
            out.append("the disconnected client was not counted")
        if not self.disconnected_call_ran_once:
            out.append("the disconnected client's call did not run exactly once")
        if not self.stage_idle_after:
            out.append("requests still queued or in flight after the run")
        return out


@dataclass
class _Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class _Connection:
    """One keep-alive HTTP/1.1 connection per simulated client, with just enough parsing for
    the server's answers (Content-Length bodies). A general client costs several times the
    server's own CPU per request; on 2 shared cores it would measure itself, not the server."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        parts = urlsplit(url)
        self.host, self.port, self.netloc = parts.hostname, parts.port, parts.netloc
        self.fixed = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> _Answer:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {self.netloc}\r\n{self.fixed}{extra}Content-Type: "
            f"application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await self.writer.drain()
        status_line = await self.reader.readline()
        if not status_line:
            raise ConnectionResetError("the server closed the connection before answering")
        answer_headers: dict[str, str] = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            answer_headers[name.strip().lower()] = value.strip()
        content = await self.reader.readexactly(int(answer_headers.get("content-length", "0")))
        if answer_headers.get("connection", "").lower() == "close":
            self.close()
        return _Answer(int(status_line.split()[1]), answer_headers, content)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


def percentiles_ms(samples_s: list[float]) -> dict[str, float]:
    if not samples_s:
        return {}
    ordered = sorted(samples_s)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))] * 1000

    return {
        "n": len(ordered),
        "p50": pct(50),
        "p90": pct(90),
        "p99": pct(99),
        "max": ordered[-1] * 1000,
        "mean": statistics.fmean(ordered) * 1000,
    }


def _metric(text: str, name: str, **labels: str) -> float:
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


async def _until(check: Any, what: str, timeout_s: float = 120.0) -> None:
    """Polls a condition that must become true; the bound only turns a hang into a failure."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


async def _disconnect_mid_call(
    client: httpx.AsyncClient, url: str, hold: str, headers: dict[str, str], result: LoadResult, run: str
) -> None:
    """Put `hold` to sleep, send it a request over a raw socket (it waits in the queue: mid
    call), hang up, wake the stage: the request must still run once and be counted."""

    async def metrics() -> str:
        return (await client.get("/metrics")).text

    async def hold_stage() -> dict[str, Any]:
        return (await client.get(f"/v1/stages/{hold}")).json()

    before = await metrics()
    ran_before = _metric(before, "omni_core_requests_total", stage=hold)
    gone_before = _metric(before, "omni_core_http_client_disconnects_total", route="/v1/stages/{name}/execute")
    assert (await client.post(f"/v1/stages/{hold}/sleep", json={"level": 1})).status_code == 200
    parts = urlsplit(url)
    _reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    # A long deadline of its own: on a loaded machine the wait for the disconnect to be seen
    # must not let the request expire in the queue (a CI run once timed out so).
    body = json.dumps({"payload": {"seed": 1, "batch": 1}, "timeout_s": 600}).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    writer.write(
        f"POST /v1/stages/{hold}/execute HTTP/1.1\r\nHost: {parts.netloc}\r\n{head}Content-Type: "
        f"application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    await _until(lambda: _json_field(hold_stage(), "queued", 1), "the held request to be queued")
    writer.close()  # the client goes away while its request waits
    await _until(
        lambda: _metric_is(
            metrics(), "omni_core_http_client_disconnects_total", gone_before + 1, route="/v1/stages/{name}/execute"
        ),
        "the disconnect to be counted",
    )
    result.disconnect_counted = True
    assert (await client.post(f"/v1/stages/{hold}/wake")).status_code == 200
    ok_before = _metric(before, "omni_core_requests_total", stage=hold, outcome="ok")
    await _until(
        lambda: _metric_is(metrics(), "omni_core_requests_total", ok_before + 1, stage=hold, outcome="ok"),
        "the abandoned request to run",
    )
    await _until(lambda: _json_field(hold_stage(), "in_flight", 0), "the held stage to be idle")
    ran_after = _metric(await metrics(), "omni_core_requests_total", stage=hold)
    result.disconnected_call_ran_once = ran_after == ran_before + 1


async def _json_field(awaitable: Any, key: str, value: Any) -> bool:
    return (await awaitable).get(key) == value


async def _metric_is(text_awaitable: Any, name: str, value: float, **labels: str) -> bool:
    return _metric(await text_awaitable, name, **labels) == value


async def run_load(
    url: str, *, stage: str, hold: str, clients: int, cycles: int, api_key: str | None = None, run: str | None = None
) -> LoadResult:
    """The load and fault run against a server at `url` with stages `stage` (load) and `hold`
    (the disconnect); both must be RUNNING with admission 'queue'."""
    run = run or f"load{os.getpid()}-{time.monotonic_ns()}"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    result = LoadResult(clients, cycles)
    statuses: Counter[int] = Counter()
    latencies: list[float] = []
    sleeps: list[float] = []
    wakes: list[float] = []
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=HTTP_TIMEOUT_S, limits=limits) as client:
        reference = {}
        for seed in range(SEEDS):
            answer = await client.post(f"/v1/stages/{stage}/execute", json={"payload": {"seed": seed, "batch": 1}})
            assert answer.status_code == 200, answer.text
            reference[seed] = answer.json()["output"]
        baseline: list[float] = []
        for j in range(BASELINE_REQUESTS):
            started = time.perf_counter()
            answer = await client.post(f"/v1/stages/{stage}/execute", json={"payload": {"seed": j % SEEDS, "batch": 1}})
            baseline.append(time.perf_counter() - started)
            assert answer.status_code == 200, answer.text
        result.baseline_ms = percentiles_ms(baseline)
        result.load_average.append(os.getloadavg()[0])
        before = (await client.get("/metrics")).text
        cycling_done = asyncio.Event()

        async def cycler() -> None:
            try:
                for k in range(cycles):
                    for verb, sink in (("sleep", sleeps), ("wake", wakes)):
                        started = time.perf_counter()
                        answer = await client.post(
                            f"/v1/stages/{stage}/{verb}", headers={"Idempotency-Key": f"{run}-cycle{k}-{verb}"}
                        )
                        sink.append(time.perf_counter() - started)
                        if answer.status_code != 200:
                            result.cycle_failures.append(f"{verb} {k}: {answer.status_code} {answer.text[:200]}")
            finally:
                cycling_done.set()

        async def send(conn: _Connection, key: str, seed: int) -> _Answer | None:
            """One call; a connection error (a keep-alive connection closing as the request
            goes out) is repeated with the same key, which is what the key is for."""
            body = json.dumps({"payload": {"seed": seed, "batch": 1}}).encode()
            for attempt in range(TRANSPORT_ATTEMPTS):
                started = time.perf_counter()
                try:
                    answer = await conn.post(f"/v1/stages/{stage}/execute", body, {"Idempotency-Key": key})
                except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                    conn.close()
                    result.transport_notes.append(f"{key} attempt {attempt + 1}: {type(exc).__name__}: {exc}")
                    if attempt + 1 == TRANSPORT_ATTEMPTS:
                        result.transport_errors.append(f"{key}: {type(exc).__name__}: {exc}")
                        return None
                    result.transport_retries += 1
                    continue
                latencies.append(time.perf_counter() - started)
                result.answered_attempts += 1
                return answer
            return None

        async def requester(i: int) -> None:
            conn = _Connection(url, headers)
            j = 0
            try:
                while not cycling_done.is_set() or j < 2:
                    seed, key = j % SEEDS, f"{run}-c{i}-r{j}"
                    sends = 2 if j % RETRY_EVERY == RETRY_EVERY - 1 else 1
                    first: _Answer | None = None
                    for attempt in range(sends):
                        answer = await send(conn, key, seed)
                        if answer is None:
                            break
                        if attempt == 0:
                            first = answer
                            result.requests += 1
                            statuses[answer.status] += 1
                            if answer.status == 200 and answer.json()["output"] != reference[seed]:
                                result.wrong_outputs += 1
                        else:
                            result.retries += 1
                            if answer.body != first.body or answer.headers.get("idempotent-replayed") != "true":
                                result.retry_mismatches += 1
                    j += 1
            finally:
                conn.close()

        started = time.perf_counter()
        await asyncio.gather(
            cycler(),
            *(requester(i) for i in range(clients)),
            _disconnect_mid_call(client, url, hold, headers, result, run),
        )
        result.wall_s = time.perf_counter() - started
        result.load_average.append(os.getloadavg()[0])
        after = (await client.get("/metrics")).text
        idle = (await client.get(f"/v1/stages/{stage}")).json()
        result.stage_idle_after = idle["queued"] == 0 and idle["in_flight"] == 0 and idle["state"] == "RUNNING"

    def delta(name: str, **labels: str) -> float:
        return _metric(after, name, **labels) - _metric(before, name, **labels)

    result.server_runs = delta("omni_core_requests_total", stage=stage)
    result.server_replays = delta("omni_core_idempotent_replays_total")
    result.server_execute_answers = delta("omni_core_http_requests_total", route="/v1/stages/{name}/execute")
    result.statuses = {str(k): v for k, v in sorted(statuses.items())}
    result.execute_ms, result.sleep_ms, result.wake_ms = (
        percentiles_ms(latencies),
        percentiles_ms(sleeps),
        percentiles_ms(wakes),
    )
    return result


# ====================================================================== the benchmark

BENCH_CONFIG = """\
[server]
host = "127.0.0.1"
port = {port}

[[stages]]
name = "load"
ranks = {ranks}
backend = "portable"
queue_limit = 1024
[stages.runner_args]
weights_bytes = 2097152
tensor_count = 4
kv_bytes = 262144
cpu_threads = 1

[[stages]]
name = "hold"
backend = "portable"
[stages.runner_args]
weights_bytes = 1048576
tensor_count = 2
kv_bytes = 65536
cpu_threads = 1
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    system = f"{platform.system()} {platform.release()}"
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, {system}"


def render_markdown(result: LoadResult, command: str, ranks: int) -> str:
    def row(name: str, p: dict[str, float]) -> str:
        return (
            f"| {name} | {p.get('n', 0)} | {p.get('p50', 0):.1f} | {p.get('p90', 0):.1f} | {p.get('p99', 0):.1f} "
            f"| {p.get('max', 0):.1f} |"
        )

    problems = result.problems()
    return "\n".join(
        [
            "# `omni-core serve` under load and faults",
            "",
            f"- machine: {_machine()}",
            f"- commit: {git_commit(short=True)}",
            f"- host load average (1 min) before / after the load: "
            f"{' / '.join(f'{x:.1f}' for x in result.load_average)} (the machine is shared; 2 cores)",
            f"- command: `{command}`",
            f"- setup: `omni-core serve` in its own process; stage `load` ({ranks} rank(s), synthetic runner, 2 MiB, "
            "portable backend, admission queue) takes the load; stage `hold` takes the disconnect",
            f"- load: {result.clients} HTTP clients (one keep-alive connection each, a minimal asyncio HTTP/1.1 client "
            "in one process), each sending execute requests back to back "
            f"until another client has cycled `load` through sleep (level 1) and wake {result.cycles} times; every "
            f"{RETRY_EVERY}th request is sent twice with the same Idempotency-Key; one client sends a request to the "
            "sleeping `hold` stage over a raw socket and hangs up while it waits",
            "",
            "- CI runs the same test reduced (`tests/serve/test_load.py`: 10 clients, 10 cycles, 1-2 s); this is the "
            "full run",
            "",
            f"**Verdict: {'PASS' if not problems else 'FAIL: ' + '; '.join(problems)}**",
            "",
            f"- {result.requests} requests + {result.retries} retries in {result.wall_s:.1f} s "
            f"({(result.requests + result.retries) / max(result.wall_s, 1e-9):.0f} answers/s); "
            f"statuses {result.statuses}",
            f"- every answer checked: {result.wrong_outputs} outputs differing from the reference, "
            f"{result.retry_mismatches} retries answered differently, "
            f"{len(result.transport_errors)} without an answer; "
            f"{result.transport_retries} sends repeated with their key after a connection error "
            f"{result.transport_notes[:3] if result.transport_notes else ''}",
            f"- the server ran {result.server_runs:.0f} requests for {result.requests} sent "
            "(none lost, none twice), "
            f"served {result.server_replays:.0f} retries from the Idempotency-Key record, answered "
            f"{result.server_execute_answers:.0f} execute calls "
            f"({result.requests} + {result.retries} + 1 disconnected)",
            f"- disconnect counted: {result.disconnect_counted}; the abandoned call ran exactly once after the wake: "
            f"{result.disconnected_call_ran_once}; stage idle afterwards: {result.stage_idle_after}",
            f"- sleep/wake cycles failed: {len(result.cycle_failures)}",
            "",
            "Latency, milliseconds, client side (requests include time queued while the stage sleeps):",
            "",
            "| call | n | p50 | p90 | p99 | max |",
            "|---|---|---|---|---|---|",
            row("execute, one client alone, before the load", result.baseline_ms),
            row("execute", result.execute_ms),
            row("sleep (level 1, drains in-flight requests)", result.sleep_ms),
            row("wake", result.wake_ms),
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serve_load", description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--cycles", type=int, default=100)
    parser.add_argument("--ranks", type=int, default=1, help="rank processes of the loaded stage")
    parser.add_argument("--out", default=None, help="write Markdown here (and JSON beside it)")
    args = parser.parse_args(argv)
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "load.toml"
        config.write_text(BENCH_CONFIG.format(port=port, ranks=args.ranks))
        server = subprocess.Popen(
            [sys.executable, "-m", "omni_core.cli", "serve", "--config", str(config), "--log-level", "warning"]
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 300
            while True:
                try:
                    if httpx.get(url + "/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"omni-core serve did not come up at {url} (exit code {server.poll()})")
                time.sleep(0.2)
            result = asyncio.run(run_load(url, stage="load", hold="hold", clients=args.clients, cycles=args.cycles))
        finally:
            server.terminate()
            server.wait(60)
    command = "python -m benchmarks.serve_load " + " ".join(argv if argv is not None else sys.argv[1:])
    text = render_markdown(result, command.strip(), args.ranks)
    print(text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
        Path(args.out).with_suffix(".json").write_text(json.dumps(asdict(result), indent=2) + "\n", encoding="utf-8")
    return 0 if not result.problems() else 1


if __name__ == "__main__":
    raise SystemExit(main())
