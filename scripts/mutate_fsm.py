#!/usr/bin/env python
"""The fsm mutation campaign: a fixed set of mutations of omni_core/fsm, each run against the
sans-IO checks, in CI.

Each mutation removes or weakens one rule of the cores (the reply cache, the epoch fence and
window, the stage's checks of a reply, the drain, the admission rows, ...). For each, in ONE
copy of the repository (scripts/mutate.py's copy: tracked and untracked files git does not
ignore), the edit is applied, the generated TLA+ modules are regenerated (as a developer
changing a table would: `omni-core check --regen`, so the freshness test is not what catches
a changed row), and two tiers run until one fails:

1. the sans-IO unit tests (SUITE, `pytest -x`: the first failure ends the run);
2. for a survivor of tier 1 only, the agreement rows (omni_core/formal/agree.py): the
   spec's table, computed once by TLC on the unmutated copy, replayed on the mutant's cores;
3. for a survivor of both, TLC over the models in SPEC_MODELS on the mutant's regenerated
   modules: the rules the spec writes by hand against the rows the mutant changed.

A mutant is CAUGHT (naming the tier and the first failing check), SURVIVED, or ERROR (its
snippet is not in the source exactly once: the table is stale). A survivor must carry
`equivalent`, the reason no check can tell it from the original; an unexplained survivor, an
explained one that is now caught, or an ERROR fails the run (exit 1). The score is committed
in tla/fsm_mutation.md; `--check` also fails when the results differ from it.

    .venv/bin/python scripts/mutate_fsm.py --list
    .venv/bin/python scripts/mutate_fsm.py --out tla/fsm_mutation.md     # run, write the score
    .venv/bin/python scripts/mutate_fsm.py --check tla/fsm_mutation.md   # CI: run, compare
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pickle
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mutate  # scripts/ is not a package
from mutate import Edit

from omni_core.formal.tlc import run_tlc

# Snippets are found anywhere in the package, not in a named file, so that moving code between
# its modules does not stale the table; every occurrence is replaced (at least one must exist).
FSM = "omni_core/fsm"
STAGE = WORKER = ADMISSION = FSM
ENGINE = "omni_core/engine"  # the orchestrator's few rules that decide what a rank is sent
SUITE = (
    "tests/test_worker_core.py",
    "tests/test_stage_core.py",
    "tests/test_admission.py",
    "tests/test_stage_fields.py",
    "tests/test_weights_core.py",
    "tests/engine/test_incoming.py",
)
TIER1 = "unit tests"
TIER2 = "agreement rows"
TIER3 = "spec models"
# Tier 3: models of the spec whose hand-written invariants judge the generated tables (a
# changed row changes the spec with it; the rules written by hand do not move).
SPEC_MODELS = (("OmniAdmission.tla", "models/admission.cfg"),)
RUN_TIMEOUT_S = 300  # one mutant's tier; a mutant that loops ends here, counted as caught by the timeout


@dataclasses.dataclass(frozen=True)
class FsmMutation:
    name: str
    what: str
    edits: tuple[Edit, ...]
    equivalent: str = ""  # why it survives every check, where it does


def _m(name: str, what: str, path: str, original: str, replacement: str, equivalent: str = "") -> FsmMutation:
    return FsmMutation(name, what, (Edit(path, original, replacement),), equivalent)


MUTATIONS: tuple[FsmMutation, ...] = (
    # ------------------------------------------------------------ worker core
    _m(
        "reply-cache",
        "a duplicate of an answered command is handled again",
        WORKER,
        "            cached = self.cache.get(command.task_id)\n",
        "            cached = None  # mutant\n",
    ),
    _m(
        "epoch-fence",
        "a command of an older epoch is obeyed",
        WORKER,
        "        if command.epoch < self.epoch:\n",
        "        if False:  # mutant\n",
    ),
    _m(
        "epoch-window",
        "the epoch window widened from 64 to 5000",
        WORKER,
        "MAX_EPOCH_AHEAD = 64\n",
        "MAX_EPOCH_AHEAD = 5000  # mutant\n",
    ),
    _m(
        "busy-unrecorded",
        "a BUSY refusal of an Execute or Profile is not recorded: a copy runs after the task",
        WORKER,
        "                self._remember(command, step.replies[0])\n",
        "                pass  # mutant\n",
    ),
    _m(
        "copy-in-flight-answered",
        "a copy of the task in progress is answered BUSY (a second reply for the task)",
        WORKER,
        "            self.counters.duplicates_in_flight_ignored += 1\n            return WorkerStep()\n",
        "            self.counters.duplicates_in_flight_ignored += 1  # mutant: falls through\n",
    ),
    _m(
        "failed-obeys",
        "a FAILED worker obeys commands",
        WORKER,
        "        if self.state is W.FAILED and not isinstance(command, (Shutdown, Status)):\n",
        "        if False:  # mutant\n",
    ),
    # ------------------------------------------------------------ stage core: replies
    _m(
        "reply-epoch",
        "the stage takes replies of another epoch",
        STAGE,
        "        if reply.epoch != self.epoch:\n            self.counters.stale_replies_ignored += 1\n",
        "        if False:  # mutant\n            self.counters.stale_replies_ignored += 1\n",
    ),
    _m(
        "duplicate-replies",
        "a rank's second reply to a task counts again",
        STAGE,
        "        if reply.rank in task.acks or reply.rank in task.refusals:\n",
        "        if False:  # mutant\n",
    ),
    _m(
        "ack-asleep-tags",
        "the stage no longer checks the asleep tags an ACK reports",
        STAGE,
        "        if reply.state is not task.expect_state or asleep != task.expect_asleep:\n",
        "        if reply.state is not task.expect_state:  # mutant\n",
    ),
    _m(
        "ack-state",
        "the stage no longer checks the state an ACK reports",
        STAGE,
        "        if reply.state is not task.expect_state or asleep != task.expect_asleep:\n",
        "        if asleep != task.expect_asleep:  # mutant\n",
    ),
    _m(
        "ack-command",
        "an ACK naming another command commits the task",
        STAGE,
        "        if reply.command != command:\n",
        "        if False:  # mutant\n",
    ),
    _m(
        "ack-version",
        "an ACK at another weights version commits the task",
        STAGE,
        "        if reply.weights_version != task.expect_version:\n",
        "        if False:  # mutant\n",
    ),
    _m(
        "ack-memory-report",
        "an ACK of an effect without its memory report commits (P-12)",
        STAGE,
        "        if reply.status is AckStatus.OK and reply.memory is None:\n",
        "        if False:  # mutant\n",
    ),
    _m(
        "nomemory-plain-wake-fails",
        "a wake that may not wait, refused NO_MEMORY and rolled back, fails the stage (P-16)",
        STAGE,
        "        if isinstance(reply, Nack) and reply.reason is REFUSAL_REASON.get(type(task.command)):\n",
        "        if isinstance(reply, Nack) and reply.reason is REFUSAL_REASON.get(type(task.command)) and not (\n"
        "            isinstance(task.command, Wake) and task.command.memory_wait_s <= 0\n"
        "        ):  # mutant\n",
    ),
    # ------------------------------------------------------------ stage core: requests, deadlines
    _m(
        "drain",
        "the Sleep goes out with requests still in flight",
        STAGE,
        "self._send_drained(now) if self.in_flight_requests == 0 else StageStep()",
        "self._send_drained(now)",
    ),
    _m(
        "request-first-answer",
        "a request retires at its first rank's answer",
        STAGE,
        "        if len(request.replies) < len(self.ranks):\n",
        "        if not request.replies:  # mutant\n",
    ),
    _m(
        "queue-limit",
        "the queue has no bound",
        STAGE,
        "        elif len(self.queue) >= self.queue_limit:\n",
        "        elif False:  # mutant\n",
    ),
    _m(
        "start-deadline-unit",
        "the start's deadline in milliseconds where seconds are meant",
        STAGE,
        "self._start_deadline_at_s = now + deadline_s\n",
        "self._start_deadline_at_s = now + deadline_s / 1000  # mutant\n",
    ),
    # ------------------------------------------------------------ tables
    _m(
        "execute-in-partial",
        "the stage table admits Execute in PARTIAL",
        STAGE,
        '    Transition("execute", (S.RUNNING,), None,',
        '    Transition("execute", (S.RUNNING, S.PARTIAL), None,',
    ),
    _m(
        "needs-reload-queues",
        "NEEDS_RELOAD queues a request (the pump refuses it a step later) instead of refusing it",
        ADMISSION,
        "        (S.NEEDS_RELOAD,),\n        (Q, W),\n        Admit.REFUSE_NEEDS_RELOAD,\n",
        "        (S.NEEDS_RELOAD,),\n        (Q, W),\n        Admit.QUEUE,  # mutant\n",
    ),
    _m(
        "no-auto-wake",
        "the policy wake no longer wakes a sleeping stage for its queue",
        ADMISSION,
        "    QueueRow(_ASLEEP, (W,), QueueAction.AUTO_WAKE,",
        "    QueueRow(_ASLEEP, (W,), QueueAction.HOLD,",
    ),
    _m(
        "incoming-bytes-unfiltered",
        "a swap's Sleep.incoming_bytes also goes to ranks that never declared 'swap' (a worker that "
        "predates the field refuses such a Sleep as BAD_MESSAGE)",
        ENGINE,
        "return {r: n for r, n in per_rank.items() if out.declares(r, Capability.SWAP)}",
        "return per_rank",
    ),
    # ------------------------------------------------------------ what trace validation reads
    # (omni_core/formal/trace_admission.py holds the records to the admission tables and P-16)
    _m(
        "policy-unrecorded",
        "the stage's start no longer names its admission policy (a trace then looks older than it is)",
        STAGE,
        "return StageStarting(epoch, core.tags, core.start_deadline_at_s, core.policy.value)",
        "return StageStarting(epoch, core.tags, core.start_deadline_at_s)",
    ),
    _m(
        "policy-change-unrecorded",
        "a change of the admission policy leaves no line in the trace",
        STAGE,
        "case I.SetAdmission(policy=policy) if AdmissionPolicy(policy) is not core.policy:",
        "case I.SetAdmission(policy=policy) if False:",
    ),
    _m(
        "wake-wait-unrecorded",
        "a waiting Wake's memory_wait_s is left out of its issue and sends (no NO_MEMORY timing to check)",
        STAGE,
        "return command.memory_wait_s if isinstance(command, Wake) and command.memory_wait_s > 0 else None",
        "return None",
    ),
    _m(
        "incoming-unannounced",
        "a swap's waiting incoming wake is issued with no IncomingHeld line (its hold of the device unseen)",
        ENGINE,
        "if swap.wake.memory_wait_s > 0:\n            self._announced.add(key)",
        "if False:\n            self._announced.add(key)",
    ),
)


# ============================================================================ running


@dataclasses.dataclass
class Result:
    name: str
    result: str  # CAUGHT, SURVIVED, ERROR
    tier: str
    by: str
    seconds: float
    files: str = ""  # where the snippet was found


MUTATED = (FSM, ENGINE)  # where a mutation's snippet is looked for


def _sources(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for d in MUTATED for p in sorted((root / d).rglob("*.py"))}


def _problems(m: FsmMutation, root: Path) -> list[str]:
    sources = _sources(root)
    return [
        f"{' and '.join(MUTATED)}: snippet {e.original.strip()[:60]!r} found nowhere"
        for e in m.edits
        if not any(e.original in text for text in sources.values())
    ]


def _apply(m: FsmMutation, root: Path) -> set[str]:
    """Replace every occurrence of each snippet; the files changed."""
    changed = set()
    for edit in m.edits:
        for path, text in _sources(root).items():
            if edit.original in text:
                (root / path).write_text(text.replace(edit.original, edit.replacement))
                changed.add(path)
    return changed


GENERATED = ("tla/OmniTransitions.tla", "tla/VersionTable.tla")  # what the fsm tables render


def _regen(root: Path) -> None:
    """Render the generated modules from the copy's (mutated) tables, in the copy."""
    code = "from omni_core.formal import gen_transitions, gen_versions; gen_transitions.write(); gen_versions.write()"
    subprocess.run([sys.executable, "-c", code], cwd=root, env=mutate.run_env(root), check=True, capture_output=True)


def _tier1(root: Path, log: Path) -> tuple[bool, str]:
    """(caught, first failing test) of the unit tests on the copy as it is now."""
    junit = log.with_suffix(".xml")
    cmd = [*mutate.pytest_command(SUITE, junit), "-x"]
    try:
        proc = subprocess.run(
            cmd, cwd=root, env=mutate.run_env(root), capture_output=True, text=True, timeout=RUN_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return True, f"timeout after {RUN_TIMEOUT_S} s"
    log.write_text(proc.stdout + proc.stderr)
    failed, _, _ = mutate.failed_tests(junit)
    if proc.returncode == 0:
        return False, ""
    return True, failed[0] if failed else f"pytest exit {proc.returncode}"


_REPLAY = """
import pickle, sys
from omni_core.formal import agree
found = agree.compare(pickle.load(open(sys.argv[1], "rb")))
print(f"{len(found)} disagree; first: {found[0] if found else '-'}")
sys.exit(1 if found else 0)
"""


def _tier2(root: Path, table: Path) -> tuple[bool, str]:
    proc = subprocess.run(
        [sys.executable, "-c", _REPLAY, str(table)],
        cwd=root,
        env=mutate.run_env(root),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    last = (proc.stdout.strip().splitlines() or [proc.stderr.strip()[-200:]])[-1]
    return proc.returncode != 0, last[:200]


def _tier3(root: Path) -> tuple[bool, str]:
    for spec, config in SPEC_MODELS:
        result = run_tlc(root / "tla" / spec, root / "tla" / config, workers=2, timeout_s=RUN_TIMEOUT_S)
        if result.outcome != "ok":
            return True, f"{config}: {result.got} {result.error}".strip()
    return False, ""


def _spec_table(tla: Path, work: Path) -> Path:
    """The agreement rows' spec side, once, by TLC over the unmutated spec (`tla`: a copy of
    tla/ taken before any mutant); this process imports the unmutated package."""
    from omni_core.formal import agree

    path = work / "spec_table.pickle"
    if not path.is_file():
        path.write_bytes(pickle.dumps(agree.spec_table(tla)))
    return path


def run_one(m: FsmMutation, root: Path, work: Path) -> Result:
    started = time.monotonic()
    problems = _problems(m, root)
    if problems:
        return Result(m.name, "ERROR", "", "stale snippet: " + "; ".join(problems), 0.0)
    saved = {**_sources(root), **{path: (root / path).read_text() for path in GENERATED}}
    try:
        files = _apply(m, root)
        _regen(root)
        caught, by = _tier1(root, work / f"{m.name}.log")
        tier = TIER1
        if not caught:
            caught, by = _tier2(root, _spec_table(work / "tla", work))
            tier = TIER2
        if not caught:
            caught, by = _tier3(root)
            tier = TIER3
    finally:
        for path, text in saved.items():
            (root / path).write_text(text)
    result = "CAUGHT" if caught else "SURVIVED"
    where = ", ".join(sorted(f.removeprefix(FSM + "/").removeprefix("omni_core/") for f in files))
    return Result(m.name, result, tier if caught else "", by, time.monotonic() - started, where)


def _cpu_s() -> float:
    """CPU seconds of this process and the processes it waited for (pytest, TLC)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def markdown(results: list[Result], header: dict[str, str]) -> str:
    by_name = {m.name: m for m in MUTATIONS}
    lines = ["# fsm mutation campaign", ""]
    lines += [f"- {k}: {v}" for k, v in header.items()]
    lines += ["", "| mutation | file | what it breaks | result | tier | by | s |", "|---|---|---|---|---|---|---|"]
    for r in results:
        m = by_name[r.name]
        files = r.files or "-"
        by = r.by.replace("|", "\\|") if r.result != "SURVIVED" else f"equivalent: {m.equivalent or 'UNEXPLAINED'}"
        lines.append(f"| `{r.name}` | {files} | {m.what} | **{r.result}** | {r.tier} | {by} | {r.seconds:.0f} |")
    return "\n".join(lines) + "\n"


_ROW = re.compile(r"^\| `([\w-]+)` \|[^|]*\|[^|]*\| \*\*(\w+)\*\* \|", re.MULTILINE)


def committed(path: Path) -> dict[str, str]:
    return dict(_ROW.findall(path.read_text())) if path.is_file() else {}


def verdict(results: list[Result], expected: dict[str, str] | None) -> list[str]:
    """What makes the run fail: an unexplained survivor, an explained one caught, an ERROR, or
    (with `expected`, the committed score) a result that differs from it."""
    by_name = {m.name: m for m in MUTATIONS}
    bad = []
    for r in results:
        explained = bool(by_name[r.name].equivalent)
        if r.result == "ERROR" or (r.result == "SURVIVED") != explained:
            bad.append(f"{r.name}: {r.result}{' (explained as equivalent)' if explained else ''} {r.by}")
        elif expected is not None and expected.get(r.name) != r.result:
            bad.append(f"{r.name}: {r.result}, the committed score says {expected.get(r.name)}")
    return bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print the mutations, check each snippet; run nothing")
    parser.add_argument("--only", action="append", default=[], metavar="NAME")
    parser.add_argument("--out", type=Path, help="write the score (Markdown) here")
    parser.add_argument("--check", type=Path, metavar="SCORE", help="fail when the results differ from this score")
    args = parser.parse_args(argv)
    selected = [m for m in MUTATIONS if not args.only or m.name in args.only]
    if args.list:
        stale = 0
        for m in selected:
            problems = _problems(m, mutate.REPO)
            stale += bool(problems)
            print(f"{m.name:24} {'ok   ' if not problems else 'STALE'} {m.what}")
            for p in problems:
                print(f"{'':30}ERROR {p}")
        print(f"{len(selected)} mutations, {stale} stale")
        return 1 if stale else 0
    started, cpu_started = time.monotonic(), _cpu_s()
    work = Path(tempfile.mkdtemp(prefix="omni-mutate-fsm-"))
    results: list[Result] = []
    try:
        root = work / "copy"
        mutate.copy_tree(root, None)
        mutate.check_imports(root)
        base_caught, base_by = _tier1(root, work / "_baseline.log")
        if base_caught:
            print(f"ERROR: the unit tests fail without a mutation ({base_by}); nothing is judged")
            return 2
        shutil.copytree(root / "tla", work / "tla")
        for m in selected:
            result = run_one(m, root, work)
            results.append(result)
            print(f"{m.name}: {result.result} {result.tier} in {result.seconds:.1f} s {result.by}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    counts = {k: sum(r.result == k for r in results) for k in ("CAUGHT", "SURVIVED", "ERROR")}
    total_s = time.monotonic() - started
    summary = (
        f"{len(results)} mutations: {counts['CAUGHT']} caught, {counts['SURVIVED']} survived, {counts['ERROR']} error"
    )
    print(f"{summary}; {total_s:.0f} s")
    header = {
        "command": "python scripts/mutate_fsm.py --out tla/fsm_mutation.md",
        "machine": mutate.machine(),
        "commit": mutate.describe_commit(None),
        "score": summary,
        "time": f"{total_s:.0f} s wall, {_cpu_s() - cpu_started:.0f} s of CPU with its processes "
        "(one baseline run of the unit tests, then per mutant)",
    }
    if args.out:
        args.out.write_text(markdown(results, header))
    bad = verdict(results, committed(args.check) if args.check else None)
    for line in bad:
        print(f"FAIL {line}")
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    sys.exit(main())
