"""No code outside omni_core/fsm writes a core's private state: a case or a test's starting
point is built through `restore(snapshot)` (StageCore, WorkerCore), never by setting the
fields the cores keep to themselves or placing their lifecycle's machine by hand."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from omni_core.fsm import InvariantViolation, StageCore, WorkerCore
from omni_core.fsm import inputs as I
from omni_core.fsm.stage_step import StageSnapshot
from omni_core.fsm.table import Lifecycle
from omni_core.fsm.worker_inputs import EffectCompleted
from omni_core.fsm.worker_step import PendingEffect, WorkerSnapshot
from omni_core.protocol import ReloadWeights, StageState, WorkerState

REPO = Path(__file__).resolve().parents[1]
SCANNED = ("omni_core", "omni_testing", "tests", "benchmarks", "scripts")
FSM = REPO / "omni_core" / "fsm"
LIFECYCLE_INTERNALS = {name for name in vars(Lifecycle(StageState, (), StageState.STARTING)) if name.startswith("_")}


def _private_fields() -> set[str]:
    """The fields each core and its lifecycle keep to themselves, as built."""
    names: set[str] = set()
    for core in (StageCore("s", 1), WorkerCore(0)):
        names |= {name for name in vars(core) if name.startswith("_")}
    return names


def _of_a_lifecycle(node: ast.Attribute) -> bool:
    """`x.lifecycle._machine` (or a `lifecycle` variable's): the machine under a core's state."""
    owner = node.value
    named = owner.attr if isinstance(owner, ast.Attribute) else owner.id if isinstance(owner, ast.Name) else ""
    return named == "lifecycle" and node.attr in LIFECYCLE_INTERNALS


def _writes(tree: ast.AST, private: set[str]) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for part in ast.walk(target):
                if isinstance(part, ast.Attribute) and part.attr in private:
                    found.append((node.lineno, part.attr))
        # The lifecycle's machine is the core's state: read or called, it is written.
        if isinstance(node, ast.Attribute) and _of_a_lifecycle(node):
            found.append((node.lineno, node.attr))
    return found


def test_the_scan_knows_the_private_fields_it_guards() -> None:
    private = _private_fields()
    assert {"_task", "_start_deadline_at_s"} <= private and "_machine" in LIFECYCLE_INTERNALS
    tree = ast.parse("core._task = None\nx.lifecycle._machine.set_state(s)\nrunner._model = m\n")
    assert {attr for _, attr in _writes(tree, private)} == {"_task", "_machine"}


def test_no_code_outside_fsm_writes_a_cores_private_state() -> None:
    private = _private_fields()
    offenders = []
    for folder in SCANNED:
        for path in sorted((REPO / folder).rglob("*.py")):
            if FSM in path.parents or path == Path(__file__):
                continue
            for line, attr in _writes(ast.parse(path.read_text(), filename=str(path)), private):
                offenders.append(f"{path.relative_to(REPO)}:{line} writes {attr}")
    assert not offenders, (
        f"{offenders}: build the core's state with restore(StageSnapshot(...)) or "
        "restore(WorkerSnapshot(...)), or add a public input for it"
    )


def test_restore_builds_a_stage_in_a_task_and_step_goes_on_from_there() -> None:
    core = StageCore("s", 2)
    active = {0: WorkerState.ACTIVE, 1: WorkerState.ACTIVE}
    core.restore(StageSnapshot(StageState.RUNNING, rank_state=active, weights_version=3))
    assert core.state is StageState.RUNNING and core.weights_version == 3 and core.admits()
    step = core.step(I.SleepCall("t", 1, None, 10.0), 0.0)
    assert core.state is StageState.TRANSITIONING and core.task_id == "t" and len(step.sends) == 2


def test_restore_refuses_a_state_no_stage_can_hold() -> None:
    core = StageCore("s", 1)
    with pytest.raises(InvariantViolation, match="settled without every rank known"):
        core.restore(StageSnapshot(StageState.RUNNING))


def test_restore_builds_a_worker_with_its_effect_in_progress() -> None:
    core = WorkerCore(0)
    reload = ReloadWeights(task_id="r", epoch=2)
    snapshot = WorkerSnapshot(
        WorkerState.RELOADING, 2, weights_valid=False, pending=PendingEffect(reload, state_before=WorkerState.ACTIVE)
    )
    core.restore(snapshot)
    assert core.busy and core.in_progress == ("r",) and core.epoch == 2
    (ack,) = core.step(EffectCompleted("r")).replies
    assert core.state is WorkerState.ACTIVE and ack.task_id == "r"
    with pytest.raises(InvariantViolation, match="transient state without a pending effect"):
        core.restore(WorkerSnapshot(WorkerState.RELOADING))
