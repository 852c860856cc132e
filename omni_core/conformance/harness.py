"""The suite's side of the wire: one ROUTER socket, the worker processes started on it, and
receives that never wait without bound.

Every receive has a deadline, and while waiting the harness watches the worker process: a
worker that dies is reported with its exit code and the end of its output, at once, not
after the deadline. Replies are matched to commands by `task_id`; a reply beyond the number
of copies of its command that were sent is recorded as a stray (P-1).
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import textwrap
import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from omni_core.conformance.targets import WorkerFactory, WorkerProcess, launch
from omni_core.protocol import Ack, Command, Hello, Message, Nack, ProtocolError, Reply, WorkerState, decode, encode
from omni_core.transport import ENGINE_SOCKET_HWM

POLL_SLICE_MS = 50
MAX_REPR_CHARS = 700
MAX_TEXT_CHARS = 4000  # our own text, e.g. a worker's last output lines


@dataclass(frozen=True)
class SuiteOptions:
    """Knobs of one suite run. The defaults suit the reference worker on a loaded CPU."""

    start_timeout_s: float = 60.0  # until Hello (a worker importing torch takes seconds)
    reply_timeout_s: float = 10.0  # until the one terminal reply of a command
    exit_timeout_s: float = 10.0  # from the Shutdown Ack until the process has exited
    quiet_s: float = 0.3  # how long "no further reply" is watched for
    case_timeout_s: float = 120.0  # one whole case, however many replies it waits for
    epoch: int = 3  # epoch the workers start in (> 0, so an older one exists)
    execute_payload: Any = field(default_factory=lambda: {"seed": 1, "batch": 1})
    # A target (string or factory) whose worker fails at start-up and greets in FAILED, to
    # check that Shutdown leaves FAILED; None: the built-in one for `synthetic`, else skipped.
    failing_worker: Any = None
    # A target whose worker greets NEEDS_RELOAD (weights loaded, not to be served: a restart
    # under a version floor, dummy weights); None: the built-in one for `synthetic`, else skipped.
    needs_reload_worker: Any = None
    # A factory of memory-pressure hooks (`omni_core.conformance.pressure`), or its import
    # path, for the P-16 NO_MEMORY case; None: the built-in one for `synthetic`, else skipped.
    memory_pressure: Any = None
    # The generated sequences of P-11/generated_commands_match_the_tables: how many, and the
    # seed they are drawn from (a failure names it; the same seed draws the same sequences).
    model_examples: int = 50
    model_seed: int = 0

    def __post_init__(self) -> None:
        if self.model_examples < 0:
            raise ValueError(f"model_examples must be >= 0 (0: no generated sequences), got {self.model_examples}")
        if self.epoch < 1:
            raise ValueError(f"epoch must be >= 1 so that an older epoch exists, got {self.epoch}")
        for name in ("start_timeout_s", "reply_timeout_s", "exit_timeout_s", "quiet_s", "case_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}: no receive waits without bound")


class CaseFailure(AssertionError):
    """A requirement not met: what was wrong, what the suite sent, what came back."""

    def __init__(
        self, problem: str, *, sent: Any = None, got: Any = None, expected: Any = None, silent: bool = False
    ) -> None:
        super().__init__(problem)
        self.problem = problem
        self.sent = sent
        self.got = got
        self.expected = expected
        # A live worker let a deadline pass: the runner stops there instead of letting every
        # later case wait out the same deadline (one clear failure, not ten after minutes).
        self.silent = silent


class CaseSkip(Exception):
    """The case does not apply to this worker (a capability it does not declare)."""


class StartError(RuntimeError):
    """The worker did not come up: no Hello, a first message that is not Hello, or death."""


@dataclass(frozen=True)
class Undecodable:
    """Bytes from the worker that are not a valid protocol message."""

    data: bytes
    error: str

    @property
    def task_id(self) -> None:
        return None

    def __repr__(self) -> str:
        return f"<undecodable {len(self.data)} bytes {self.data[:40]!r}: {self.error}>"


def show(obj: Any) -> str:
    """A message, bytes or text, shortened for a failure report."""
    if obj is None:
        return "nothing"
    if isinstance(obj, (bytes, bytearray)):
        text = f"raw bytes {bytes(obj[:48])!r}{'...' if len(obj) > 48 else ''} ({len(obj)} bytes)"
    elif isinstance(obj, (list, tuple)) and obj and all(isinstance(o, (msgspec.Struct, Undecodable)) for o in obj):
        text = "; ".join(show(o) for o in obj)
    else:
        text = str(obj) if isinstance(obj, str) else repr(obj)
    limit = MAX_TEXT_CHARS if isinstance(obj, str) else MAX_REPR_CHARS
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Peer:
    """One worker process on the harness: its rank, Hello, inbox and current epoch."""

    def __init__(self, harness: Harness, rank: int, epoch: int, process: WorkerProcess) -> None:
        self.harness = harness
        self.rank = rank
        self.epoch = epoch  # the newest epoch this peer has been sent; commands use it
        self.process = process
        self.identity: bytes | None = None
        self.hello: Hello | None = None
        self.inbox: deque[Message | Undecodable] = deque()
        self.sent: Counter[str] = Counter()
        self.replies: Counter[str] = Counter()
        self.strays: list[Message | Undecodable] = []
        # The latest first answer (not a copy's) that says the worker's state, so that a
        # Status contradicting it can be blamed on the right command.
        self.last_stated: Ack | Nack | None = None
        self.greeting_state = WorkerState.ACTIVE  # what its Hello must say

    def __repr__(self) -> str:
        return f"worker rank {self.rank} (pid {self.process.pid})"

    @property
    def tags(self) -> tuple[str, ...]:
        return self.hello.tags if self.hello else ()

    @property
    def capabilities(self) -> frozenset[str]:
        return frozenset(c.value for c in self.hello.capabilities) if self.hello else frozenset()

    # ------------------------------------------------------------------ sending

    def send(self, command: Command) -> None:
        self.epoch = max(self.epoch, command.epoch)
        self.sent[command.task_id] += 1
        self._send(encode(command))

    def send_unless_gone(self, command: Command) -> bool:
        """Send `command`; False when the worker has already closed its socket (it may be exiting).

        Only for a command that may legitimately find the worker gone, such as a second Shutdown:
        a worker can answer the first and disconnect before the suite's next send is scheduled.
        A command never delivered owes no reply, so it is not counted.
        """
        if not self._send(encode(command), gone_ok=True):
            return False
        self.epoch = max(self.epoch, command.epoch)
        self.sent[command.task_id] += 1
        return True

    def send_raw(self, data: bytes, expect_task_id: str = "-") -> None:
        """Bytes that are not a valid command; one refusal under `expect_task_id` is due."""
        self.sent[expect_task_id] += 1
        self._send(data)

    def _send(self, data: bytes, *, gone_ok: bool = False) -> bool:
        """Put `data` on the worker's socket; False only when `gone_ok` and the worker's socket
        is gone (ROUTER_MANDATORY says EHOSTUNREACH), a CaseFailure for any other failure."""
        assert self.identity is not None, "send before Hello"
        try:
            self.harness.sock.send_multipart([self.identity, data], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            if gone_ok and exc.errno == zmq.EHOSTUNREACH:
                return False
            code = self.process.exit_code()
            raise CaseFailure(
                f"cannot send to {self}: {exc} (process exit code {code})",
                sent=data,
                got=f"process exit code {code}{self._output()}",
            ) from None
        return True

    # ------------------------------------------------------------------ receiving

    def reply(self, task_id: str, *, sent: Any = None, timeout_s: float | None = None) -> Message:
        """The next reply carrying `task_id`, within the reply deadline."""
        return self._wait(lambda m: getattr(m, "task_id", None) == task_id, sent, timeout_s)

    def next_message(self, *, sent: Any = None, timeout_s: float | None = None) -> Message:
        return self._wait(lambda m: True, sent, timeout_s)

    def request(self, command: Command, timeout_s: float | None = None) -> Message:
        self.send(command)
        return self.reply(command.task_id, sent=command, timeout_s=timeout_s)

    def collect(self, seconds: float) -> list[Message | Undecodable]:
        """Everything that arrives from this peer within `seconds` (and what is queued)."""
        deadline = time.monotonic() + seconds
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                break
            self.harness.pump(min(left_ms, POLL_SLICE_MS))
        self.harness.pump(0)
        out = list(self.inbox)
        self.inbox.clear()
        return out

    def _wait(self, match: Any, sent: Any, timeout_s: float | None) -> Message:
        timeout_s = self.harness.options.reply_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        case_deadline = self.harness.case_deadline
        if case_deadline is not None and case_deadline < deadline:
            deadline = case_deadline
            timeout_s = max(0.0, case_deadline - time.monotonic())
            if timeout_s <= 0:
                raise CaseFailure(
                    f"the case ran past its limit of {self.harness.options.case_timeout_s:g} s "
                    "(case_timeout_s) before this command was answered",
                    sent=sent,
                    silent=True,
                )
        while True:
            for i, message in enumerate(self.inbox):
                if isinstance(message, Undecodable):
                    del self.inbox[i]
                    raise CaseFailure(
                        "the worker sent bytes that are not a valid protocol message", sent=sent, got=message
                    )
                if match(message):
                    del self.inbox[i]
                    return message
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                running = self.process.alive()
                alive = "still running" if running else f"exited ({self.process.exit_code()})"
                what = f"{type(sent).__name__} {sent.task_id!r}" if isinstance(sent, Message) else "it"
                raise CaseFailure(
                    f"no reply from {self} within {timeout_s:.3g} s to {what}; the process is {alive}",
                    sent=sent,
                    got=list(self.inbox) or None,
                    silent=running,
                )
            if not self.harness.pump(min(left_ms, POLL_SLICE_MS)) and not self.process.alive():
                self.harness.pump(0)  # what it sent before dying is still worth matching
                if not any(match(m) or isinstance(m, Undecodable) for m in self.inbox):
                    code = self.process.exit_code()
                    raise CaseFailure(
                        f"{self} died with exit code {code} instead of replying",
                        sent=sent,
                        got=f"process exit, code {code}{self._output()}",
                    )

    def _output(self) -> str:
        """The end of the worker's output, on lines of its own (the first line stays short)."""
        tail = self.process.output_tail()
        return "\n    worker output ends:\n" + textwrap.indent(tail, "    | ") if tail else ""

    def note(self, message: Message | Undecodable) -> None:
        """Count a reply against the copies sent of its command; keep it in the inbox."""
        if isinstance(message, Reply) and not isinstance(message, Hello):
            self.replies[message.task_id] += 1
            if self.replies[message.task_id] > self.sent[message.task_id]:
                self.strays.append(message)
            elif isinstance(message, (Ack, Nack)) and self.sent[message.task_id] == 1:
                self.last_stated = message  # a copy's reply may be a cached one, of an older state
        elif isinstance(message, Hello):
            self.strays.append(message)  # a second Hello
        self.inbox.append(message)


class Harness:
    """A ROUTER bound on ipc:// in a private directory; workers started by one factory."""

    def __init__(self, factory: WorkerFactory, options: SuiteOptions) -> None:
        self.factory = factory
        self.options = options
        self.directory = tempfile.mkdtemp(prefix="omni-conf-", dir="/tmp")
        self.address = f"ipc://{os.path.join(self.directory, 'router.sock')}"
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, ENGINE_SOCKET_HWM)
        self.sock.setsockopt(zmq.RCVHWM, ENGINE_SOCKET_HWM)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone worker raises
        self.sock.bind(self.address)
        self.peers: dict[bytes, Peer] = {}
        self._starting: list[Peer] = []
        self._unclaimed: list[tuple[bytes, Message | Undecodable]] = []
        self._log_ids = itertools.count()
        self.case_deadline: float | None = None  # monotonic time the running case must end by

    # ------------------------------------------------------------------ starting

    def start(
        self,
        ranks: Iterable[int],
        epoch: int,
        *,
        factory: WorkerFactory | None = None,
        state: WorkerState = WorkerState.ACTIVE,
    ) -> list[Peer]:
        """Start one worker per rank (all at once) and wait for each one's Hello, which must
        say `state` (a worker whose start-up fails greets in FAILED)."""
        peers = []
        for rank in ranks:
            log = os.path.join(self.directory, f"worker-{rank}-{next(self._log_ids)}.log")
            try:
                process = launch(factory or self.factory, self.address, rank, epoch, log)
            except Exception as exc:
                raise StartError(f"the worker factory failed for rank {rank}: {type(exc).__name__}: {exc}") from exc
            peer = Peer(self, rank, epoch, process)
            peer.greeting_state = state
            peers.append(peer)
            self._starting.append(peer)
        deadline = time.monotonic() + self.options.start_timeout_s
        try:
            while any(p.hello is None for p in peers):
                for peer in peers:
                    if peer.hello is None and not peer.process.alive():
                        self.pump(0)
                        if peer.hello is None:
                            raise StartError(
                                f"{peer} exited with code {peer.process.exit_code()} before its Hello{peer._output()}"
                            )
                if time.monotonic() > deadline:
                    late = [p.rank for p in peers if p.hello is None]
                    raise StartError(
                        f"no Hello from rank(s) {late} within {self.options.start_timeout_s:g} s "
                        f"(address {self.address}){peers[0]._output()}"
                    )
                self.pump(POLL_SLICE_MS)
                self._check_unclaimed()
        except StartError:
            for peer in peers:
                peer.process.kill()
            raise
        finally:
            self._starting = [p for p in self._starting if p not in peers]
        return peers

    def _check_unclaimed(self) -> None:
        if not self._unclaimed:
            return
        identity, message = self._unclaimed[0]
        raise StartError(
            f"the first message from a new worker (identity {identity!r}) was not a Hello "
            f"for a rank being started ({[p.rank for p in self._starting]}): {show(message)}"
        )

    # ------------------------------------------------------------------ receiving

    def pump(self, timeout_ms: int) -> bool:
        """Receive what is there (waiting up to `timeout_ms` for the first); True if any."""
        got = False
        while self.sock.poll(timeout_ms if not got else 0):
            frames = self.sock.recv_multipart()
            got = True
            identity, data = frames[0], frames[-1]
            try:
                message: Message | Undecodable = decode(data)
            except ProtocolError as exc:
                message = Undecodable(bytes(data), exc.detail)
            except Exception as exc:  # no bytes from a worker may end the suite
                message = Undecodable(bytes(data), f"{type(exc).__name__}: {str(exc)[:300]}")
            peer = self.peers.get(identity)
            if peer is not None:
                peer.note(message)
            else:
                self._greet(identity, message)
        return got

    def _greet(self, identity: bytes, message: Message | Undecodable) -> None:
        waiting = [p for p in self._starting if p.hello is None]
        if isinstance(message, Hello):
            # Match by the rank it names; with one worker starting, any Hello is its own (the
            # greeting case then checks the rank it names).
            match = [p for p in waiting if p.rank == message.rank] or (waiting if len(waiting) == 1 else [])
            if match:
                peer = match[0]
                peer.identity, peer.hello = identity, message
                self.peers[identity] = peer
                if message.state is not peer.greeting_state:
                    raise StartError(
                        f"{peer} greeted in state {message.state.value}, not "
                        f"{peer.greeting_state.value}: {message.detail or '(no detail)'}"
                    )
                return
        self._unclaimed.append((identity, message))

    def drain(self) -> None:
        """Drop whatever is queued (between cases; strays were already counted)."""
        self.pump(0)
        for peer in self.peers.values():
            peer.inbox.clear()

    def strays(self) -> list[tuple[Peer, Message | Undecodable]]:
        return [(p, m) for p in self.peers.values() for m in p.strays]

    def close(self) -> None:
        for peer in self.peers.values():
            peer.process.kill()
        for peer in self._starting:
            peer.process.kill()
        self.sock.close(0)
        self.ctx.term()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> Harness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
