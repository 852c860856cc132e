#!/usr/bin/env python
"""Mutation testing of the lifecycle core: does some test fail when a guarantee is removed?

Each entry of MUTATIONS names one guarantee of the orchestrator, the worker shell or a core
(an admission branch, a deadline, the reply cache, the epoch fence, the drain) and the exact
source text that provides it, with a replacement that removes or weakens it. For each one the
script copies the repository (tracked and untracked files that git does not ignore, or the
tree of a commit with --ref) to a temporary directory, applies that ONE mutation there, and
runs the mutation's tests from inside the copy with PYTHONPATH pointing at it. The shared
checkout is never modified. A mutant is CAUGHT when a listed test fails, SURVIVED when all
pass; a snippet that is missing or ambiguous is an ERROR (the table is stale), never a skip.

Before the mutants, the listed tests run once on the unmutated copy (a mutant "caught" by a
test that fails anyway proves nothing), the copy's `omni_core` is checked to be the one that
Python imports (the package is also installed editable from the main checkout), and two
canary mutants that crash on purpose prove that both the test process and the rank
processes (`python -m omni_core.workers`) run the copy's code.

    .venv/bin/python scripts/mutate.py --list              # the table; non-zero if a snippet is stale
    .venv/bin/python scripts/mutate.py --out benchmarks/results/mutation.md
    .venv/bin/python scripts/mutate.py --only reject-policy --only auto-wake
    .venv/bin/python scripts/mutate.py --ref HEAD          # mutate the committed tree, not the working tree

Not part of CI (minutes of real processes); tests/test_mutation_script.py keeps the table
fresh there by running --list.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ORCH = "omni_core/engine/orchestrator.py"
API = "omni_core/engine/api.py"
STAGE_CORE = "omni_core/fsm/stage.py"
STAGE_CALLS = "omni_core/fsm/stage.py"
STAGE_REQUESTS = "omni_core/fsm/stage.py"
ADMISSION = "omni_core/fsm/admission.py"
WORKER_CORE = "omni_core/fsm/worker.py"
SHELL = "omni_core/workers/process.py"
RANK_MAIN = "omni_core/workers/__main__.py"
TRACE_CHECKS = "omni_core/formal/trace_admission.py"
TRACE_CHECKS_TESTS = "tests/formal/test_trace_admission.py"

ENGINE_TESTS = "tests/engine/test_engine.py"
DEMO_TEST = f"{ENGINE_TESTS}::test_demo_scenario_passes_and_traces_every_node"
FIFTY = f"{ENGINE_TESTS}::test_fifty_concurrent_requests_across_a_sleep_wake_cycle"
ASLEEP_ADMISSION = (
    f"{ENGINE_TESTS}::test_a_sleeping_stage_refuses_beyond_its_queue_and_everything_while_it_needs_a_reload"
)
DRAIN = f"{ENGINE_TESTS}::test_sleep_is_sent_only_after_every_rank_answered_the_request_in_flight"

# pytest-timeout per test in a mutant's run: a mutant that removes a deadline may hang a test,
# which then fails here instead of stalling the whole run. Above the slowest test's own bounds.
PER_TEST_TIMEOUT_S = 180
# A whole pytest run (one mutant's tests), as a last resort behind the per-test timeout.
RUN_TIMEOUT_S = 900
CANARY = "MUTATION-CANARY"
NOTES = """\
How to read it: every listed test runs on every mutant (no -x), so "caught by" names each test
that failed. The baseline is the same tests on the unmutated copy; the canaries crash on purpose
and count as caught only when their text shows in the output, which proves that the test process
and the rank processes ran the copy's code, not the editable install's.

Not in the table: the NEEDS_RELOAD row of ADMISSION on its own. Without it the request is queued
and the QUEUE_RULES row refuses it within the same step with the same error class (only the
message differs), so these engine tests cannot tell; the spec can: OmniAdmission's
Adm_JoinsQueueOnlyWhereItMayRun breaks (tests/formal/test_admission_rows.py), and the fsm campaign
(scripts/mutate_fsm.py) runs it as `needs-reload-queues`. Here `needs-reload-refusal` changes both
rows, `needs-reload-queued` the queue rule alone.

Slow catches: `reject-policy` and `needs-reload-refusal` run the demo until its refusal probe's own
30 s deadline; the deadline mutants wait for the tests' bound of ten times the deadline.
"""


@dataclasses.dataclass(frozen=True)
class Edit:
    path: str  # relative to the repository root
    original: str  # must occur exactly once in the file
    replacement: str


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    what: str  # the guarantee the mutant removes
    edits: tuple[Edit, ...]
    tests: tuple[str, ...]  # pytest node ids, run from the copy's root
    marker: str = ""  # canaries: the test output must show this text, or the run is an ERROR

    @property
    def files(self) -> str:
        return ", ".join(sorted({e.path for e in self.edits}))


def _m(
    name: str, what: str, path: str, original: str, replacement: str, tests: Iterable[str], marker: str = ""
) -> Mutation:
    return Mutation(name, what, (Edit(path, original, replacement),), tuple(tests), marker)


MUTATIONS: tuple[Mutation, ...] = (
    # ------------------------------------------------------------ canaries: the copy is what runs
    _m(
        "canary-test-process",
        "crash on purpose in Orchestrator.__init__ (proves the test process imports the copy)",
        ORCH,
        "        specs = list(specs)\n",
        f'        raise RuntimeError("{CANARY}: the copy\'s orchestrator ran")\n',
        [f"{ENGINE_TESTS}::test_async_engine_round_trip"],
        marker=f"{CANARY}: the copy's orchestrator ran",
    ),
    _m(
        "canary-rank-process",
        "crash on purpose in `python -m omni_core.workers` (proves the ranks import the copy)",
        RANK_MAIN,
        "    parent_pid = os.getppid()",
        f'    sys.stderr.write("{CANARY}: the copy\'s rank ran\\n")\n    raise SystemExit(97)\n'
        "    parent_pid = os.getppid()",
        [f"{ENGINE_TESTS}::test_async_engine_round_trip"],
        marker=f"{CANARY}: the copy's rank ran",
    ),
    # ------------------------------------------------------------ admission (tables and stage core)
    _m(
        "reject-policy",
        "admission 'reject' removed: a request to a sleeping stage is queued instead",
        ADMISSION,
        "        (R,),\n        Admit.REFUSE_POLICY,\n",
        "        (R,),\n        Admit.QUEUE,\n",
        [f"{FIFTY}[reject]", DEMO_TEST],
    ),
    _m(
        "reject-late",
        "admission 'reject' answers 4 s late (on a timer) instead of at once",
        ORCH,
        "            settle(future, error=request_error(answer))\n",
        "            late = request_error(answer)\n"
        "            delay_s = 4.0 if \"'reject'\" in answer.detail else 0.0  # mutant: the refusal comes 4 s late\n"
        "            threading.Timer(delay_s, lambda: settle(future, error=late)).start()\n",
        [f"{FIFTY}[reject]", DEMO_TEST],
    ),
    _m(
        "queue-full-running",
        "no queue_limit on a RUNNING stage at max_in_flight",
        STAGE_REQUESTS,
        "        elif len(self.queue) >= self.queue_limit:\n",
        "        elif len(self.queue) >= self.queue_limit and self.state is not S.RUNNING:  # mutant\n",
        [f"{ENGINE_TESTS}::test_requests_beyond_max_in_flight_wait_in_the_queue_and_all_complete"],
    ),
    _m(
        "queue-full-asleep",
        "no queue_limit on a stage that is not RUNNING",
        STAGE_REQUESTS,
        "        elif len(self.queue) >= self.queue_limit:\n",
        "        elif len(self.queue) >= self.queue_limit and self.state is S.RUNNING:  # mutant\n",
        [ASLEEP_ADMISSION],
    ),
    Mutation(
        "needs-reload-refusal",
        "NEEDS_RELOAD refuses nothing: neither a new request (ADMISSION) nor a queued one (QUEUE_RULES)",
        (
            Edit(
                ADMISSION,
                "        Admit.REFUSE_NEEDS_RELOAD,\n",
                "        Admit.QUEUE,  # mutant: NEEDS_RELOAD admits\n",
            ),
            Edit(
                ADMISSION,
                "    QueueRow(\n        (S.NEEDS_RELOAD,) + _ENDED,\n",
                '    QueueRow((S.NEEDS_RELOAD,), _ALL, QueueAction.HOLD, "mutant: queued requests wait"),\n'
                "    QueueRow(\n        _ENDED,\n",
            ),
        ),
        (ASLEEP_ADMISSION, DEMO_TEST),
    ),
    _m(
        "needs-reload-queued",
        "requests queued before a level-2 wake are not refused when it lands in NEEDS_RELOAD",
        ADMISSION,
        "    QueueRow(\n        (S.NEEDS_RELOAD,) + _ENDED,\n",
        '    QueueRow((S.NEEDS_RELOAD,), _ALL, QueueAction.HOLD, "mutant: queued requests wait"),\n'
        "    QueueRow(\n        _ENDED,\n",
        [ASLEEP_ADMISSION],
    ),
    _m(
        "auto-wake",
        "admission 'wake': a queued request no longer wakes a sleeping stage (QUEUE_RULES)",
        ADMISSION,
        "    QueueRow(_ASLEEP, (W,), QueueAction.AUTO_WAKE,",
        "    QueueRow(_ASLEEP, (W,), QueueAction.HOLD,  # mutant: no auto-wake\n            ",
        [f"{FIFTY}[wake]"],
    ),
    # ------------------------------------------------------------ deadlines (stage core, orchestrator)
    _m(
        "lifecycle-deadline",
        "the tick no longer calls _tick: no lifecycle (or start) deadline",
        STAGE_CORE,
        "                return self._tick(now).then(self._expire_requests(now))\n",
        "                return self._expire_requests(now)  # mutant: no _tick\n",
        [f"{ENGINE_TESTS}::test_silent_rank_ends_in_failed_at_the_deadline_naming_it"],
    ),
    _m(
        "request-deadline",
        "a request a rank never answers has no deadline",
        STAGE_REQUESTS,
        "        for request in [r for r in self.in_flight.values() if now >= r.deadline_at_s]:\n",
        "        for request in []:  # mutant: no request deadline\n",
        [f"{ENGINE_TESTS}::test_a_rank_silent_on_a_request_fails_the_stage_naming_it"],
    ),
    _m(
        "queue-deadline",
        "a queued request never expires while the stage stays asleep",
        STAGE_REQUESTS,
        "        for request in self.queue.pop_expired(now):\n",
        "        for request in []:  # mutant: no queue deadline\n",
        [f"{ENGINE_TESTS}::test_a_queued_request_is_refused_at_its_own_deadline_if_the_stage_stays_asleep"],
    ),
    _m(
        "start-deadline",
        "the Engine gives a stage's start no start-up deadline",
        API,
        "self._orch.submit(name, Start(spec.start_deadline_s))",
        'self._orch.submit(name, Start(float("inf")))',  # mutant: no start deadline
        [f"{ENGINE_TESTS}::test_a_rank_silent_at_start_fails_the_start_at_the_start_deadline"],
    ),
    # ------------------------------------------------------------ the drain
    _m(
        "drain-core",
        "the stage core sends Sleep at once, with requests still in flight",
        STAGE_CALLS,
        "            self.lifecycle.fire(row.drain)\n"
        "            step = self._send_drained(now) if self.in_flight_requests == 0 else StageStep()\n",
        "            self.lifecycle.fire(row.drain)\n            step = self._send_drained(now)  # mutant: no drain\n",
        [f"{DRAIN}[wait]"],
    ),
    _m(
        "drain-first-answer",
        "a request retires at its first rank's answer, not the last's",
        STAGE_REQUESTS,
        "        if len(request.replies) < len(self.ranks):\n",
        "        if not request.replies:  # mutant: retire at the first answer\n",
        [f"{DRAIN}[wait]", f"{DRAIN}[abort]"],
    ),
    # ------------------------------------------------------------ worker core
    _m(
        "reply-cache",
        "a duplicate of an answered command is handled again instead of answered from the cache",
        WORKER_CORE,
        "            cached = self.cache.get(command.task_id)\n",
        "            cached = None  # mutant: no reply cache\n",
        [
            "tests/test_worker_core.py::test_duplicate_after_completion_has_no_second_effect",
            "tests/test_worker_core.py::test_same_command_from_a_newer_epoch_is_still_a_duplicate",
        ],
    ),
    _m(
        "epoch-fence",
        "a command from an older epoch is obeyed (and lowers the worker's epoch)",
        WORKER_CORE,
        "        if command.epoch < self.epoch:\n",
        "        if False:  # mutant: no epoch fence\n",
        ["tests/test_worker_core.py::test_stale_epoch_is_refused_and_newer_epoch_adopted"],
    ),
    # ------------------------------------------------------------ worker shell
    _m(
        "shell-bad-message",
        "the worker shell dies on undecodable bytes instead of NACKing them",
        SHELL,
        "            self._send_all(core.step(BadFrame(err)))\n",
        "            raise  # mutant: garbage kills the rank\n",
        [
            "tests/workers/test_process_lifecycle.py::test_garbage_gets_bad_message_and_the_worker_keeps_serving[3]",
            # The frame isolation answers the raise with BAD_MESSAGE too: only the detail tells.
            "tests/workers/test_process_lifecycle.py::test_garbage_is_refused_as_bad_bytes_not_as_a_failure_of_the_worker",
        ],
    ),
    # ------------------------------------------------------------ trace validation's checks of the records
    _m(
        "trace-liveness-off",
        "a run that ended owes nothing at the end of its trace (a queued request never answered passes)",
        TRACE_CHECKS,
        '        if not self._stopped:\n            return ""\n',
        '        return ""  # mutant\n',
        [f"{TRACE_CHECKS_TESTS}::test_the_lie_is_refuted_where_the_replay_must_stop[queued_request_unanswered]"],
    ),
    _m(
        "trace-admission-unchecked",
        "a request's admission is not held to the table (refused by the policy while RUNNING passes)",
        TRACE_CHECKS,
        "        if not fits:\n            table = ",
        "        if False:  # mutant\n            table = ",
        [f"{TRACE_CHECKS_TESTS}::test_the_lie_is_refuted_where_the_replay_must_stop[refused_by_policy_while_running]"],
    ),
    _m(
        "trace-auto-wake-unchecked",
        "a wake the stage started itself is not held to the queue rules (an auto-wake under 'queue' passes)",
        TRACE_CHECKS,
        'if r.command != "Wake" or not fits:',
        "if False:  # mutant",
        [f"{TRACE_CHECKS_TESTS}::test_the_lie_is_refuted_where_the_replay_must_stop[auto_wake_under_queue]"],
    ),
    _m(
        "trace-fenced-trusted",
        "a death's `fenced` flag is taken as written (a death of the stage's own epoch hidden)",
        TRACE_CHECKS,
        "        if r.fenced == fenced:\n",
        "        if True:  # mutant\n",
        [f"{TRACE_CHECKS_TESTS}::test_the_lie_is_refuted_where_the_replay_must_stop[fenced_hides_death]"],
    ),
    _m(
        "trace-no-memory-untimed",
        "a NO_MEMORY refusal is not held to its wake's wait (refused after 10 ms of a 0.2 s wait passes)",
        TRACE_CHECKS,
        "if taken is not None and line.mono_s + CLOCK_SLACK_S < taken + wait_s:",
        "if False:  # mutant",
        [f"{TRACE_CHECKS_TESTS}::test_the_lie_is_refuted_where_the_replay_must_stop[no_memory_before_wait]"],
    ),
    _m(
        "trace-holds-unchecked",
        "incoming wakes' holds are not compared across stages (two on one device pass)",
        TRACE_CHECKS,
        "            if devices & held:\n",
        "            if False:  # mutant\n",
        [f"{TRACE_CHECKS_TESTS}::test_the_lie_is_refuted_where_the_replay_must_stop[incoming_wakes_overlap]"],
    ),
)


# ============================================================================ the source tree


class StaleTable(Exception):
    """A snippet of the table is not in the sources (or not exactly once)."""


def source_files(ref: str | None) -> dict[str, bytes] | None:
    """The files of a commit, or None for the working tree (read from disk)."""
    if ref is None:
        return None
    names = subprocess.run(
        ["git", "ls-tree", "-r", "-z", "--name-only", ref], cwd=REPO, check=True, capture_output=True
    ).stdout.split(b"\0")
    wanted = {e.path for m in MUTATIONS for e in m.edits} | {t.split("::")[0] for m in MUTATIONS for t in m.tests}
    out = {}
    for name in filter(None, (n.decode() for n in names)):
        if name in wanted:
            out[name] = subprocess.run(
                ["git", "show", f"{ref}:{name}"], cwd=REPO, check=True, capture_output=True
            ).stdout
    return out


def read_source(path: str, tree: dict[str, bytes] | None, root: Path = REPO) -> str | None:
    if tree is not None:
        data = tree.get(path)
        return None if data is None else data.decode()
    file = root / path
    return file.read_text() if file.is_file() else None


def problems(mutation: Mutation, tree: dict[str, bytes] | None, root: Path = REPO) -> list[str]:
    """Why the mutation cannot be applied as written, or why its tests cannot run (empty: fine)."""
    found: list[str] = []
    for edit in mutation.edits:
        text = read_source(edit.path, tree, root)
        if text is None:
            found.append(f"{edit.path} does not exist")
            continue
        count = text.count(edit.original)
        if count != 1:
            first = edit.original.strip().splitlines()[0][:80]
            found.append(f"{edit.path}: snippet {first!r} found {count} times, expected once")
    for node in mutation.tests:
        path, _, rest = node.partition("::")
        text = read_source(path, tree, root)
        function = re.sub(r"\[.*\]$", "", rest)
        if text is None:
            found.append(f"test file {path} does not exist")
        elif function and not re.search(rf"^def {re.escape(function)}\(", text, re.MULTILINE):
            found.append(f"{path} defines no test {function}")
    if not mutation.tests:
        found.append("no tests listed")
    return found


def apply(mutation: Mutation, root: Path) -> None:
    for edit in mutation.edits:
        file = root / edit.path
        text = file.read_text()
        if text.count(edit.original) != 1:
            raise StaleTable(f"{mutation.name}: {edit.path} snippet not found exactly once in the copy")
        file.write_text(text.replace(edit.original, edit.replacement))


def copy_tree(dest: Path, ref: str | None) -> None:
    """The repository without .git, .venv and what git ignores (caches, build outputs)."""
    dest.mkdir(parents=True)
    if ref is not None:
        archive = subprocess.run(
            ["git", "archive", "--format=tar", ref], cwd=REPO, check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
        return
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        source = REPO / name
        if source.is_file():  # a tracked file deleted in the working tree is not copied
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


# ============================================================================ running


@dataclasses.dataclass
class Outcome:
    name: str
    result: str  # CAUGHT, SURVIVED, ERROR
    caught_by: list[str]
    detail: str
    duration_s: float


def run_env(root: Path) -> dict[str, str]:
    env = dict(os.environ)
    # PYTHONPATH precedes site-packages, where the editable install's finder sits (it is
    # appended to sys.meta_path, after the path finder); rank processes inherit it.
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    env["HYPOTHESIS_PROFILE"] = "ci"  # derandomized: a mutant is judged on the same examples each time
    env.pop("PYTEST_ADDOPTS", None)
    return env


def check_imports(root: Path) -> None:
    """The copy's package must be the one imported, in a test process and in a rank process."""
    probes = {
        "test process": "import omni_core; print(omni_core.__file__)",
        "rank process": "import omni_core.workers.__main__ as m; print(m.__file__)",
    }
    for who, code in probes.items():
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=root, env=run_env(root), check=True, capture_output=True, text=True
        ).stdout.strip()
        if not Path(out).resolve().is_relative_to(root.resolve()):
            raise SystemExit(f"ERROR: the {who} imports omni_core from {out}, not from the copy {root}")


def pytest_command(tests: Sequence[str], junit: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        f"--timeout={PER_TEST_TIMEOUT_S}",
        f"--junitxml={junit}",
        *tests,
    ]


def failed_tests(junit: Path) -> tuple[list[str], int, str]:
    """(node ids that failed or errored, tests run, first failure's message) from a JUnit file."""
    if not junit.is_file():
        return [], 0, ""
    failed: list[str] = []
    first = ""
    cases = ET.parse(junit).getroot().iter("testcase")
    count = 0
    for case in cases:
        count += 1
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is None:
            continue
        module = case.get("classname", "").replace(".", "/")
        failed.append(f"{module}.py::{case.get('name')}")
        if not first:
            first = (bad.get("message") or "").splitlines()[0][:160] if bad.get("message") else ""
    return failed, count, first


def run_tests(root: Path, tests: Sequence[str], log: Path) -> tuple[int, str, list[str], int, str]:
    junit = log.with_suffix(".xml")
    try:
        proc = subprocess.run(
            pytest_command(tests, junit),
            cwd=root,
            env=run_env(root),
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
        )
        code, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        code = -1
        output = f"{exc.stdout or ''}{exc.stderr or ''}\nwhole run timed out after {RUN_TIMEOUT_S} s"
    log.write_text(output)
    failed, count, first = failed_tests(junit)
    return code, output, failed, count, first


def run_mutation(mutation: Mutation, pristine: Path, work: Path) -> Outcome:
    started = time.monotonic()
    root = work / mutation.name
    shutil.copytree(pristine, root)
    try:
        apply(mutation, root)
    except StaleTable as exc:
        return Outcome(mutation.name, "ERROR", [], str(exc), time.monotonic() - started)
    code, output, failed, count, first = run_tests(root, mutation.tests, work / f"{mutation.name}.log")
    duration_s = time.monotonic() - started
    if code == 0:
        return Outcome(mutation.name, "SURVIVED", [], f"{count} tests passed", duration_s)
    if mutation.marker and mutation.marker not in output:
        return Outcome(
            mutation.name,
            "ERROR",
            failed,
            f"tests failed but the canary text {mutation.marker!r} never showed: the copy's code may not be what ran",
            duration_s,
        )
    if failed:
        return Outcome(mutation.name, "CAUGHT", failed, first, duration_s)
    tail = " | ".join(output.strip().splitlines()[-3:])[:300]
    return Outcome(mutation.name, "ERROR", [], f"pytest exit {code} without a failed test: {tail}", duration_s)


# ============================================================================ reporting


def describe_commit(ref: str | None) -> str:
    head = subprocess.run(
        ["git", "rev-parse", "--short", ref or "HEAD"], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout.strip()
    if ref is not None:
        return f"{head} (committed tree, --ref {ref})"
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout.strip()
    return f"{head}" + (" + uncommitted changes in the working tree" if dirty else " (clean working tree)")


def machine() -> str:
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"{platform.node()}: {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}, load average at start {load}"
    )


def markdown(outcomes: Sequence[Outcome], header: dict[str, str]) -> str:
    lines = ["# Mutation testing: can the tests fail?", ""]
    lines += [f"- {k}: {v}" for k, v in header.items()]
    lines += ["", "| mutation | file | what it breaks | result | caught by | time |", "|---|---|---|---|---|---|"]
    by_name = {m.name: m for m in MUTATIONS}
    for o in outcomes:
        m = by_name.get(o.name)
        caught = "<br>".join(f"`{t.split('::', 1)[1]}`" for t in o.caught_by) or o.detail.replace("|", "\\|")
        lines.append(
            f"| `{o.name}` | {m.files if m else '-'} | {m.what if m else '-'} | **{o.result}** | "
            f"{caught} | {o.duration_s:.1f} s |"
        )
    lines += ["", NOTES.rstrip("\n"), "", "Tests run per mutation (node ids):", ""]
    for o in outcomes:
        m = by_name.get(o.name)
        if m is not None:
            lines.append(f"- `{o.name}`: " + ", ".join(f"`{t}`" for t in m.tests))
    return "\n".join(lines) + "\n"


def print_table(selected: Sequence[Mutation], tree: dict[str, bytes] | None) -> int:
    stale = 0
    for m in selected:
        issues = problems(m, tree)
        stale += bool(issues)
        print(f"{m.name:<22} {'ok   ' if not issues else 'STALE'} {m.files:<34} {m.what}")
        for t in m.tests:
            print(f"{'':<28}test {t}")
        for issue in issues:
            print(f"{'':<28}ERROR {issue}")
    print(f"{len(selected)} mutations, {stale} stale")
    return 1 if stale else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print the table and check every snippet; run nothing")
    parser.add_argument("--only", action="append", default=[], metavar="NAME", help="run this mutation (repeatable)")
    parser.add_argument("--tests", nargs="+", metavar="NODE", help="with one --only: run these tests instead")
    parser.add_argument("--ref", help="mutate the tree of this commit instead of the working tree")
    parser.add_argument("--out", type=Path, help="write the results table (Markdown) here")
    parser.add_argument("--keep", action="store_true", help="keep the copies and logs (printed path)")
    args = parser.parse_args(argv)
    names = {m.name for m in MUTATIONS}
    unknown = [n for n in args.only if n not in names]
    if unknown:
        parser.error(f"unknown mutation(s) {unknown}; --list shows them")
    selected = [m for m in MUTATIONS if not args.only or m.name in args.only]
    if args.tests:
        if len(selected) != 1:
            parser.error("--tests needs exactly one --only")
        selected = [dataclasses.replace(selected[0], tests=tuple(args.tests))]
    tree = source_files(args.ref)
    if args.list:
        return print_table(selected, tree)

    started = time.monotonic()
    header = {
        "machine": machine(),
        "commit": describe_commit(args.ref),
        "command": shlex.join(["python", "scripts/mutate.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    outcomes: list[Outcome] = []
    runnable = []
    for m in selected:
        issues = problems(m, tree)
        if issues:
            outcomes.append(Outcome(m.name, "ERROR", [], "stale table: " + "; ".join(issues), 0.0))
            print(f"{m.name}: ERROR {'; '.join(issues)}", flush=True)
        else:
            runnable.append(m)
    work = Path(tempfile.mkdtemp(prefix="omni-mutate-"))
    try:
        pristine = work / "_pristine"
        copy_tree(pristine, args.ref)
        check_imports(pristine)
        union = list(dict.fromkeys(t for m in runnable for t in m.tests))
        print(f"baseline: {len(union)} test ids on the unmutated copy ...", flush=True)
        base_started = time.monotonic()
        code, _, failed, count, first = run_tests(pristine, union, work / "_baseline.log")
        header["baseline"] = f"{count} tests passed unmutated in {time.monotonic() - base_started:.0f} s"
        if code != 0:
            print(f"ERROR: the tests fail without a mutation ({failed or code}: {first}); log in {work}")
            args.keep = True
            return 2
        print(header["baseline"], flush=True)
        for m in runnable:
            outcome = run_mutation(m, pristine, work)
            outcomes.append(outcome)
            print(
                f"{m.name}: {outcome.result} in {outcome.duration_s:.1f} s "
                f"{', '.join(outcome.caught_by) or outcome.detail}",
                flush=True,
            )
    finally:
        if args.keep:
            print(f"copies and logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    order = {m.name: i for i, m in enumerate(MUTATIONS)}
    outcomes.sort(key=lambda o: order.get(o.name, len(order)))
    header["total"] = f"{time.monotonic() - started:.0f} s"
    counts = {r: sum(o.result == r for o in outcomes) for r in ("CAUGHT", "SURVIVED", "ERROR")}
    header["summary"] = ", ".join(f"{n} {r.lower()}" for r, n in counts.items())
    print(header["summary"])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(markdown(outcomes, header))
    return 0 if counts["SURVIVED"] == counts["ERROR"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
