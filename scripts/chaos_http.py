#!/usr/bin/env python
"""Chaos run: mixed lifecycle traffic over HTTP and the Python API on two synthetic stages,
with rank kills, stops, restarts (concurrent ones too), slow clients and bad requests injected
at random, and the attacks of docs/security.md (junk floods on the engine's socket,
idle connection floods, rendezvous to hosts not allowed or that never answer, bad shm
handles), each of which must be refused; then every stage must come back to RUNNING.

    .venv/bin/python scripts/chaos_http.py --minutes 10 --out benchmarks/results/chaos_http.md

Counts calls sent and answered, wrong answers (a 500, an error that is not a JSON error body, a
request output that differs from the stage's reference output, a Python API exception that is
not the engine's own), lost ones (no answer within the client's timeout), and stages left
wedged (not RUNNING within --recover-s after the chaos stops); samples the process's RSS,
descriptors, threads and /dev/shm over time. Exit 1 when a target is missed. Not part of CI.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import json
import os
import random
import signal
import socket
import sys
import threading
import time
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import msgspec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import run_report  # noqa: E402

from omni_core.config import parse_config  # noqa: E402
from omni_core.engine import Engine  # noqa: E402
from omni_core.engine.errors import OmniCoreError, StageFailedError  # noqa: E402
from omni_core.protocol import ShmSource  # noqa: E402
from omni_core.serve import create_app, serve_in_thread  # noqa: E402
from omni_core.serve.feed import dumps  # noqa: E402

STAGES = ("talker", "decoder")
PAYLOADS = [{"seed": s, "batch": 2} for s in range(4)]
CLIENT_TIMEOUT_S = 120.0  # far above every deadline below: no answer by then is lost
RUNNER = {"weights_bytes": 2 << 20, "tensor_count": 4, "kv_bytes": 1 << 18, "cpu_threads": 1}


def _config() -> Any:
    stage = {
        "backend": "portable",
        "deadline_s": 10.0,
        "start_deadline_s": 90.0,  # rank start-ups on a shared, loaded machine
        "request_timeout_s": 20.0,
        "queue_limit": 16,
    }
    return parse_config(
        {
            "server": {"read_timeout_s": 2.0},
            "stages": [
                {"name": "talker", "ranks": 2, "runner_args": dict(RUNNER, seed=1), **stage},
                {"name": "decoder", "ranks": 1, "runner_args": dict(RUNNER, seed=2), **stage},
            ],
        },
        "<chaos>",
    )


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent = Counter()
        self.answered = Counter()
        self.wrong: list[str] = []
        self.lost: list[str] = []
        self.statuses = Counter()
        self.attack_frames = 0  # junk frames the floods sent
        self.stops: list[tuple[float, float]] = []  # when a rank was held by SIGSTOP (from, until)
        self.started: list[threading.Thread] = []  # faults' own threads and timers, joined at the end

    def background(self, thread: threading.Thread) -> None:
        thread.start()
        with self.lock:
            self.started = [t for t in self.started if t.is_alive()] + [thread]

    def join_background(self, timeout_s: float) -> int:
        """Wait for the faults' threads (a stopped rank's SIGCONT, held sockets); how many are left."""
        until = time.monotonic() + timeout_s
        for thread in list(self.started):
            thread.join(max(0.0, until - time.monotonic()))
        return sum(t.is_alive() for t in self.started)

    def note(self, kind: str, *, answered: bool, wrong: str = "", status: object = None) -> None:
        with self.lock:
            self.sent[kind] += 1
            if answered:
                self.answered[kind] += 1
                self.statuses[f"{kind} {status}"] += 1
            else:
                self.lost.append(kind)
            if wrong and len(self.wrong) < 100:
                self.wrong.append(f"{kind}: {wrong}")


def _http_error_ok(response: httpx.Response) -> str:
    if response.status_code < 400:
        return ""
    if response.status_code == 500:
        return f"500: {response.text[:300]}"
    try:
        error = response.json()["error"]
        assert error["code"] == response.status_code and error["message"]
    except (ValueError, KeyError, TypeError, AssertionError):
        return f"{response.status_code} without a JSON error: {response.text[:200]}"
    return ""


def http_worker(url: str, tally: Tally, refs: dict[tuple[str, int], Any], stop: threading.Event, seed: int) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=CLIENT_TIMEOUT_S) as client:
        while not stop.is_set():
            stage = rng.choice(STAGES)
            action = rng.choices(["execute", "sleep", "wake", "status", "restart", "reload"], [8, 2, 2, 3, 1, 1])[0]
            headers = {"Idempotency-Key": f"chaos-{seed}-{rng.getrandbits(48):x}"} if rng.random() < 0.3 else {}
            try:
                if action == "execute":
                    i = rng.randrange(len(PAYLOADS))
                    r = client.post(f"/v1/stages/{stage}/execute", json={"payload": PAYLOADS[i]}, headers=headers)
                    wrong = _http_error_ok(r)
                    if r.status_code == 200 and r.json()["output"] != json.loads(dumps(refs[(stage, i)])):
                        wrong = f"execute output differs from the reference for payload {i}"
                elif action == "sleep":
                    r = client.post(f"/v1/stages/{stage}/sleep", json={"level": rng.choice([1, 2])}, headers=headers)
                    wrong = _http_error_ok(r)
                elif action == "wake":
                    r = client.post(f"/v1/stages/{stage}/wake", headers=headers)
                    wrong = _http_error_ok(r)
                elif action == "reload":
                    r = client.post(f"/v1/stages/{stage}/reload", headers=headers)
                    wrong = _http_error_ok(r)
                elif action == "restart":
                    r = client.post(f"/v1/stages/{stage}/restart", headers=headers)
                    wrong = _http_error_ok(r)
                else:
                    r = client.get("/v1/stages")
                    wrong = _http_error_ok(r)
                tally.note(f"http {action}", answered=True, wrong=wrong, status=r.status_code)
            except httpx.TimeoutException:
                tally.note(f"http {action}", answered=False)
            except httpx.HTTPError as exc:
                tally.note(f"http {action}", answered=True, wrong=f"transport error {exc!r}", status="transport")


def api_worker(
    engine: Engine, tally: Tally, refs: dict[tuple[str, int], Any], stop: threading.Event, seed: int
) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        stage = rng.choice(STAGES)
        action = rng.choices(["execute", "sleep", "wake"], [6, 1, 1])[0]
        try:
            if action == "execute":
                i = rng.randrange(len(PAYLOADS))
                out = engine.execute(stage, PAYLOADS[i])
                wrong = "" if out == refs[(stage, i)] else f"execute output differs for payload {i}"
            elif action == "sleep":
                engine.sleep(stage, level=rng.choice([1, 2]))
                wrong = ""
            else:
                engine.wake(stage)
                wrong = ""
            tally.note(f"api {action}", answered=True, wrong=wrong, status="ok")
        except OmniCoreError as exc:
            tally.note(f"api {action}", answered=True, status=type(exc).__name__)
            stop.wait(0.05)  # pacing: a refused caller retries, it does not spin
        except Exception as exc:  # anything else escaping the API is a wrong answer
            tally.note(f"api {action}", answered=True, wrong=f"{type(exc).__name__}: {exc}", status="bug")


FAULTS = ("kill", "stop", "restart2", "slow", "garbage", "foreign")


def injector(
    url: str, engine: Engine, tally: Tally, stop: threading.Event, seed: int, faults: tuple[str, ...] = ()
) -> None:
    rng = random.Random(seed)
    faults = faults or (*FAULTS, *ATTACKS)
    host, port = url.rsplit("/", 1)[-1].split(":")
    while not stop.wait(rng.uniform(1.0, 4.0)):
        fault = rng.choice(faults)
        tally.sent[f"fault {fault}"] += 1
        if fault in ATTACKS:
            threading.Thread(
                target=ATTACKS[fault], args=(url, engine, tally, rng.randrange(1 << 30)), daemon=True
            ).start()
            continue
        if fault in ("kill", "stop"):
            pids = [
                info.get("pid")
                for st in engine.status().values()
                if isinstance(st, dict) and "ranks" in st
                for info in st["ranks"].values()
                if info.get("alive") and info.get("pid")
            ]
            if not pids:
                continue
            pid = rng.choice(pids)
            try:
                os.kill(pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
                if fault == "stop":
                    held_s = rng.uniform(1.0, 15.0)
                    with tally.lock:
                        tally.stops.append((time.monotonic(), time.monotonic() + held_s))
                    tally.background(threading.Timer(held_s, lambda p=pid: _cont(p)))
            except ProcessLookupError:
                pass
        elif fault == "restart2":  # two restarts of one stage at once, as two racing clients would
            stage = rng.choice(STAGES)
            for _ in range(2):
                path = f"/v1/stages/{stage}/restart"
                tally.background(threading.Thread(target=_post, args=(url, path, tally), daemon=True))
        elif fault == "slow":
            socks = [socket.create_connection((host, int(port))) for _ in range(20)]
            for s in socks:
                s.sendall(b"POST /v1/stages/talker/sleep HTTP/1.1\r\nHost: 127")
            tally.background(threading.Timer(30.0, lambda ss=socks: [s.close() for s in ss]))
        elif fault == "garbage":
            with socket.create_connection((host, int(port))) as s:
                s.sendall(rng.randbytes(rng.randint(1, 4000)) + b"\r\n\r\n")
        else:
            r = httpx.post(url + "/v1/stages/talker/sleep", headers={"Host": "evil.example", "Origin": "http://x"})
            tally.note(
                "http foreign",
                answered=True,
                wrong="" if r.status_code == 403 else f"{r.status_code}",
                status=r.status_code,
            )


# ---------------------------------------------------------------- attacks (issue 35)

JUNK_FLOOD_S = 3.0
IDLE_FLOOD = 64
IDLE_HOLD_S = 20.0
W0 = {"name": "w0", "dtype": "float32", "shape": [1024, 128]}  # RUNNER's first weight: 512 KiB
W0_BYTES = 1024 * 128 * 4
SHM_TARGET = Path("/tmp/omni-chaos-shm-target")  # what a symlinked bucket points at: must never change


def junk_flood(url: str, engine: Engine, tally: Tally, seed: int) -> None:
    """Junk frames on the engine's ROUTER for JUNK_FLOOD_S, as any local peer could send."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 100)
    sock.connect(engine.address)
    until, sent = time.monotonic() + JUNK_FLOOD_S, 0
    junk = random.Random(seed).randbytes(64)
    try:
        while time.monotonic() < until:
            with contextlib.suppress(zmq.Again):
                sock.send(junk)
                sent += 1
    finally:
        sock.close(0)
        ctx.term()
    with tally.lock:
        tally.attack_frames += sent


def idle_flood(url: str, engine: Engine, tally: Tally, seed: int) -> None:
    """IDLE_FLOOD keep-alive connections, each after one public request, held idle."""
    host, port = url.rsplit("/", 1)[-1].split(":")
    socks = []
    for _ in range(IDLE_FLOOD):
        try:
            sock = socket.create_connection((host, int(port)), timeout=5)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            sock.recv(4096)
            socks.append(sock)
        except OSError:
            break  # evicted or refused: the guard's business, counted in its metrics
    time.sleep(IDLE_HOLD_S)
    for sock in socks:
        sock.close()


def _refused(kind: str, tally: Tally, call: Any, expect: str) -> None:
    """An attack call must be refused with an engine error: its own refusal (the message has
    `expect`), or the state's (a stage FAILED by a kill, another task in flight)."""
    started = time.monotonic()
    try:
        call()
        tally.note(kind, answered=True, wrong=f"{kind} was accepted", status="accepted")
    except OmniCoreError as exc:
        # Any engine refusal is right (the stage may be FAILED by a kill, busy, asleep), and so
        # is a failure while an injected SIGSTOP held a rank silent; an attack that itself
        # fails the stage is not.
        wrong = ""
        reason = "refused" if expect in str(exc) else "state"
        if isinstance(exc, StageFailedError) and ("InitWeightGroup" in str(exc) or "UpdateWeights" in str(exc)):
            ended = time.monotonic()
            with tally.lock:
                stopped = any(a < ended and b > started for a, b in tally.stops)
            reason = "a rank held by SIGSTOP meanwhile" if stopped else reason
            wrong = "" if stopped else f"{kind} failed the stage: {str(exc)[:200]}"
        tally.note(kind, answered=True, wrong=wrong, status=f"{type(exc).__name__} ({reason})")
    except Exception as exc:
        tally.note(kind, answered=True, wrong=f"{type(exc).__name__}: {exc}", status="bug")


def rendezvous_denied(url: str, engine: Engine, tally: Tally, seed: int) -> None:
    """A rendezvous to hosts outside allowed_weight_group_hosts, by the API and over HTTP."""
    host = random.Random(seed).choice(["169.254.169.254", "10.0.0.1", "192.168.1.1"])
    call = functools.partial(engine.init_weight_group, rng_stage(seed), address=host, port=80, world_size=3)
    _refused("attack rendezvous denied (api)", tally, call, "allowed_weight_group_hosts")
    body = {"master_address": host, "master_port": 80, "rank_offset": 1, "world_size": 3, "backend": "gloo"}
    try:
        r = httpx.post(url + "/init_weights_update_group", json=body, timeout=CLIENT_TIMEOUT_S)
        wrong = "" if r.status_code in (400, 409) else f"{r.status_code}: {r.text[:200]}"
        tally.note("attack rendezvous denied (http)", answered=True, wrong=wrong, status=r.status_code)
    except httpx.TimeoutException:
        tally.note("attack rendezvous denied (http)", answered=False)


def rendezvous_silent(url: str, engine: Engine, tally: Tally, seed: int) -> None:
    """A rendezvous on an allowed host that accepts and never answers: refused at the deadline."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        call = functools.partial(
            engine.init_weight_group, rng_stage(seed), address="127.0.0.1", port=port, world_size=4, timeout_s=8.0
        )
        _refused("attack rendezvous silent", tally, call, "did not complete")


def bad_shm(url: str, engine: Engine, tally: Tally, seed: int) -> None:
    """Shm handles that name what the rank must not open: missing, outside /dev/shm, a symlink
    to a file of ours, a short file, a bucket claimed by pid 1."""
    rng = random.Random(seed)
    tag = f"{os.getpid()}-{seed:x}"
    link, short = Path(f"/dev/shm/omni-chaos-link-{tag}"), Path(f"/dev/shm/omni-chaos-short-{tag}")
    cases = {
        "missing": (f"/dev/shm/omni-chaos-missing-{tag}", os.getpid()),
        "outside": ("../../etc/passwd", os.getpid()),
        "symlink": (str(link), os.getpid()),
        "short": (str(short), os.getpid()),
        "pid 1": (str(short), 1),
    }
    name = rng.choice(sorted(cases))
    handle, pid = cases[name]
    try:
        with contextlib.suppress(FileExistsError):
            link.symlink_to(SHM_TARGET)
        short.write_bytes(b"\x01")
        bucket = {"handle": handle, "nbytes": W0_BYTES, "sender_pid": pid, "tensors": [W0]}
        source = msgspec.convert({"type": "shm", "buckets": [bucket]}, ShmSource)
        version = 10**9 + rng.randrange(10**6)
        call = functools.partial(engine.update_weights, rng_stage(seed), source, version=version)
        _refused(f"attack bad shm ({name})", tally, call, "nothing was written")
        if short.stat().st_size != 1 or SHM_TARGET.read_bytes() != b"\x01":
            tally.note(f"attack bad shm ({name})", answered=True, wrong="a bucket file was changed", status="bug")
    finally:
        link.unlink(missing_ok=True)
        short.unlink(missing_ok=True)


def rng_stage(seed: int) -> str:
    return STAGES[seed % len(STAGES)]


ATTACKS = {
    "junk flood": junk_flood,
    "idle flood": idle_flood,
    "rendezvous denied": rendezvous_denied,
    "rendezvous silent": rendezvous_silent,
    "bad shm": bad_shm,
}


def _cont(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def _post(url: str, path: str, tally: Tally) -> None:
    try:
        r = httpx.post(url + path, timeout=CLIENT_TIMEOUT_S)
        tally.note("http restart (concurrent)", answered=True, wrong=_http_error_ok(r), status=r.status_code)
    except httpx.TimeoutException:
        tally.note("http restart (concurrent)", answered=False)


def recover(engine: Engine, stage: str, deadline_s: float) -> str:
    """Bring a stage back to RUNNING as an operator would; its state after, RUNNING if done."""
    until = time.monotonic() + deadline_s
    state = "?"
    while time.monotonic() < until:
        state = engine.status()[stage]["state"]
        try:
            if state == "RUNNING":
                return state
            if state in ("FAILED", "STOPPED"):
                engine.restart(stage)
            elif state in ("SLEEPING", "PARTIAL"):
                engine.wake(stage)
            elif state == "NEEDS_RELOAD":
                engine.reload_weights(stage)
            else:
                time.sleep(0.5)  # a transition in progress ends at its deadline
        except OmniCoreError:
            time.sleep(0.5)
    return state


def _shm_bytes() -> tuple[int, int]:
    """Files under /dev/shm and their bytes (buckets a run leaves behind would show here)."""
    files = [f for f in Path("/dev/shm").iterdir() if f.is_file()] if Path("/dev/shm").is_dir() else []
    return len(files), sum(f.stat().st_size for f in files if f.exists())


def _sample(samples: list[tuple[float, ...]], started: float) -> None:
    shm_files, shm_bytes = _shm_bytes()
    samples.append(
        (
            time.monotonic() - started,
            run_report.rss_bytes(),
            run_report.descriptors(),
            threading.active_count(),
            shm_files,
            shm_bytes,
        )
    )


def _smaps_kib() -> dict[str, int]:
    """Resident KiB of this process by kind of mapping: the brk heap (glibc's main arena),
    anonymous mappings (other arenas, thread stacks, libzmq's and torch's own), files."""
    kinds = {"heap": 0, "anon": 0, "file": 0}
    kind = "anon"
    try:
        with open("/proc/self/smaps", encoding="ascii", errors="replace") as f:
            for line in f:
                head = line.split()
                if head and "-" in head[0] and len(head) >= 5:
                    name = head[5] if len(head) > 5 else ""
                    kind = "heap" if name == "[heap]" else "file" if name.startswith("/") else "anon"
                elif head and head[0] == "Rss:":
                    kinds[kind] += int(head[1])
    except OSError:
        pass
    return kinds


def malloc_trim() -> bool:
    """Hand glibc's free memory back to the kernel (what RSS keeps that no object holds)."""
    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):
        return False


def malloc_arenas() -> str:
    """glibc's heaps in one line: arenas, bytes taken from the system, bytes of them free (held
    for reuse, not by any object), from malloc_info(3); empty where that is not glibc."""
    import re
    import tempfile

    try:
        libc = ctypes.CDLL(None)
        libc.fopen.restype = ctypes.c_void_p
        with tempfile.NamedTemporaryFile(suffix=".xml") as f:
            fp = libc.fopen(f.name.encode(), b"w")
            libc.malloc_info(0, ctypes.c_void_p(fp))
            libc.fclose(ctypes.c_void_p(fp))
            xml = Path(f.name).read_text()
    except (OSError, AttributeError):
        return ""
    tail = xml[xml.rfind("</heap>") :]
    current = sum(int(n) for n in re.findall(r'<system type="current" size="(\d+)"', tail))
    free = sum(int(n) for n in re.findall(r'<total type="(?:fast|rest)" count="\d+" size="(\d+)"', tail))
    mmapped = sum(int(n) for n in re.findall(r'<total type="mmap" count="\d+" size="(\d+)"', tail))
    return (
        f"glibc malloc: {xml.count('<heap nr=')} arenas, {current / 2**20:.1f} MiB from the system, "
        f"{free / 2**20:.1f} MiB of it free (held for reuse), {mmapped / 2**20:.1f} MiB in direct mmaps"
    )


class HeapGrowth:
    """tracemalloc snapshots of the server process: what grew since the first one, by the
    allocating line and its callers, written after each sample (a run can be cut short)."""

    def __init__(self, path: str | None, frames: int = 6) -> None:
        self.path = path
        self.first: tracemalloc.Snapshot | None = None
        if path:
            tracemalloc.start(frames)

    def sample(self, t_s: float) -> None:
        if not self.path:
            return
        snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
        if self.first is None:
            self.first = snap
            return
        stats = snap.compare_to(self.first, "traceback")[:15]
        traced, peak = tracemalloc.get_traced_memory()
        before, kinds = run_report.rss_bytes(), _smaps_kib()
        malloc_trim()
        after = run_report.rss_bytes()
        lines = [
            f"# t {t_s:.0f} s: traced {traced / 2**20:.1f} MiB (peak {peak / 2**20:.1f} MiB); RSS "
            f"{before / 2**20:.1f} MiB by kind {kinds} KiB, {after / 2**20:.1f} MiB after malloc_trim(0)"
        ]
        for stat in stats:
            lines.append(f"{stat.size_diff / 2**10:+.0f} KiB, {stat.count_diff:+d} blocks")
            lines.extend(f"    {line}" for line in stat.traceback.format()[-12:])
        Path(self.path).write_text("\n".join(lines) + "\n")


def _summary(samples: list[tuple[float, ...]], counters: dict[str, Any], tally: Tally) -> list[str]:
    """Start and end of each sampled figure, and what the engine counted of the attacks."""
    (_, rss0, fds0, threads0, files0, shm0), (_, rss1, fds1, threads1, files1, shm1) = samples[0], samples[-1]
    arenas = malloc_arenas()
    malloc_trim()
    trimmed = run_report.rss_bytes()
    return [
        f"- server process at start -> end: RSS {rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB; descriptors "
        f"{fds0} -> {fds1}; threads {threads0} -> {threads1}; /dev/shm {files0} files {shm0 / 2**20:.1f} MiB -> "
        f"{files1} files {shm1 / 2**20:.1f} MiB",
        f"- {arenas}; RSS after malloc_trim(0) at the end: {trimmed / 2**20:.1f} MiB",
        f"- junk frames sent by the floods: {tally.attack_frames}; the engine counted bad_replies "
        f"{counters.get('bad_replies')}, unknown_peers {counters.get('unknown_peers')}",
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--http-clients", type=int, default=6)
    p.add_argument("--api-clients", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--recover-s", type=float, default=120.0)
    p.add_argument("--out", default=None)
    p.add_argument("--tracemalloc", default=None, help="write what the heap grew by, and where, to this file")
    p.add_argument("--faults", default="", help="comma-separated faults and attacks to inject (default: all)")
    args = p.parse_args()
    heap = HeapGrowth(args.tracemalloc)
    commit = run_report.commit()
    config = _config()
    tally = Tally()
    samples: list[tuple[float, ...]] = []
    SHM_TARGET.write_bytes(b"\x01")
    SHM_TARGET.chmod(0o600)
    engine = Engine(config.stages)
    try:
        refs = {(s, i): engine.execute(s, payload) for s in STAGES for i, payload in enumerate(PAYLOADS)}
        app = create_app(engine, config)
        with serve_in_thread(app) as running:
            stop = threading.Event()
            started = time.monotonic()
            threads = [
                threading.Thread(target=http_worker, args=(running.url, tally, refs, stop, args.seed + i))
                for i in range(args.http_clients)
            ]
            threads += [
                threading.Thread(target=api_worker, args=(engine, tally, refs, stop, args.seed + 100 + i))
                for i in range(args.api_clients)
            ]
            faults = tuple(f for f in args.faults.split(",") if f)
            injecting = (running.url, engine, tally, stop, args.seed, faults)
            threads.append(threading.Thread(target=injector, args=injecting))
            for t in threads:
                t.start()
            while time.monotonic() - started < args.minutes * 60:
                _sample(samples, started)
                heap.sample(samples[-1][0])
                stop.wait(10.0)
            stop.set()
            for t in threads:
                t.join(CLIENT_TIMEOUT_S + 30)
            stuck_threads = sum(t.is_alive() for t in threads) + tally.join_background(CLIENT_TIMEOUT_S)
            for pid_state in engine.status().values():  # let every stopped rank go on, so recovery can see it
                for info in (pid_state.get("ranks") or {}).values() if isinstance(pid_state, dict) else ():
                    if info.get("pid"):
                        _cont(info["pid"])
            final = {s: recover(engine, s, args.recover_s) for s in STAGES}
            _sample(samples, started)
            answers_ok = all(engine.execute(s, PAYLOADS[0]) == refs[(s, 0)] for s in STAGES if final[s] == "RUNNING")
            counters = engine.status()["_engine"]
    finally:
        engine.shutdown()
    wedged = [s for s, st in final.items() if st != "RUNNING"]
    sent = sum(n for k, n in tally.sent.items() if not k.startswith("fault"))
    answered = sum(tally.answered.values())
    faults = {k.removeprefix("fault "): n for k, n in tally.sent.items() if k.startswith("fault")}
    targets = [
        ("wrong answers", str(len(tally.wrong)), not tally.wrong),
        ("lost calls", str(len(tally.lost)), not tally.lost),
        ("stages left wedged", f"{len(wedged)} {wedged or ''}", not wedged),
        ("client threads stuck at the end", str(stuck_threads), stuck_threads == 0),
        ("outputs after recovery equal the reference", str(answers_ok), answers_ok),
    ]
    lines = [
        "# Chaos run over HTTP and the Python API",
        "",
        f"- command: `.venv/bin/python scripts/chaos_http.py --minutes {args.minutes:g} --http-clients "
        f"{args.http_clients} --api-clients {args.api_clients} --seed {args.seed}"
        + (f" --faults '{args.faults}'" if args.faults else "")
        + "`",
        run_report.machine_line(commit),
        "- stages: talker (2 ranks) and decoder (1 rank), synthetic runner, portable backend, deadline_s 10",
        f"- faults injected: {dict(sorted(faults.items()))}",
        f"- calls sent: {sent}; answered: {answered}; lost: {len(tally.lost)}; wrong: {len(tally.wrong)}",
        f"- final states after recovery: {final}",
        *_summary(samples, counters, tally),
        "",
        "## Answers by call and outcome",
        "",
        *[f"- {k}: {n}" for k, n in sorted(tally.statuses.items())],
        "",
        "## Wrong answers",
        "",
        *([f"- {w}" for w in tally.wrong[:30]] or ["none"]),
        "",
        "## RSS and descriptors of the server process (engine, HTTP server, clients) over time",
        "",
        "| t (s) | RSS (MiB) | descriptors | threads | /dev/shm files | /dev/shm MiB |",
        "|---|---|---|---|---|---|",
        *[
            f"| {t:.0f} | {rss / 2**20:.1f} | {fds} | {threads} | {files} | {shm / 2**20:.1f} |"
            for t, rss, fds, threads, files, shm in samples
        ],
        "",
    ]
    return run_report.finish(lines, targets, args.out)


if __name__ == "__main__":
    sys.exit(main())
