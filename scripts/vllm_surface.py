"""Every vLLM internal omni-core touches, checked against a vLLM source tree without importing
it (no CUDA, no matching torch needed): module paths, the classes, functions and fields
omni-core reads, the parameters it passes, the sleep-backend registry and the plugin entry
point. Run on the pinned release and on the newest one, the two reports' difference is what
a move of the `vllm` range must deal with (`scripts/vllm_currency.sh` does both).

    python scripts/vllm_surface.py SITE_OR_WHEEL_DIR [--json REPORT.json]

Exit 0 when everything omni-core needs is there, 1 otherwise (each missing piece named).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omni_core.vllm_plugin import CUMEM_MODULE, ENTRY_POINT_GROUP, SLEEP_MODULE
from omni_core.workers.backends.cumem import _REQUIRED as CUMEM_METHODS


@dataclass(frozen=True)
class Needed:
    """One thing omni-core reads of vLLM: `module`'s `name` (a top-level name, `Class.member`
    for a method or field, or "" for the module itself), taking at least `params`."""

    module: str
    name: str
    why: str
    params: tuple[str, ...] = ()


SURFACE: tuple[Needed, ...] = (
    Needed(CUMEM_MODULE, "CuMemAllocator", "the cumem and fast backends"),
    *(Needed(CUMEM_MODULE, f"CuMemAllocator.{m}", "cumem backend (_REQUIRED)") for m in CUMEM_METHODS),
    Needed(CUMEM_MODULE, "CuMemAllocator.use_memory_pool", "the plugin's prepare hook", ("tag",)),
    Needed(CUMEM_MODULE, "CuMemAllocator.pointer_to_data", "the fast path reads the allocations"),
    *(
        Needed(CUMEM_MODULE, f"AllocationData.{f}", "pointer_to_data's values")
        for f in ("handle", "tag", "cpu_backup_tensor")
    ),
    Needed(CUMEM_MODULE, "create_and_map", "cumem wake, through the memory gate"),
    Needed(CUMEM_MODULE, "unmap_and_release", "cumem sleep"),
    Needed(CUMEM_MODULE, "cumem_available", "cumem_unavailable_reason"),
    Needed(CUMEM_MODULE, "libcudart", "cumem's host copies"),
    Needed(SLEEP_MODULE, "SleepModeBackendFactory", "the omni_fast plugin registers here"),
    Needed(SLEEP_MODULE, "SleepModeBackendFactory.register_backend", "vllm_plugin.register"),
    Needed(SLEEP_MODULE, "SleepModeBackendFactory.create_backend", "the env selection wrapper", ("model_config",)),
    Needed(SLEEP_MODULE, "SleepModeBackend", "OmniFastSleepBackend's base"),
    Needed("vllm.config", "get_current_vllm_config_or_none", "vllm_plugin._selected"),
    Needed("vllm.config.model", "ModelConfig.sleep_mode_backend", "the backend a model config selects"),
    Needed("vllm.v1.worker.gpu_worker", "Worker", "runners/vllm_worker.py subclasses it"),
    Needed("vllm.v1.worker.gpu_worker", "Worker._maybe_get_memory_pool_context", "OmniVllmWorker", ("tag",)),
    Needed("vllm.v1.worker.gpu_worker", "Worker.determine_available_memory", "OmniVllmWorker"),
    Needed("vllm.entrypoints.llm", "LLM", "the vllm runner"),
    Needed("vllm.entrypoints.llm", "LLM.generate", "the vllm runner"),
    Needed("vllm.entrypoints.llm", "LLM.get_tokenizer", "the vllm runner"),
    Needed("vllm.entrypoints.llm", "LLM.reset_prefix_cache", "the vllm runner's ResetPrefixCache"),
    Needed("vllm.sampling_params", "SamplingParams", "the vllm runner"),
)
TEXT: tuple[tuple[str, str, str], ...] = (
    ("vllm.plugins", ENTRY_POINT_GROUP, "the entry-point group omni-core's plugin is registered under"),
    ("vllm", "LLM", "`from vllm import LLM`"),
    ("vllm", "SamplingParams", "`from vllm import SamplingParams`"),
)


def module_file(root: Path, module: str) -> Path | None:
    base = root.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _names(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """The names a module or class body binds, looking into its if/try blocks."""
    found: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.setdefault(node.name, node)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        found.setdefault(name.id, node)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found.setdefault(node.target.id, node)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                found.setdefault((alias.asname or alias.name).split(".")[0], node)
        elif isinstance(node, ast.If | ast.Try):
            blocks = [node.body, node.orelse, getattr(node, "finalbody", [])]
            blocks += [handler.body for handler in getattr(node, "handlers", [])]
            for block in blocks:
                for name, found_node in _names(block).items():
                    found.setdefault(name, found_node)
    return found


def _class_names(node: ast.ClassDef) -> dict[str, ast.AST]:
    """A class's names: its body's, and the attributes its __init__ sets on self."""
    found = _names(node.body)
    init = found.get("__init__")
    if isinstance(init, ast.FunctionDef):
        for stmt in ast.walk(init):
            targets = (
                stmt.targets
                if isinstance(stmt, ast.Assign)
                else [stmt.target]
                if isinstance(stmt, ast.AnnAssign)
                else []
            )
            for target in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                ):
                    found.setdefault(target.attr, stmt)
    return found


def _missing_params(node: ast.AST, params: tuple[str, ...]) -> list[str]:
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or not params:
        return []
    args = node.args
    if args.kwarg is not None:
        return []
    taken = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}
    return [p for p in params if p not in taken]


def _imported_from(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module an `import from` names, resolved against `module` where it is relative."""
    if not node.level:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    base = parts[: len(parts) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _top(root: Path, module: str, name: str, hops: int = 4) -> tuple[ast.AST | None, str]:
    """`module`'s top-level `name`, followed through `from X import name` to where it is defined."""
    path = module_file(root, module)
    if path is None:
        return None, f"module {module} is gone"
    node = _names(ast.parse(path.read_text(encoding="utf-8")).body).get(name)
    if isinstance(node, ast.ImportFrom) and hops:
        return _top(root, _imported_from(node, module, path.name == "__init__.py"), name, hops - 1)
    return node, "" if node is not None else f"{module} has no {name!r}"


def check(root: Path, need: Needed) -> str | None:
    """None when `need` is there; else what is missing, in words."""
    first, *members = need.name.split(".") if need.name else [""]
    if not first:
        return None if module_file(root, need.module) else f"module {need.module} is gone"
    node, problem = _top(root, need.module, first)
    for part in members:
        if node is None:
            break
        node = _class_names(node).get(part) if isinstance(node, ast.ClassDef) else None
        problem = f"{need.module}.{need.name} is gone (no {part!r})" if node is None else ""
    if node is None:
        return problem
    missing = _missing_params(node, need.params)
    return f"{need.module}.{need.name} no longer takes {missing}" if missing else None


def report(root: Path) -> dict[str, Any]:
    rows = [{"module": n.module, "name": n.name, "why": n.why, "problem": check(root, n)} for n in SURFACE]
    for module, text, why in TEXT:
        path = module_file(root, module)
        found = path is not None and text in path.read_text(encoding="utf-8")
        rows.append({"module": module, "name": f"text {text!r}", "why": why, "problem": None if found else "absent"})
    return {"root": str(root), "rows": rows, "problems": sum(r["problem"] is not None for r in rows)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "root", type=Path, help="the directory holding the vllm package (site-packages or an unpacked wheel)"
    )
    parser.add_argument("--json", type=Path, help="write the report here too")
    args = parser.parse_args(argv)
    if module_file(args.root, "vllm") is None:
        print(f"{args.root} holds no vllm package (no vllm/__init__.py)", file=sys.stderr)
        return 2
    result = report(args.root)
    for row in result["rows"]:
        mark, problem = ("ok     ", "") if row["problem"] is None else ("MISSING", f": {row['problem']}")
        print(f"{mark} {row['module']}:{row['name']}  ({row['why']}){problem}")
    print(f"{len(result['rows']) - result['problems']} of {len(result['rows'])} present")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0 if result["problems"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
