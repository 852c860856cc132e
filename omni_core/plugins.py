"""Where runner and memory-backend names resolve: one registry for both kinds.

A name is one of omni-core's own (`BUILTIN`), a name another installed package registers
under the entry-point group of its kind, or an import path 'package.module:Name':

    # the other package's pyproject.toml
    [project.entry-points."omni_core.backends"]
    mybackend = "my_pkg.backend:MyBackend"

`StageSpec` checks a name against this registry when it is built; the rank process
resolves it here when it starts. Both therefore accept and refuse the same names.
Nothing here imports torch: the names are strings until `resolve` imports one.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any

RUNNERS = "omni_core.runners"
BACKENDS = "omni_core.backends"
KINDS = {RUNNERS: "runner", BACKENDS: "backend"}

# omni-core's own names, in the form an entry point gives them. A registered name may not
# shadow one of these.
BUILTIN: dict[str, dict[str, str]] = {
    RUNNERS: {
        "synthetic": "omni_core.runners.synthetic:SyntheticRunner",
        "transformers": "omni_core.runners.transformers_runner:TransformersRunner",
        "diffusers": "omni_core.runners.diffusers_runner:DiffusersRunner",
        "vllm": "omni_core.runners.vllm_runner:VllmRunner",
    },
    BACKENDS: {
        # auto and fast choose or degrade at start-up; both are factories taking the device.
        "auto": "omni_core.workers.backends.select:auto_backend",
        "portable": "omni_core.workers.backends.portable:PortableBackend",
        "cumem": "omni_core.workers.backends.cumem:CumemBackend",
        "fast": "omni_core.workers.backends.select:fast_backend",
    },
}


def registered(group: str) -> dict[str, str]:
    """Every name of `group` and the import path it stands for: the builtins, then what
    installed packages register under the entry-point group."""
    names = dict(BUILTIN[group])
    for point in entry_points(group=group):
        names.setdefault(point.name, point.value)
    return names


def name_problem(group: str, name: object) -> str | None:
    """What is wrong with a runner or backend name, or None: registered, or an import path."""
    kind = KINDS[group]
    if not isinstance(name, str):
        return f"{kind} must be a string, got {name!r}"
    module, sep, attr = name.partition(":")
    if (sep and module and attr) or name in BUILTIN[group]:
        return None
    names = registered(group)
    if name in names:
        return None
    return (
        f"{kind} {name!r} is not one of {list(names)} (omni-core's, and those registered under the "
        f"entry-point group {group!r}) nor an import path: an import path must look like "
        f"'package.module:ClassName'"
    )


def resolve(group: str, name: str) -> Any:
    """The object a runner or backend name stands for, imported now."""
    problem = name_problem(group, name)
    if problem:
        raise ValueError(problem)
    if ":" in name:
        return import_object(name)
    return import_object(BUILTIN[group].get(name) or registered(group)[name])


def import_object(path: str) -> Any:
    """Resolve `package.module:Name`, with an error that says what to fix."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"import path {path!r} must look like 'package.module:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(
            f"cannot import module {module_name!r} named by {path!r}: {exc}; "
            "is the package installed in the worker's environment?"
        ) from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ImportError(f"module {module_name!r} has no attribute {attr!r} (from {path!r})") from None
