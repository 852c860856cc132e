"""A scripted walk through both lifecycles on the sans-IO cores and the simulated network.

One stage with three ranks: start, a level-1 sleep whose ACK the network holds back past the
deadline (FAILED, naming the rank), a restart after which that ACK arrives from the old epoch
(counted, ignored), a sleep with a duplicated ACK, ALREADY, a request queued while asleep, a
wake, a retry answered from the record, a level-2 sleep, wake and weight reload. The script
is in the scenario language of `tests/testdata/*.txt` and runs on the same simulator
(`omni_testing.network`): every message crosses the real codec, time is a controlled
clock, and the output is the same on every run. No processes, no sockets, no memory.
"""

from __future__ import annotations

import sys
from typing import TextIO

from omni_core.protocol import StageState
from omni_testing.network import Simulator
from omni_testing.scenario import parse_blocks
from omni_testing.script import Script

SCRIPT = """\
# == start: every rank says Hello; the stage is RUNNING once all of them have.
stage ranks={ranks} start-deadline=10s

# == sleep level 1, and the network holds rank {last}'s ACK back past the 5 s deadline:
# the stage fails naming rank {last}. A missing ACK ends in FAILED, never in a hang.
sleep task=sleep-0 level=1 deadline=5s
deliver-all
done
delay from=r{last} by=10s
deliver-all
tick +5s

# == restart: a new epoch and fresh rank processes. The ACK held back from epoch 0 arrives
# now and is counted as stale, never applied.
restart
tick +5s
deliver

# == sleep level 1 again. Rank 0's ACK is duplicated and both copies arrive first: the copy
# is counted and ignored, and the stage commits only on the complete set.
sleep task=sleep-1 level=1 deadline=5s
deliver-all
done
dup from=r0
deliver from=r0 n=all
deliver-all

# == sleep again: every tag is asleep already, so ALREADY and nothing is sent.
sleep task=sleep-2 level=1

# == a request to the sleeping stage waits in the queue (admission policy `queue`).
submit req=req-1 payload=42

# == wake: every rank maps its memory back; the queued request runs after the commit.
wake task=wake-1 deadline=5s
settle

# == the caller retries wake-1 with the same task_id: answered from the record, nothing sent.
wake task=wake-1 deadline=5s

# == sleep level 2: every tag is discarded, weights included.
sleep task=sleep-3 level=2 deadline=5s
settle

# == wake: memory is back but the weights are garbage, so the stage NEEDS_RELOAD, and a
# request is refused until the weights are reloaded.
wake task=wake-2 deadline=5s
settle
submit req=req-2 payload=43

# == reload weights: RUNNING again, and requests run.
reload task=reload-1 deadline=5s
settle
submit req=req-3 payload=44
settle
status
"""


class Walkthrough:
    def __init__(self, ranks: int = 3, out: TextIO = sys.stdout) -> None:
        if ranks < 2:
            raise ValueError("the walkthrough needs two ranks or more (one's ACK is held back, another's copied)")
        self.ranks = ranks
        self.out = out
        self.script = Script()

    def run(self) -> int:
        self.out.write(
            f"omni-core lifecycle walkthrough (sans-IO cores, {self.ranks} ranks, simulated network: every "
            "message through the codec, a controlled clock)\n"
        )
        blocks, _ = parse_blocks(SCRIPT.format(ranks=self.ranks, last=self.ranks - 1))
        for block in blocks:
            notes = [line.removeprefix("#").strip() for line in block.preamble if line.strip()]
            if notes:
                self.out.write("\n" + "".join(f"{note}\n" for note in notes))
            self.out.write(f"> {block.command}\n")
            self.out.write("".join(f"    {line}\n" for line in self.script.run(block.command)))
        failures = self.check()
        self.out.write("\n" + "".join(f"!! {failure}\n" for failure in failures))
        self.out.write(f"verdict: {'FAIL' if failures else 'PASS'}\n")
        return 1 if failures else 0

    def check(self) -> list[str]:
        """What the walk must show; each miss is named."""
        sim = self.script.sim
        assert isinstance(sim, Simulator)
        stage, counters = sim.stage, sim.stage.counters
        answers = {rid: (a.error.name if a.error else a.output) for rid, a in sim.answered.items()}
        first_sleep = sim.outcomes.get("sleep-0")
        expected = {
            "final state RUNNING": stage.state is StageState.RUNNING,
            "one stale ACK ignored": counters.stale_replies_ignored == 1,
            "one duplicate ACK ignored": counters.duplicate_replies_ignored == 1,
            "one retry answered from the record": counters.retries == 1,
            f"sleep-0 failed naming rank {self.ranks - 1} only": first_sleep is not None
            and not first_sleep.ok
            and set(first_sleep.failures) == {self.ranks - 1},
            "req-1 served after the wake, req-2 refused, req-3 served": answers
            == {"req-1": 42, "req-2": "REJECTED", "req-3": 44},
        }
        return [what for what, held in expected.items() if not held]


def main() -> int:
    return Walkthrough().run()


if __name__ == "__main__":
    raise SystemExit(main())
