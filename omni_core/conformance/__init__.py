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

# Each cases_* module registers its cases when imported, and the shared worker meets them in
# this order (a run stops at its first failure), so the import sorter must not reorder them.
# isort: off
from omni_core.conformance import cases_envelope  # noqa: F401 (P-3, P-2, P-4, P-6)
from omni_core.conformance import cases_states  # noqa: F401 (P-7, P-8)
from omni_core.conformance import cases_input  # noqa: F401 (P-10, P-13, P-14)
from omni_core.conformance import cases_effects  # noqa: F401 (P-11, P-12, P-1)
from omni_core.conformance import cases_escapes  # noqa: F401 (bugs the cases above let through)
from omni_core.conformance import cases_profile  # noqa: F401 (P-15)
from omni_core.conformance import cases_swap  # noqa: F401 (P-16)
from omni_core.conformance import cases_weights  # noqa: F401 (P-17)
from omni_core.conformance import cases_versions  # noqa: F401 (P-17: where an update is legal, versions)
from omni_core.conformance import cases_links  # noqa: F401 (P-18)
from omni_core.conformance import cases_adapters  # noqa: F401 (P-20)
from omni_core.conformance import cases_save  # noqa: F401 (P-21)
from omni_core.conformance import cases_transfers  # noqa: F401 (P-22)
from omni_core.conformance import cases_hold  # noqa: F401 (P-23)
from omni_core.conformance import cases_hello  # noqa: F401 (P-12: the Hello's pool_bytes)
from omni_core.conformance import cases_model  # noqa: F401 (P-11: generated sequences against the tables)

# isort: on
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
