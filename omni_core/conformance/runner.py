"""Runs cases against a worker target and reports per requirement.

One worker (rank 0) is shared by the `shared` cases and replaced whenever a case fails or
leaves it anything but ACTIVE with every tag resident, so a failure never leaks into the
next case. The CLI and the pytest plugin both drive this class; the plugin one case per
test, the CLI all of them through `run()`.
"""

from __future__ import annotations

import re
import textwrap
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from omni_core.conformance.cases import REQUIREMENT_ORDER, Case, Ctx, ordered_cases, run_wide
from omni_core.conformance.harness import CaseFailure, CaseSkip, Harness, Peer, StartError, SuiteOptions, show
from omni_core.conformance.pressure import pressure_for, resolve_pressure
from omni_core.conformance.requirements import REQUIREMENTS, Requirement
from omni_core.conformance.targets import (
    WorkerFactory,
    failing_factory_for,
    needs_reload_factory_for,
    resolve_target,
)
from omni_core.progress import Progress
from omni_core.protocol import PROTOCOL_VERSION, Ack, Status, WorkerState

Outcome = Literal["pass", "fail", "skip"]
# Characters XML 1.0 cannot carry at all (a worker's output may hold any of them): shown escaped.
_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def xml_safe(text: str) -> str:
    return _NOT_XML.sub(
        lambda m: f"\\x{ord(m.group(0)):02x}" if ord(m.group(0)) < 256 else f"\\u{ord(m.group(0)):04x}", text
    )


@dataclass
class CaseResult:
    case: Case
    outcome: Outcome
    reason: str = ""  # failure problem or skip reason, one line
    failure: CaseFailure | None = None
    duration_s: float = 0.0

    def details(self) -> str:
        """The failure as the suite reports it: requirement quoted, what was sent, what came back."""
        req = REQUIREMENTS[self.case.req]
        lines = [
            f"{self.case.id}: {self.case.title}",
            f"  requirement {req.id} ({req.title}):",
            *textwrap.wrap(f'"{req.text}"', 100, initial_indent="    ", subsequent_indent="    "),
            f"  problem:  {self.failure.problem if self.failure else self.reason}",
        ]
        failure = self.failure
        if failure is not None and (failure.sent is not None or failure.got is not None):
            for label, value in (("sent", failure.sent), ("got", failure.got), ("expected", failure.expected)):
                if value is not None or label == "got":  # "got: nothing" says something
                    lines.append(f"  {label + ':':9} {show(value)}")
        return "\n".join(lines)


def parse_only(only: str | Iterable[str] | None) -> tuple[str, ...] | None:
    """'P-3,P-7' or ['P-3', 'p7'] -> ('P-3', 'P-7'); None means every requirement."""
    if only is None:
        return None
    items = only.split(",") if isinstance(only, str) else list(only)
    out = []
    for item in items:
        item = item.strip().upper()
        if not item:
            continue
        if not item.startswith("P-"):
            item = "P-" + item.removeprefix("P")
        if item not in REQUIREMENTS:
            raise ValueError(f"unknown requirement {item!r}; choose from {', '.join(REQUIREMENT_ORDER)}")
        out.append(item)
    return tuple(dict.fromkeys(out))


@dataclass
class SuiteReport:
    target: str
    results: list[CaseResult]
    only: tuple[str, ...] | None = None
    duration_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    def requirements(self) -> list[tuple[Requirement, list[CaseResult]]]:
        # The run-wide stray check runs under any --only, so its requirement is listed too.
        chosen = REQUIREMENT_ORDER if self.only is None else {*self.only, *(r.case.req for r in self.results)}
        return [
            (REQUIREMENTS[r], [x for x in self.results if x.case.req == r]) for r in REQUIREMENT_ORDER if r in chosen
        ]

    @staticmethod
    def verdict(req: Requirement, results: list[CaseResult]) -> Literal["PASS", "FAIL", "SKIP", "N/A"]:
        if not req.worker:
            return "N/A"
        if any(r.outcome == "fail" for r in results):
            return "FAIL"
        if any(r.outcome == "pass" for r in results):
            return "PASS"
        return "SKIP"

    @property
    def failed(self) -> bool:
        return any(r.outcome == "fail" for r in self.results)

    def failed_requirements(self) -> set[str]:
        return {r.case.req for r in self.results if r.outcome == "fail"}

    def line(self, req: Requirement, results: list[CaseResult]) -> str:
        verdict = self.verdict(req, results)
        head = f"{req.id:<5} {verdict:<4}  {req.title.lower()}"
        passed = [r for r in results if r.outcome == "pass"]
        skipped = [r for r in results if r.outcome == "skip"]
        failed = [r for r in results if r.outcome == "fail"]
        if verdict == "N/A":
            return f"{head}: {req.why_not}"
        if verdict == "FAIL":
            first = failed[0]
            more = f" (+{len(failed) - 1} more failing case(s))" if len(failed) > 1 else ""
            return f"{head}: {first.case.name}: {first.reason}{more}"
        if verdict == "SKIP":
            return f"{head}: " + "; ".join(sorted({r.reason for r in skipped})) if skipped else f"{head}: no cases"
        note = f", {len(skipped)} skipped: " + "; ".join(sorted({r.reason for r in skipped})) if skipped else ""
        return f"{head} ({len(passed)} case{'s' if len(passed) != 1 else ''}{note})"

    def to_json(self) -> dict:
        """The report as data (`omni-core conformance --json`): a verdict per requirement and
        each case's outcome, with a failure's details as the text report words them."""
        return {
            "target": self.target,
            "protocol_version": PROTOCOL_VERSION,
            "passed": not self.failed,
            "duration_s": round(self.duration_s, 3),
            "notes": list(self.notes),
            "requirements": [
                {
                    "id": req.id,
                    "title": req.title,
                    "verdict": self.verdict(req, results),
                    "cases": [
                        {
                            "name": r.case.name,
                            "title": r.case.title,
                            "outcome": r.outcome,
                            "reason": r.reason,
                            "duration_s": round(r.duration_s, 3),
                            "details": r.details() if r.outcome == "fail" else None,
                        }
                        for r in results
                    ],
                }
                for req, results in self.requirements()
            ],
        }

    def render(self, verbose: bool = False) -> str:
        out = [f"omni-core conformance (protocol v{PROTOCOL_VERSION}) against: {self.target}"]
        reqs = self.requirements()
        for req, results in reqs:
            out.append(self.line(req, results))
            if verbose:
                for r in results:
                    out.append(
                        f"        {r.outcome.upper():<4}  {r.case.name}: {r.reason or r.case.title} "
                        f"({r.duration_s:.2f} s)"
                    )
        failures = [r for r in self.results if r.outcome == "fail"]
        if failures:
            out.append("")
            out.append("failures:")
            for r in failures:
                out.append(textwrap.indent(r.details(), "  "))
                out.append("")
        out.extend(self.notes)
        counted = [(req, self.verdict(req, res)) for req, res in reqs]
        n = {v: sum(1 for _, x in counted if x == v) for v in ("PASS", "FAIL", "SKIP", "N/A")}
        cases = {o: sum(1 for r in self.results if r.outcome == o) for o in ("pass", "fail", "skip")}
        checked = len(counted) - n["N/A"]
        out.append(
            f"summary: {'FAILED' if self.failed else 'PASSED'}: {checked} requirement"
            f"{'s' if checked != 1 else ''} checked: "
            f"{n['PASS']} passed, {n['FAIL']} failed, {n['SKIP']} skipped ({n['N/A']} not applicable "
            f"to a worker); {len(self.results)} cases: {cases['pass']} passed, {cases['fail']} failed, "
            f"{cases['skip']} skipped; {self.duration_s:.1f} s"
        )
        return "\n".join(out)

    def junit_xml(self) -> str:
        not_applicable = [req for req, _ in self.requirements() if not req.worker]
        suite = ET.Element(
            "testsuite",
            name="omni-core conformance",
            tests=str(len(self.results) + len(not_applicable)),
            failures=str(sum(r.outcome == "fail" for r in self.results)),
            errors="0",
            skipped=str(sum(r.outcome == "skip" for r in self.results) + len(not_applicable)),
            time=f"{self.duration_s:.3f}",
        )
        props = ET.SubElement(suite, "properties")
        ET.SubElement(props, "property", name="target", value=xml_safe(self.target))
        ET.SubElement(props, "property", name="protocol_version", value=str(PROTOCOL_VERSION))
        for r in self.results:
            tc = ET.SubElement(
                suite, "testcase", classname=f"conformance.{r.case.req}", name=r.case.name, time=f"{r.duration_s:.3f}"
            )
            if r.outcome == "fail":
                ET.SubElement(tc, "failure", message=xml_safe(f"{r.case.req}: {r.reason}")).text = xml_safe(r.details())
            elif r.outcome == "skip":
                ET.SubElement(tc, "skipped", message=xml_safe(r.reason))
        for req in not_applicable:
            tc = ET.SubElement(suite, "testcase", classname=f"conformance.{req.id}", name="not_applicable")
            ET.SubElement(tc, "skipped", message=req.why_not)
        ET.indent(suite)
        return ET.tostring(suite, encoding="unicode", xml_declaration=True) + "\n"

    def write_junit(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.junit_xml())


class SuiteRunner:
    """Cases against one target. `run_case` one at a time (pytest), or `run()` for all."""

    def __init__(
        self,
        target: str | WorkerFactory,
        *,
        options: SuiteOptions | None = None,
        only: str | Iterable[str] | None = None,
    ) -> None:
        self.description, self.factory = resolve_target(target)
        self.options = options or SuiteOptions()
        self.only = parse_only(only)
        failing = self.options.failing_worker
        self.failing_factory = resolve_target(failing)[1] if failing is not None else failing_factory_for(target)
        unserved = self.options.needs_reload_worker
        self.needs_reload_factory = (
            resolve_target(unserved)[1] if unserved is not None else needs_reload_factory_for(target)
        )
        pressure = self.options.memory_pressure
        self.pressure_factory = resolve_pressure(pressure) if pressure is not None else pressure_for(target)
        self._harness: Harness | None = None
        self._shared: Peer | None = None
        self._start_error: str = ""
        self._strays: list[str] = []
        self._strays_reported = 0  # how many of them a run-wide check has reported
        self._silenced: str = ""  # the case in which the worker let a deadline pass, and how

    def cases(self) -> list[Case]:
        """The chosen requirements' cases, and always the run-wide stray check: a stray reply
        can follow any command, so a subset must not drop it."""
        return [c for c in ordered_cases() if self.only is None or c.req in self.only or run_wide(c)]

    def unreported_strays(self) -> list[str]:
        """Strays no run-wide check has reported yet (the pytest plugin fails on them at
        teardown when `-k` left that check out)."""
        if self._harness is not None:
            self._note_strays(self._harness, "")
        return self._strays[self._strays_reported :]

    # ------------------------------------------------------------------ the shared worker

    def _shared_worker(self) -> Peer:
        if self._shared is not None and self._shared.process.alive():
            return self._shared
        self._discard_shared()
        if self._start_error:
            raise StartError(self._start_error)
        self._harness = self._new_harness()
        try:
            (self._shared,) = self._harness.start((0,), self.options.epoch)
        except StartError as exc:
            self._start_error = f"the worker did not start: {exc}"
            self._discard_shared()
            raise StartError(self._start_error) from None
        return self._shared

    def _new_harness(self) -> Harness:
        harness = Harness(self.factory, self.options)
        harness.case_deadline = self._case_deadline
        return harness

    def _discard_shared(self) -> None:
        if self._harness is not None:
            self._note_strays(self._harness, "")
            self._harness.close()
        self._harness, self._shared = None, None

    def _still_usable(self, peer: Peer) -> bool:
        """ACTIVE, nothing asleep, answering: the state every shared case must leave behind."""
        if not peer.process.alive():
            return False
        command = Status(task_id=f"conformance-check-{time.monotonic_ns()}", epoch=peer.epoch)
        try:
            reply = peer.request(command, timeout_s=min(self.options.reply_timeout_s, 5.0))
        except CaseFailure:
            return False
        return isinstance(reply, Ack) and reply.state is WorkerState.ACTIVE and not reply.asleep_tags

    def _note_strays(self, harness: Harness, after: str) -> None:
        for peer, message in harness.strays():
            self._strays.append(f"{peer}{' during ' + after if after else ''}: {show(message)}")
        for peer in harness.peers.values():
            peer.strays.clear()

    # ------------------------------------------------------------------ cases

    _case_deadline: float | None = None

    def run_case(self, case: Case) -> CaseResult:
        started = time.monotonic()
        self._case_deadline = started + self.options.case_timeout_s
        if self._harness is not None:
            self._harness.case_deadline = self._case_deadline
        try:
            result = self._run_case(case)
        finally:
            self._case_deadline = None
            if self._harness is not None:
                self._harness.case_deadline = None
        result.duration_s = time.monotonic() - started
        return result

    def _run_case(self, case: Case) -> CaseResult:
        if self._silenced and not run_wide(case):
            # Fail fast: every later case would wait out the same deadline and fail for the
            # same reason; one clear failure says more than ten.
            return CaseResult(case, "skip", f"not run: {self._silenced}; fix that first")
        own: Harness | None = None
        worker: Peer | None = None
        try:
            if case.scope in ("shared", "consume"):
                worker = self._shared_worker()
                missing = [c for c in case.needs if c not in worker.capabilities]
                if missing:
                    raise CaseSkip(f"worker does not declare capability {', '.join(map(repr, missing))}")
                present = [c for c in case.unless if c in worker.capabilities]
                if present:
                    raise CaseSkip(
                        f"worker declares capability {', '.join(map(repr, present))}; "
                        "this case is for workers without it"
                    )
            ctx = Ctx(case, worker, None, self.options, self._new_harness)
            ctx.failing_factory = self.failing_factory
            ctx.needs_reload_factory = self.needs_reload_factory
            ctx.pressure_factory = self.pressure_factory
            if run_wide(case):
                ctx.stray_note = "\n".join(self._strays)
                self._strays_reported = len(self._strays)
            try:
                case.run(ctx)
            finally:
                own = ctx.harness
                if own is not None:
                    self._note_strays(own, case.id)
                    own.close()
            if case.scope == "shared" and self._harness is not None:
                self._harness.drain()
                self._note_strays(self._harness, case.id)
            return CaseResult(case, "pass")
        except CaseSkip as skip:
            return CaseResult(case, "skip", str(skip))
        except CaseFailure as failure:
            if failure.silent:
                self._silenced = f"the worker went silent in {case.id} ({failure.problem.splitlines()[0]})"
            if case.scope in ("shared", "consume"):
                self._discard_shared()
            return CaseResult(case, "fail", failure.problem.splitlines()[0], failure)
        except StartError as exc:
            if case.scope in ("shared", "consume"):
                self._discard_shared()
            return CaseResult(case, "fail", str(exc).splitlines()[0], CaseFailure(str(exc)))
        except Exception as exc:  # an answer no case foresaw must not end the run
            if case.scope in ("shared", "consume"):
                self._discard_shared()
            problem = (
                f"the suite could not finish this case: {type(exc).__name__}: {str(exc)[:300]} "
                "(an answer the case did not foresee; the details show the last exchange)"
            )
            return CaseResult(case, "fail", problem, CaseFailure(problem, got=traceback.format_exc(limit=4)))
        finally:
            if case.scope == "consume":
                self._discard_shared()
            elif (
                case.scope == "shared"
                and self._shared is not None
                and (self._silenced or not self._still_usable(self._shared))
            ):
                self._discard_shared()  # the next case gets a fresh worker

    def run(self, progress: Progress | None = None) -> SuiteReport:
        """Every case; `progress` (omni_core.progress) counts them as they end."""
        started = time.monotonic()
        cases = list(self.cases())
        if progress is not None:
            progress.add_total(len(cases))
        results = []
        try:
            for case in cases:
                results.append(self.run_case(case))
                if progress is not None:
                    progress.advance(1)
        finally:
            self.close()
        return SuiteReport(self.description, results, self.only, time.monotonic() - started)

    def close(self) -> None:
        self._discard_shared()


def run_suite(
    target: str | WorkerFactory,
    *,
    only: str | Iterable[str] | None = None,
    options: SuiteOptions | None = None,
    progress: Progress | None = None,
) -> SuiteReport:
    """Run the suite against `target` (see `omni_core.conformance.targets`) and report."""
    return SuiteRunner(target, options=options, only=only).run(progress)
