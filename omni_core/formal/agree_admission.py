"""Agreement of StageCore's admission with the hand-written part of OmniAdmission.tla.

The decision tables (ADMISSION, QUEUE_RULES) are generated into the spec; what is written
twice is how the core uses them: a request runs at once only with room in flight and an
empty queue, a full queue refuses, and the pump dispatches, wakes or rejects. TLC runs
`tla/OmniAgreeAdmission.tla`: every stage state x policy x queue length x requests in
flight is an initial state, and the spec's first admission step there (the pump when it is
due, else a Submit) is printed. Here StageCore is put in the same case and stepped with a
Tick (which, with nothing due, only moves the queue on) or a Submit; the two must do the
same thing. `omni-core check` shows it as the
row "agree/admission".
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from omni_core.formal.agree import AgreeParseError, Disagreement, parse_lines
from omni_core.formal.tlc import EXIT_OK, run_tlc
from omni_core.fsm import inputs as I
from omni_core.fsm.admission import AdmissionPolicy
from omni_core.fsm.stage import StageCore
from omni_core.fsm.stage_step import StageRequest, StageSnapshot, StageTask
from omni_core.fsm.stage_table import STAGE_STATE_OF_RANK
from omni_core.protocol import Sleep, StageState, WorkerState

SPEC = "OmniAgreeAdmission.tla"
CONFIG = "agree_admission.cfg"
QUEUE_LIMIT = 2  # as agree_admission.cfg
MAX_IN_FLIGHT = 2
_IN_TASK = {StageState.DRAINING, StageState.TRANSITIONING, StageState.WAKING}

_RANK_STATE = {stage: rank for rank, stage in STAGE_STATE_OF_RANK.items()}

Case = tuple[str, str, int, int]  # stage state, policy, queued, in flight


def spec_steps(root: Path, *, timeout_s: float = 300.0) -> dict[Case, tuple[str, str]]:
    """Case -> (what stepped: "pump" or "submit", what it did), as TLC printed them."""
    result = run_tlc(root / SPEC, root / CONFIG, workers=1, timeout_s=timeout_s)
    if result.exit_code != EXIT_OK:
        raise AgreeParseError(f"TLC on {SPEC} did not finish cleanly: {result.error or result.exit_code}")
    lines = parse_lines(result.output, "ADMIT")
    cases = {tuple(line[1]) for line in lines if line[0] == "case"}
    steps = {tuple(line[1]): (line[2], line[3]) for line in lines if line[0] == "step"}
    if not cases or cases != set(steps):
        raise AgreeParseError(
            f"TLC on {SPEC} printed {len(cases)} cases and {len(steps)} steps; every case "
            f"needs one step (is PrintSteps in {CONFIG}?)"
        )
    return steps


def _core(case: Case, factory: Callable[..., StageCore]) -> StageCore:
    state, policy, queued, in_flight = case
    core = factory("agree", 1, policy=AdmissionPolicy(policy), queue_limit=QUEUE_LIMIT, max_in_flight=MAX_IN_FLIGHT)
    stage_state = StageState(state)
    tags = frozenset(core.tags)
    task = None
    if stage_state in _IN_TASK:  # a sleep under way, as the spec's case has
        command = Sleep(task_id="task", epoch=core.epoch, level=1, tags=None)
        task = StageTask(
            "task",
            ("Sleep", 1, None),
            command,
            0.0,
            60.0,
            expect_state=WorkerState.SLEEPING,
            expect_asleep=tags,
            commit_trigger="slept",
            apply=lambda res: None,
        )
    snapshot = StageSnapshot(
        stage_state,
        {StageState.SLEEPING: tags, StageState.PARTIAL: tags - {"weights"}}.get(stage_state, frozenset()),
        weights_valid=stage_state is not StageState.NEEDS_RELOAD,
        rank_state={0: _RANK_STATE.get(stage_state, WorkerState.ACTIVE)},  # the rank agrees (P-5)
        paused=stage_state is StageState.PAUSED,  # the spec's PAUSED case: a pause holds it
        task=task,
        queued=tuple(StageRequest(f"q{i}", None, float("inf")) for i in range(queued)),
        in_flight=tuple(StageRequest(f"f{i}", None, float("inf")) for i in range(in_flight)),
    )
    core.restore(snapshot)
    return core


def code_step(case: Case, step: str, factory: Callable[..., StageCore] = StageCore) -> tuple[str, str]:
    """What StageCore does in the case: its pump, or (where the spec submits) a new request."""
    core = _core(case, factory)
    queued, in_flight = len(core.queue), len(core.in_flight)
    if step == "pump":
        core.step(I.Tick(), 0.0)  # nothing falls due at 0: the tick only moves the queue on
        if len(core.in_flight) > in_flight:
            return "pump", "dispatch"
        if core.task is not None and type(core.task.command).__name__ == "Wake":
            return "pump", "auto_wake"
        return "pump", "reject_all" if queued and not core.queue else "none"
    answered = core.step(I.Submit("new", None, 60.0), 0.0).requests
    if "new" in core.in_flight:
        return "submit", "run"
    if any(r.request_id == "new" for r in core.queue):
        return "submit", "queue"
    return "submit", "refuse" if any(a.request_id == "new" for a in answered) else "none"


def compare(steps: dict[Case, tuple[str, str]], factory: Callable[..., StageCore] = StageCore) -> list[Disagreement]:
    out = []
    for case in sorted(steps):
        spec = steps[case]
        try:
            code: tuple[str, ...] = code_step(case, spec[0], factory)
            if spec[0] == "submit":  # the spec submits only where no pump is due: nor must the core's be
                pump = code_step(case, "pump", factory)
                if pump[1] != "none":
                    code = (*code, f"but its pump would {pump[1]}")
        except Exception as exc:  # an invariant the core raises is an answer too
            code = (spec[0], f"{type(exc).__name__}: {exc}")
        if code != spec:
            out.append(Disagreement("admission", case, spec, code))
    return out
