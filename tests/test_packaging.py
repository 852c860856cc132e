"""pyproject.toml's ranges a user's environment can meet, the constraints CI pins inside them,
and the benchmarks' dependencies declared somewhere."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # the serve extra brings tomli on 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
CONSTRAINTS = ROOT / "scripts" / "constraints.txt"
SELF = "omni-core"
# Imported under another name than the distribution's.
DISTRIBUTION_OF = {
    "pynvml": "nvidia-ml-py",
    "prometheus_client": "prometheus-client",
    "zmq": "pyzmq",
    "torch_memory_saver": "torch-memory-saver",
    "yaml": "pyyaml",
    "PIL": "pillow",
}
# Brought by the device machine's bundle (scripts/device/bundle.sh), not by any extra a CPU
# checkout installs: the comparisons the GPU benchmarks draw.
DEVICE_ONLY = {"torch-memory-saver"}


def _requirements(extra: str | None = None) -> list[Requirement]:
    lines = PROJECT["dependencies"] if extra is None else PROJECT["optional-dependencies"][extra]
    return [Requirement(line) for line in lines]


def _closure(extra: str) -> list[Requirement]:
    """An extra's requirements, with the extras of omni-core it names followed."""
    found: list[Requirement] = []
    for req in _requirements(extra):
        if canonicalize_name(req.name) == SELF:
            for inner in sorted(req.extras):
                found += _closure(inner)
        else:
            found.append(req)
    return found


def _pins() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([0-9][0-9A-Za-z.+\-]*)", line)
        assert match, f"scripts/constraints.txt: {line!r} is not an exact pin NAME==VERSION"
        pins[canonicalize_name(match.group(1))] = Version(match.group(2))
    return pins


def _upper_bounded(req: Requirement) -> bool:
    return any(spec.operator in ("<", "<=", "==", "~=") for spec in req.specifier)


def test_torch_is_any_release_from_2_6() -> None:
    torch = next(r for r in _requirements() if r.name == "torch")
    assert str(torch.specifier) == ">=2.6"


def test_vllm_is_bounded_to_the_releases_the_currency_check_passed() -> None:
    """0.26.0 (GPU-tested) to 0.34 (every internal omni-core touches present:
    scripts/vllm_currency.sh); the next minor must pass it before the bound moves."""
    (vllm,) = _requirements("vllm")
    assert vllm.specifier.contains("0.26.0") and vllm.specifier.contains("0.34.0")
    assert not vllm.specifier.contains("0.35.0") and not vllm.specifier.contains("0.25.9")


def test_uvicorn_whose_internals_serve_subclasses_is_bounded_above() -> None:
    (uvicorn,) = [r for r in _requirements("serve") if r.name == "uvicorn"]
    assert _upper_bounded(uvicorn) and uvicorn.specifier.contains("0.54.0")


def test_the_models_and_ray_extras_are_ranges_not_pins() -> None:
    """A user's environment rarely has the exact version CI ran; a range it can meet, bounded
    above at the next release that may break the code (a major, or diffusers' minor)."""
    for extra in ("models", "ray"):
        for req in _requirements(extra):
            assert not any(spec.operator == "==" for spec in req.specifier), f"{extra}: {req} is a pin"
            assert _upper_bounded(req), f"{extra}: {req} has no upper bound"


def test_ci_pins_a_version_inside_every_range() -> None:
    pins = _pins()
    declared = _requirements() + [r for extra in ("models", "serve", "ray", "bench", "test") for r in _closure(extra)]
    for req in declared:
        if req.marker is not None and not req.marker.evaluate():
            continue
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is not pinned in scripts/constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), f"CI pins {name}=={pins[name]} outside {req}"


def test_the_setup_scripts_install_with_the_constraints() -> None:
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    test = (ROOT / "scripts" / "test.sh").read_text()
    # torch first and alone, by exact version: an unpinned torch pulls the CUDA build.
    assert "pip_install torch==2.13.0" in setup  # setup.sh's pip wrapper: progress lines, a log
    assert setup.index("torch==2.13.0") < setup.index('-e ".[')
    assert _pins()["torch"] == Version("2.13.0")
    installs = [line for script in (setup, test) for line in script.splitlines() if '-e "' in line]
    assert any("pip_install" in line for line in installs)
    for line in installs:
        if "pip install" in line or "pip_install" in line:
            assert "-c scripts/constraints.txt" in line, line


def test_every_import_of_the_benchmarks_is_declared() -> None:
    """The benchmarks are not installed; what they import comes from the `bench` extra (and
    the package's own dependencies), or is named as the device's."""
    declared = {canonicalize_name(r.name) for r in _requirements() + _closure("bench")}
    declared |= {canonicalize_name(r.name) for extra in ("vllm", "ray") for r in _requirements(extra)}
    missing = set()
    for path in (ROOT / "benchmarks").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in ("omni_core", "omni_testing", "benchmarks"):
                    continue
                dist = canonicalize_name(DISTRIBUTION_OF.get(top, top))
                if dist not in declared and dist not in DEVICE_ONLY:
                    missing.add(f"{dist} ({path.relative_to(ROOT)})")
    assert not missing, f"imported by the benchmarks but declared in no extra: {sorted(missing)}"
