"""What a trace's LinkPlanned records must show about link plans (P-18, `engine/link_plan.py`),
checked against the trace's other lines before anything is replayed (the trace spec
replays the ranks' answers; the plan is the engine's, made after the stage core traced
the send):

- a plan follows the StageSent of its rank, task and command (a Sleep or Wake), one plan each;
- its rank's own GPU is the link GPU its RankSpawned named, its `own` index a GPU of `visible`;
- links only to a rank that may be sent them (MULTI_PATH declared, its stage's spec allows
  them), at most MAX_LINKS, the own link first and once, each peer a GPU of `visible` that
  its Hello reported reachable (`relay_peers`), each named once;
- a peer's GPU is idle when the task's plan is made (its first send): no rank of a stage
  with a task in flight runs on it, the commanding stage's own included, and no plan of
  another task in flight, nor another rank of this one, was lent it; a GPU stays lent
  until its task ends (TaskEnded) or its stage restarts or stops;
- a resent command carries the plan its first send had;
- the bytes per link are the shares' split of the rank's pool bytes (`share_bytes`), which
  they sum to;
- `incoming_bytes` only on a Sleep, and only to a rank that declared SWAP.

`LinkChecks(lines, stage)` reads every stage's lines once (a GPU is shared across stages);
`why(n)` is the reason line n of `stage` is refuted ("" when it is not). trace_export turns
it into a refuted event, so the replay stops there with the reason.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from omni_core.engine.link_plan import share_bytes
from omni_core.fsm import trace_records as T
from omni_core.protocol import MAX_LINKS

Task = tuple[str, str]  # (stage, task id)
PLANNED = ("Sleep", "Wake")  # the commands a plan is written for


class LinkChecks:
    """The checks above, over one pass of every stage's lines."""

    def __init__(self, lines: list[T.TraceLine], stage: str) -> None:
        self._why: dict[int, str] = {}
        self._gpus: dict[tuple[str, int], str] = {}  # (stage, rank) -> its link GPU (RankSpawned)
        self._in_flight: dict[str, set[str]] = {}  # stage -> its tasks issued and not ended
        self._lent: dict[str, tuple[Task, int]] = {}  # GPU -> (task, rank) it is lent to
        self._plans: dict[tuple[str, str, int], tuple[T.PlannedLink, ...]] = {}
        # (stage, rank, task, command) of each Sleep and Wake sent and not yet planned: the
        # engine writes a step's plans after the core's sends (at most one per rank each).
        self._unplanned: Counter[tuple[str, int, str, str]] = Counter()
        for n, line in enumerate(lines, start=1):
            why = self._line(line)
            if why and line.stage == stage:
                self._why[n] = why

    def why(self, n: int) -> str:
        return self._why.get(n, "")

    def _line(self, line: T.TraceLine) -> str:
        r: Any = line.record
        if not line.is_engine:
            return ""
        match r:
            case T.RankSpawned():
                self._gpus[line.stage, r.rank] = r.link_gpu
            case T.StageIssued():
                self._in_flight.setdefault(line.stage, set()).add(r.task_id)
            case T.StageSent() if r.command in PLANNED:
                self._unplanned[line.stage, r.rank, r.task_id, r.command] += 1
            case T.TaskEnded():
                self._end(line.stage, r.task_id)
            case T.StageRestarted() | T.StageStopped():
                for task_id in list(self._in_flight.get(line.stage, ())):
                    self._end(line.stage, task_id)
            case T.LinkPlanned():
                return self._plan(line.stage, r)
        return ""

    def _end(self, stage: str, task_id: str) -> None:
        self._in_flight.get(stage, set()).discard(task_id)
        self._lent = {gpu: held for gpu, held in self._lent.items() if held[0] != (stage, task_id)}
        self._plans = {k: v for k, v in self._plans.items() if k[:2] != (stage, task_id)}
        for sent in [k for k in self._unplanned if (k[0], k[2]) == (stage, task_id)]:
            del self._unplanned[sent]  # an older engine's sends, never planned: nothing owed

    def _plan(self, stage: str, r: T.LinkPlanned) -> str:
        what = f"the {r.command} {r.task_id!r} to rank {r.rank}"
        sent = (stage, r.rank, r.task_id, r.command)
        if r.command not in PLANNED or self._unplanned[sent] <= 0:
            return f"{what} has a link plan, but no StageSent of that command to that rank precedes it unplanned"
        self._unplanned[sent] -= 1
        why = self._own(what, stage, r) or self._incoming(what, r)
        if why:
            return why
        first = self._plans.get((stage, r.task_id, r.rank))
        if first is not None:  # a resent command: the plan its first send had
            return (
                ""
                if first == r.links
                else f"{what} was resent with links {_shown(r.links)}; its first had {_shown(first)}"
            )
        self._plans[stage, r.task_id, r.rank] = r.links
        if not r.links:
            return ""
        # The task's plan for this rank is made now: its peers must be idle.
        return self._shape(what, r) or self._bytes(what, r) or self._idle(what, stage, r)

    def _own(self, what: str, stage: str, r: T.LinkPlanned) -> str:
        if not 0 <= r.own < len(r.visible):
            return f"{what} names its own GPU at index {r.own}, but it sees {len(r.visible)} GPU(s)"
        spawned = self._gpus.get((stage, r.rank))
        if spawned is not None and spawned != r.visible[r.own]:
            return f"{what} names its own GPU {r.visible[r.own]!r}, but its RankSpawned put it on {spawned!r}"
        return ""

    @staticmethod
    def _incoming(what: str, r: T.LinkPlanned) -> str:
        if r.incoming_bytes and r.command != "Sleep":
            return f"{what} carries incoming_bytes {r.incoming_bytes}: only a swap's outgoing Sleep does"
        if r.incoming_bytes and not r.swap:
            return (
                f"{what} carries incoming_bytes {r.incoming_bytes}, but the rank did not declare SWAP "
                "(such a worker refuses that Sleep as BAD_MESSAGE)"
            )
        return ""

    @staticmethod
    def _shape(what: str, r: T.LinkPlanned) -> str:
        if not r.multi_path:
            return f"{what} has links, but the rank may not be sent any (no MULTI_PATH, or its stage turned it off)"
        peers = [link.peer for link in r.links]
        if len(peers) > MAX_LINKS or peers[0] is not None or None in peers[1:]:
            return f"{what} has links {_shown(r.links)}: the own link first and once, at most {MAX_LINKS} in all"
        for peer in peers[1:]:
            assert peer is not None
            if peer >= len(r.visible) or peer == r.own or peer not in r.relay_peers:
                return (
                    f"{what} has a link through cuda:{peer}, which is not a peer its Hello reported "
                    f"reachable (relay peers {list(r.relay_peers)} of {len(r.visible)} GPU(s), own cuda:{r.own})"
                )
        if len(set(peers)) != len(peers):
            return f"{what} names a peer twice in its links {_shown(r.links)}"
        return ""

    @staticmethod
    def _bytes(what: str, r: T.LinkPlanned) -> str:
        carried = tuple(link.nbytes for link in r.links)
        split = share_bytes(r.pool_bytes, [link.share for link in r.links])
        if carried != split:
            return (
                f"{what} spreads {list(carried)} bytes over its links (sum {sum(carried)}); its shares split "
                f"the rank's {r.pool_bytes} pool bytes as {list(split)}"
            )
        return ""

    def _idle(self, what: str, stage: str, r: T.LinkPlanned) -> str:
        busy = {
            self._gpus[other, rank]: other
            for other, tasks in self._in_flight.items()
            if tasks
            for (named, rank) in self._gpus
            if named == other
        }
        for link in r.links[1:]:
            assert link.peer is not None
            gpu = r.visible[link.peer]
            if gpu in busy:
                return (
                    f"{what} is lent GPU {gpu!r}, on which stage {busy[gpu]!r} runs a rank with a task in flight "
                    "(its link is busy with that stage's own copies)"
                )
            if gpu in self._lent:
                (other, task_id), rank = self._lent[gpu]
                return (
                    f"{what} is lent GPU {gpu!r}, lent already to rank {rank} for task {task_id!r} of stage "
                    f"{other!r}, still in flight: a GPU's link is lent to one command's rank at a time"
                )
        for link in r.links[1:]:
            assert link.peer is not None
            self._lent[r.visible[link.peer]] = ((stage, r.task_id), r.rank)
        return ""


def _shown(links: tuple[T.PlannedLink, ...]) -> str:
    return str([[link.peer, link.share] for link in links])
