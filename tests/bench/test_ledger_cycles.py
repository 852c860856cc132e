"""Two Engines, each in its own process, alternating sleep/wake/swap cycles on one simulated
device (benchmarks/ledger_cycles.py, a CI-sized count): every cycle completes (no livelock),
every refusal names a holder of the other engine."""

from __future__ import annotations

from benchmarks import ledger_cycles

CYCLES = 4  # two turns each at being the engine refused; the results file runs 1,000


def test_two_engines_cycle_on_one_device_and_every_refusal_names_the_other_engine() -> None:
    tallies = ledger_cycles.run(CYCLES)
    assert [t.unexpected for t in tallies] == [[], []]
    assert [(t.cycles, t.swaps, t.wakes) for t in tallies] == [(CYCLES, CYCLES, CYCLES // 2)] * 2
    # One refusal per cycle, of the engine whose turn it is to come second, naming the other.
    assert [len(t.refusals) for t in tallies] == [CYCLES // 2] * 2
    for tally, other in zip(tallies, reversed(tallies), strict=True):
        assert all(ledger_cycles.names_other_engine(text, other.engine_pid) for text in tally.refusals)
        assert not any(ledger_cycles.names_other_engine(text, tally.engine_pid + 10**7) for text in tally.refusals)


def test_a_refusal_names_the_other_engine_only_with_bytes_or_holding_the_lock() -> None:
    holder = "stage e1-keep rank 0, pid 12 (engine pid 34): {} bytes (0.00 GiB)"
    assert ledger_cycles.names_other_engine("holders: " + holder.format(1180160), 34)
    assert not ledger_cycles.names_other_engine("holders: " + holder.format(0), 34)  # asleep: holds nothing
    assert not ledger_cycles.names_other_engine("holders: " + holder.format(1180160), 35)
    lock = "another wake holds the device's incoming lock (stage e1-x rank 0, pid 12 (engine pid 34)) after"
    assert ledger_cycles.names_other_engine(lock, 34) and not ledger_cycles.names_other_engine(lock, 35)
