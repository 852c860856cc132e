"""A scripted walk through both lifecycles on the sans-IO cores, printing every transition.

One stage with three ranks: start, sleep (level 1), wake, then a level-2 sleep, wake and
weight reload. Along the way the network duplicates an ACK, delivers an ACK from an older
epoch, and the caller retries a task with the same task_id: the output shows each being
counted and ignored, and the stage committing only on a complete ACK set. No processes, no
sockets, no memory: this is the protocol logic alone, deterministic by construction.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TextIO

import msgspec

from omni_core.fsm import Outbound, StageCore, StageStep, WorkerCore
from omni_core.fsm.effects import Effect
from omni_core.protocol import Hello, MemoryReport, Reply, decode, encode


class Walkthrough:
    def __init__(self, ranks: int = 3, out: TextIO = sys.stdout) -> None:
        self.out = out
        self.now = 0.0
        self.stage = StageCore("talker", ranks)
        self.workers = [WorkerCore(rank) for rank in range(ranks)]
        self.failures: list[str] = []

    def say(self, node: str, event: str, state: str) -> None:
        self.out.write(f"{self.now:6.3f}s  {node:<9} {event:<52} {state}\n")

    # ---- plumbing: every message really goes through the codec, as on the wire

    def deliver(self, sends: tuple[Outbound, ...]) -> list[Reply]:
        replies: list[Reply] = []
        for out in sends:
            worker = self.workers[out.rank]
            command = decode(encode(out.command))
            before = worker.state.value
            step = worker.on_command(command)
            replies += step.replies
            if step.effect is not None:
                replies += self.perform(worker, step.effect)
            self.say(f"rank {out.rank}", f"{type(command).__name__}({command.task_id})",
                     f"{before} -> {worker.state.value}")  # fmt: skip
        return [decode(encode(r)) for r in replies]  # type: ignore[misc]

    def perform(self, worker: WorkerCore, effect: Effect) -> tuple[Reply, ...]:
        self.now += 0.001
        # A worker shell measures its pools around every effect; the stage trusts no ACK without.
        memory = MemoryReport(pool_bytes_before={}, pool_bytes_after={})
        return worker.on_done(effect.task_id, memory=memory, duration_s=0.001).replies

    def feed(self, replies: list[Reply], label: str = "") -> StageStep:
        step = StageStep()
        for reply in replies:
            before = self.stage.state.value
            got = self.stage.on_reply(reply, self.now)
            step = got if got.outcome or got.sends else step
            kind = f"{type(reply).__name__} from rank {reply.rank} ({reply.task_id}, epoch {reply.epoch})"
            self.say("stage", f"{label}{kind}", f"{before} -> {self.stage.state.value}")
        return step

    def run_task(self, title: str, call: Callable[[], StageStep], *, duplicate: bool = False,
                 stale: bool = False) -> None:  # fmt: skip
        self.out.write(f"\n== {title}\n")
        before = self.stage.state.value
        step = call()
        self.say("stage", f"call -> {len(step.sends)} command(s) out", f"{before} -> {self.stage.state.value}")
        replies = self.deliver(step.sends)
        if stale and replies:
            old = msgspec.structs.replace(replies[0], epoch=self.stage.epoch - 1)
            self.feed([old], "network replays old-epoch ")
        if duplicate and replies:
            # The network delivers the first ACK twice, the copy before the last original.
            replies.insert(len(replies) - 1, replies[0])
        final = self.feed(replies)
        outcome = final.outcome or step.outcome
        if outcome is None or not outcome.ok:
            self.failures.append(f"{title}: {outcome}")
            self.out.write(f"   !! task did not complete: {outcome}\n")
            return
        self.out.write(f"   => {outcome.command} {outcome.task_id}: {outcome.status.value}, stage "
                       f"{outcome.state.value}, {len(outcome.acks)} ACK(s)\n")  # fmt: skip

    def run(self) -> int:
        self.out.write("omni-core lifecycle walkthrough (sans-IO cores, 3 ranks, in-memory network)\n")
        self.out.write(f"{'time':>7}  {'node':<9} {'event':<52} state\n")
        self.stage.start(self.now, 10.0)
        for worker in self.workers:
            worker.loaded()
            hello = Hello(task_id="hello", epoch=self.stage.epoch, rank=worker.rank, pid=0,
                          device="none", backend="none", tags=worker.tags)  # fmt: skip
            before = self.stage.state.value
            self.stage.on_hello(hello, self.now)
            self.say("stage", f"Hello from rank {worker.rank}", f"{before} -> {self.stage.state.value}")
        # A restart bumps the epoch, which makes the stale-ACK scene below real.
        self.stage.stop(self.now)
        self.stage.restart(self.now, 10.0)
        self.workers = [WorkerCore(w.rank, epoch=self.stage.epoch) for w in self.workers]
        self.out.write(f"\n== restart: epoch {self.stage.epoch}\n")
        for worker in self.workers:
            worker.loaded()
            self.stage.on_hello(Hello(task_id="hello", epoch=self.stage.epoch, rank=worker.rank,
                                      pid=0, device="none", backend="none", tags=worker.tags),
                                self.now)  # fmt: skip
        self.say("stage", "all ranks said Hello", self.stage.state.value)

        t = self.now
        self.run_task("sleep level 1 (one ACK duplicated, one replayed from epoch 0)",
                      lambda: self.stage.sleep("sleep-1", 1, None, t, 5.0), duplicate=True, stale=True)
        self.run_task("sleep again: ALREADY, nothing sent",
                      lambda: self.stage.sleep("sleep-2", 1, None, self.now, 5.0))
        self.run_task("wake", lambda: self.stage.wake("wake-1", None, self.now, 5.0), duplicate=True)
        self.run_task("retry of wake-1 with the same task_id: answered from the record",
                      lambda: self.stage.wake("wake-1", None, self.now, 5.0))
        self.run_task("sleep level 2", lambda: self.stage.sleep("sleep-3", 2, None, self.now, 5.0))
        self.run_task("wake: memory back, weights discarded",
                      lambda: self.stage.wake("wake-2", None, self.now, 5.0))
        self.run_task("reload weights", lambda: self.stage.reload("reload-1", None, self.now, 5.0))

        c = self.stage.counters
        self.out.write(f"\nignored: {c.stale_replies_ignored} stale, {c.duplicate_replies_ignored} "
                       f"duplicate, {c.unknown_replies_ignored} unknown; retries {c.retries}; "
                       f"final state {self.stage.state.value}\n")  # fmt: skip
        expected = (c.stale_replies_ignored == 1 and c.duplicate_replies_ignored == 2
                    and self.stage.state.value == "RUNNING" and not self.failures)  # fmt: skip
        verdict = "PASS" if expected else "FAIL"
        self.out.write(f"verdict: {verdict}\n")
        return 0 if expected else 1


def main() -> int:
    return Walkthrough().run()


if __name__ == "__main__":
    raise SystemExit(main())
