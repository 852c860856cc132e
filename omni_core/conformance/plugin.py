"""pytest plugin (entry point `pytest11`): subclass `ConformanceSuite`, say how to start your
worker, and pytest runs one test per case, named after the requirement it checks.

    from omni_core.conformance import ConformanceSuite, SuiteOptions

    class TestMyWorker(ConformanceSuite):
        worker = "cmd:./my-worker --connect {address} --rank {rank} --epoch {epoch}"
        options = SuiteOptions(execute_payload={"prompt": "hi"})

    class TestMyOtherWorker(ConformanceSuite):
        def start_worker(self, address, rank, epoch):
            return ["./my-worker", "--connect", address, "--rank", str(rank), "--epoch", str(epoch)]

Tests are `test_requirement[P-n/case]`; select with `-k P-7/` or `only = "P-3,P-7"` (the run-wide
stray check, `P-1/no_stray_replies`, stays in under `only`; where `-k` leaves it out, a stray
still fails the class, at teardown). A failure
quotes the requirement with what was sent and what came back; a case needing a capability
the worker does not declare in Hello is a skip naming the capability.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from omni_core.conformance.cases import Case, ordered_cases, run_wide
from omni_core.conformance.harness import SuiteOptions
from omni_core.conformance.runner import SuiteRunner, parse_only
from omni_core.conformance.targets import WorkerFactory


class ConformanceSuite:
    """Base class of a conformance test class. Set `worker`, or override `start_worker`."""

    # A target string ("synthetic", "cmd:...", "package.module:factory") or a factory.
    worker: ClassVar[str | WorkerFactory | None] = None
    # Requirements to check, e.g. "P-3,P-7"; None: all of them.
    only: ClassVar[str | tuple[str, ...] | None] = None
    options: ClassVar[SuiteOptions] = SuiteOptions()

    def start_worker(self, address: str, rank: int, epoch: int) -> Any:
        """Start one worker that connects to `address` as `rank` in `epoch`. Return an argv
        list, a shell command string, a WorkerConfig/dict, or a started process."""
        raise NotImplementedError

    def test_requirement(self, conformance_case: Case, conformance_runner: SuiteRunner, record_property: Any) -> None:
        record_property("requirement", conformance_case.req)
        result = conformance_runner.run_case(conformance_case)
        if result.outcome == "skip":
            pytest.skip(f"{conformance_case.req}: {result.reason}")
        if result.outcome == "fail":
            pytest.fail(result.details(), pytrace=False)


def _target(cls: type[ConformanceSuite]) -> str | WorkerFactory:
    if cls.start_worker is not ConformanceSuite.start_worker:
        return cls().start_worker
    if cls.worker is None:
        pytest.fail(
            f"{cls.__name__}: set `worker = <target>` or override `start_worker(self, address, rank, epoch)`",
            pytrace=False,
        )
    target = cls.worker
    # A plain function stored on the class comes back bound; the factory takes no self.
    return getattr(target, "__func__", target)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    cls = metafunc.cls
    if cls is None or not issubclass(cls, ConformanceSuite) or "conformance_case" not in metafunc.fixturenames:
        return
    only = parse_only(cls.only)
    cases = [c for c in ordered_cases() if only is None or c.req in only or run_wide(c)]
    metafunc.parametrize("conformance_case", cases, ids=[c.id for c in cases])


@pytest.fixture(scope="class")
def conformance_runner(request: pytest.FixtureRequest) -> Iterator[SuiteRunner]:
    """One runner per test class: its shared worker lives across that class's cases."""
    cls = request.cls
    if cls is None or not issubclass(cls, ConformanceSuite):
        pytest.fail("conformance_runner is for subclasses of omni_core.conformance.ConformanceSuite", pytrace=False)
    try:
        runner = SuiteRunner(_target(cls), options=cls.options)
    except ValueError as exc:  # TargetError: a target that cannot be resolved
        pytest.fail(f"{cls.__name__}: {exc}", pytrace=False)
    yield runner
    runner.close()
    strays = runner.unreported_strays()
    if strays:
        # `-k` may have left the run-wide check out; a stray must not pass unseen.
        pytest.fail(
            "P-1: a worker sent a message that answers no command it was sent (one terminal reply per "
            "(task_id, rank)):\n  " + "\n  ".join(strays),
            pytrace=False,
        )
