"""Protocol conformance suite for workers: black-box checks of `specs/protocol.md` over a real
socket, for this project's worker and for third-party ones (any language).

    omni-core conformance --worker synthetic            # the reference worker
    omni-core conformance --worker 'cmd:./my-worker --connect {address} --rank {rank} --epoch {epoch}'

or, under pytest (the plugin is registered through the `pytest11` entry point):

    from omni_core.conformance import ConformanceSuite

    class TestMyWorker(ConformanceSuite):
        worker = "mypkg.conformance:start_worker"

See docs/conformance.md.
"""

from omni_core.conformance import cases_hello as _cases_hello  # noqa: F401 (registers the Hello's pool_bytes case)
from omni_core.conformance import cases_profile as _cases_profile  # noqa: F401 (registers the P-15 cases)
from omni_core.conformance import cases_swap as _cases_swap  # noqa: F401 (registers the P-16 cases)
from omni_core.conformance import cases_weights as _cases_weights  # noqa: F401 (registers the P-17 cases)
from omni_core.conformance.cases import CASES, Case
from omni_core.conformance.harness import CaseFailure, CaseSkip, SuiteOptions
from omni_core.conformance.requirements import REQUIREMENTS, Requirement
from omni_core.conformance.runner import CaseResult, SuiteReport, SuiteRunner, run_suite
from omni_core.conformance.targets import WorkerFactory, reference_worker, resolve_target

__all__ = [
    "CASES",
    "REQUIREMENTS",
    "Case",
    "CaseFailure",
    "CaseResult",
    "CaseSkip",
    "ConformanceSuite",
    "Requirement",
    "SuiteOptions",
    "SuiteReport",
    "SuiteRunner",
    "WorkerFactory",
    "reference_worker",
    "resolve_target",
    "run_suite",
]


def __getattr__(name: str):
    # The base class lives with the pytest plugin; import pytest only when it is asked for.
    if name == "ConformanceSuite":
        from omni_core.conformance.plugin import ConformanceSuite

        return ConformanceSuite
    raise AttributeError(name)
