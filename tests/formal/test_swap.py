"""tla/OmniSwap.tla: the swap models and bug models give their expected results, the
conditions under which SwapSucceeds is stated are each needed, and a manifest entry names
its spec module. The models are small: each TLC run is a few seconds, mostly JVM start-up.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from omni_core.formal import check, swap_graph
from omni_core.formal.tlc import TlcNotFoundError, run_tlc

SPEC = check.tla_dir() / "OmniSwap.tla"


def _swap_entries() -> list[check.Model]:
    _, models = check.load_manifest(check.tla_dir())
    return [m for m in models if m.spec == "OmniSwap.tla"]


def _tlc(config: Path):
    try:
        return run_tlc(SPEC, config, workers=1, timeout_s=300)
    except TlcNotFoundError as exc:
        pytest.skip(str(exc))


def test_manifest_lists_the_swap_models_and_bugs_with_their_spec():
    entries = {m.name: m for m in _swap_entries()}
    assert {"swap", "swap_zero_wait", "swap_succeeds", "swap_two", "swap_two_serial", "swap_late"} <= set(entries)
    bugs = {name: m.expect for name, m in entries.items() if m.is_bug}
    assert bugs == {
        "bug/swap_no_gate": "NoOOMFailure",
        "bug/swap_oom_fatal": "NoOOMFailure",
        "bug/swap_no_rollback": "RefusedExact",
        "bug/swap_wait_forever": "SwapEnds",
        "bug/swap_oom_refund": "SwapEnds",
        "bug/swap_free_host_early": "RefusedExact",
        "bug/swap_two_incoming": "NotBothRefused",
        "bug/swap_late_always": "LateNeverBlocks",
    }
    for m in entries.values():
        assert (check.tla_dir() / m.config).is_file()
        assert m.distinct_states and (not m.is_bug or m.control_states), m.name
    _, every = check.load_manifest(check.tla_dir())
    # Every other entry checks the protocol spec or a module that extends it (admission).
    assert "OmniSwap.tla" not in {m.spec for m in every if m not in entries.values()}
    assert {m.spec for m in entries.values()} == {"OmniSwap.tla"}


def test_an_entry_without_spec_takes_the_manifests(tmp_path):
    (tmp_path / check.MANIFEST).write_text(
        json.dumps(
            {
                "spec": "Top.tla",
                "models": [
                    {"name": "a", "config": "a.cfg", "expect": "ok"},
                    {"name": "b", "config": "b.cfg", "expect": "ok", "spec": "Other.tla"},
                ],
            }
        )
    )
    _, models = check.load_manifest(tmp_path)
    assert [m.spec for m in models] == ["Top.tla", "Other.tla"]


def test_check_runs_a_swap_bug_and_its_control_on_omniswap():
    parser = argparse.ArgumentParser()
    check.add_arguments(parser)
    lines: list[str] = []
    try:
        code = check.run(parser.parse_args(["--only", "bug/swap_no_gate"]), echo=lines.append)
    except TlcNotFoundError as exc:
        pytest.skip(str(exc))
    table = "\n".join(lines)
    assert code == 0, table
    assert re.search(r"^bug/swap_no_gate\s+NoOOMFailure\s+NoOOMFailure\s+\d+.*ok$", table, re.MULTILINE), table
    assert re.search(r"^bug/swap_no_gate \[Bug=none\]\s+ok\s+ok\s+\d+.*ok$", table, re.MULTILINE), table


def _variant(tmp_path: Path, config: str, **changes: str) -> Path:
    text = (check.tla_dir() / config).read_text()
    for name, value in changes.items():
        text, n = re.subn(rf"^(\s*{name}\s*(?:=|<-)\s*)\S+", rf"\g<1>{value}", text, flags=re.MULTILINE)
        assert n == 1, name
    path = tmp_path / Path(config).name
    path.write_text(text)
    return path


def test_swap_succeeds_holds_on_its_model(tmp_path):
    result = _tlc(check.tla_dir() / "models/swap_succeeds.cfg")
    assert result.outcome == "ok", result.error


@pytest.mark.parametrize(
    "changes",
    [
        {"OtherMax": "2"},  # OtherMax + Reserve + size of B = Cap + 1
        {"Reserve": "2"},  # the same through the reserve
        {"AFails": "TRUE"},  # A stops releasing
        {"DeadlinePasses": "TRUE"},  # B's wait may expire first
    ],
    ids=lambda c: ",".join(c),
)
def test_each_condition_of_swap_succeeds_is_needed(tmp_path, changes):
    result = _tlc(_variant(tmp_path, "models/swap_succeeds.cfg", **changes))
    assert result.outcome == "temporal", (changes, result.got, result.error)


@pytest.mark.parametrize(("cap", "outcome"), [(8, "ok"), (7, "temporal")])
def test_swap_succeeds_with_two_incoming_stages_when_their_sum_fits(tmp_path, cap, outcome):
    # OtherMax 1 + Reserve 1 + B 4 + C 2 = 8: the condition is on the incoming stages' sum.
    result = _tlc(_variant(tmp_path, "models/swap_succeeds.cfg", AllocC="Alloc_1_1", Cap=str(cap)))
    assert result.outcome == outcome, (cap, result.got, result.error)


def test_swap_ends_needs_the_deadline_when_a_fails(tmp_path):
    result = _tlc(_variant(tmp_path, "models/swap.cfg", DeadlinePasses="FALSE"))
    assert result.outcome == "temporal", (result.got, result.error)


def test_config_reader_and_step_classification():
    text = (check.tla_dir() / "models/swap_two.cfg").read_text()
    model = swap_graph.SwapModel.from_config(text)
    assert model == swap_graph.SwapModel(cap=4, reserve=0, may_wait=True, allocs={"B": (1, 1), "C": (2,)})
    with pytest.raises(swap_graph.SwapGraphError, match="not an OmniSwap config"):
        swap_graph.SwapModel.from_config("CONSTANTS\n    Cap = 4\n")

    def state(pc="acquire", nxt=1, mapped=0, budget=0, waiting=False, a=3, other=0):
        return {
            "a": a,
            "other": other,
            "pc": {"B": pc, "C": "acquire"},
            "next": {"B": nxt, "C": 1},
            "mapped": {"B": mapped, "C": 0},
            "budget": {"B": budget, "C": 0},
            "waiting": {"B": waiting, "C": False},
        }

    events = swap_graph.step_events
    assert events(model, "B", state(a=3), state(a=2)) == ()  # A's step
    assert events(model, "B", state(a=2), state(pc="map", budget=1)) == (("query", 2, "admit"),)
    assert events(model, "B", state(budget=1, nxt=2, mapped=1), state(pc="map", nxt=2, mapped=1)) == (("admit",),)
    assert events(model, "B", state(), state(waiting=True)) == (("query", 1, "wait"),)
    assert events(model, "B", state(waiting=True), state(pc="refused")) == (("expire",),)
    assert events(model, "B", state(), state(pc="refused")) == (("query", 1, "wait"), ("expire",))
    assert events(model, "B", state(pc="map"), state(nxt=2, mapped=1)) == (("map", True),)
    assert events(model, "B", state(pc="map"), state(waiting=True)) == (("map", False),)
    assert events(model, "B", state(pc="map"), state(pc="failed")) == (("map", False), ("fail",))


_RACE = """SPECIFICATION Spec
CONSTANTS
    Cap = 4
    SizeA = 4
    KvA = 0
    AllocB <- Alloc_1_1_1
    AllocC <- Alloc_1_1_1
    OtherInit = 0
    OtherMax = 0
    OtherMoves = 0
    Reserve = 0
    MayWait = TRUE
    AFails = FALSE
    DeadlinePasses = TRUE
    LongWait = {long}
    WaitOutlastsA = {outlasts}
    OneIncoming = {one}
    Bug = "none"
INVARIANTS
    TypeOK
    Capacity
    RefusedExact
    AwakeComplete
    NotBothRefused
"""


def test_two_incoming_stages_hold_and_wait_and_one_wakes_when_the_waits_outlast_a(tmp_path):
    config = tmp_path / "race.cfg"
    config.write_text(_RACE.format(long="TRUE", outlasts="FALSE", one="FALSE"))
    assert _tlc(config).outcome == "ok"
    states, _, _ = swap_graph.parse_dot(swap_graph.dump(SPEC, config))
    # Both hold part of themselves, neither can finish: only a rollback gets one through.
    assert any(s["mapped"] == {"B": 2, "C": 2} and s["a"] == 0 for s in states.values())


def test_two_incoming_stages_may_both_be_refused_when_a_wait_is_short(tmp_path):
    config = tmp_path / "race.cfg"
    config.write_text(_RACE.format(long="FALSE", outlasts="FALSE", one="FALSE"))
    result = _tlc(config)
    assert (result.outcome, result.violated) == ("invariant", "NotBothRefused"), result.error


@pytest.mark.parametrize(
    ("outlasts", "one", "outcome"),
    [
        ("TRUE", "FALSE", "invariant"),  # waits that outlast A's sleep: both still refused when racing
        ("TRUE", "TRUE", "ok"),  # one incoming wake per device at a time: one wakes
        ("FALSE", "TRUE", "invariant"),  # each wait ends before A's sleep: each refusal is for A
    ],
    ids=["racing", "one_incoming", "waits_shorter_than_a"],
)
def test_one_incoming_wake_per_device_keeps_one_of_two_stages_from_refusal(tmp_path, outlasts, one, outcome):
    # The race's constants without LongWait: with OneIncoming = FALSE both are refused even when
    # every wait outlasts A's sleep (the two deadlines pass together); with it, C's wake starts
    # once B's ended and one of them wakes. No order helps a wait that ends before A's sleep.
    config = tmp_path / "race.cfg"
    config.write_text(_RACE.format(long="FALSE", outlasts=outlasts, one=one))
    result = _tlc(config)
    assert result.outcome == outcome, (result.got, result.error)
    if outcome == "invariant":
        assert result.violated == "NotBothRefused", result.error


def test_the_serial_model_is_the_race_with_one_incoming_wake_and_the_bug_model_without_it():
    serial = (check.tla_dir() / "models/swap_two_serial.cfg").read_text()
    bug = (check.tla_dir() / "bugs/swap_two_incoming.cfg").read_text()
    race = _RACE.format(long="FALSE", outlasts="TRUE", one="TRUE")

    def constants(text: str) -> str:
        return text[text.index("CONSTANTS") : text.index("INVARIANTS")]

    assert constants(serial) == constants(race)
    assert constants(bug) == constants(race).replace('Bug = "none"', 'Bug = "two_incoming"')
