"""scripts/vllm_surface.py, the vLLM currency check, on stand-in source trees: a tree with
every internal omni-core touches passes, and each kind of move (a module gone, a method
renamed, a parameter dropped, a name re-exported from elsewhere, an attribute set in
__init__) is found or followed as it should be. The real releases were checked with
`bash scripts/vllm_currency.sh` (README, "vLLM versions")."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "vllm_surface.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vllm_surface", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["vllm_surface"] = module
    spec.loader.exec_module(module)
    return module


surface = _load()

FILES = {
    "vllm/__init__.py": """
        MODULE_ATTRS = {"LLM": ".entrypoints.llm:LLM", "SamplingParams": ".sampling_params:SamplingParams"}
    """,
    "vllm/plugins/__init__.py": 'DEFAULT_PLUGINS_GROUP = "vllm.general_plugins"\n',
    "vllm/device_allocator/__init__.py": """
        from dataclasses import dataclass

        @dataclass
        class AllocationData:
            handle: tuple
            tag: str
            cpu_backup_tensor: object = None
    """,
    "vllm/device_allocator/cumem.py": """
        from vllm.device_allocator import AllocationData
        try:
            from vllm.cumem_allocator import init_module, python_create_and_map
            cumem_available = True
        except ModuleNotFoundError:
            cumem_available = False
        libcudart = None

        def create_and_map(handle): ...
        def unmap_and_release(handle): ...

        class CuMemAllocator:
            def __init__(self):
                self.pointer_to_data: dict = {}
            @staticmethod
            def get_instance(): ...
            def use_memory_pool(self, tag=None): ...
            def sleep(self, offload_tags=None): ...
            def wake_up(self, tags=None): ...
    """,
    "vllm/device_allocator/sleep_mode_backend.py": """
        class SleepModeBackend: ...
        class SleepModeBackendFactory:
            @classmethod
            def register_backend(cls, name, module, class_name): ...
            @staticmethod
            def create_backend(model_config): ...
    """,
    "vllm/config/__init__.py": "from vllm.config.vllm import get_current_vllm_config_or_none\n",
    "vllm/config/vllm.py": "def get_current_vllm_config_or_none(): ...\n",
    "vllm/config/model.py": "class ModelConfig:\n    sleep_mode_backend: str = 'cumem'\n",
    "vllm/v1/worker/gpu_worker.py": """
        class Worker:
            def _maybe_get_memory_pool_context(self, tag): ...
            def determine_available_memory(self): ...
    """,
    "vllm/entrypoints/llm.py": """
        class LLM:
            def generate(self, prompts, sampling_params=None): ...
            def get_tokenizer(self): ...
            def reset_prefix_cache(self, reset_running_requests=False): ...
    """,
    "vllm/sampling_params.py": "class SamplingParams: ...\n",
}


def _tree(root: Path, **changes: str | None) -> Path:
    for name, text in {**FILES, **changes}.items():
        if text is None:
            continue
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")
    return root


def _problems(root: Path) -> dict[str, str]:
    rows = surface.report(root)["rows"]
    return {f"{r['module']}:{r['name']}": r["problem"] for r in rows if r["problem"] is not None}


def test_a_tree_with_every_internal_passes_following_reexports_and_init_attributes(tmp_path: Path) -> None:
    # get_current_vllm_config_or_none and AllocationData are re-exported; pointer_to_data is set in __init__.
    assert _problems(_tree(tmp_path)) == {}
    assert surface.main([str(tmp_path)]) == 0


@pytest.mark.parametrize(
    ("file", "text", "key", "needle"),
    [
        (
            "vllm/device_allocator/sleep_mode_backend.py",
            "class SleepModeBackend: ...\n",
            "SleepModeBackendFactory",
            "has no",
        ),
        (
            "vllm/v1/worker/gpu_worker.py",
            "class Worker:\n    def determine_available_memory(self): ...\n",
            "_maybe_get_memory_pool_context",
            "is gone",
        ),
        (
            "vllm/device_allocator/cumem.py",
            FILES["vllm/device_allocator/cumem.py"].replace(
                "use_memory_pool(self, tag=None)", "use_memory_pool(self, pool=None)"
            ),
            "use_memory_pool",
            "no longer takes ['tag']",
        ),
        ("vllm/config/model.py", "class ModelConfig:\n    backend: str = 'cumem'\n", "sleep_mode_backend", "is gone"),
        ("vllm/plugins/__init__.py", "GROUP = 'vllm.plugins'\n", "vllm.general_plugins", "absent"),
    ],
)
def test_each_kind_of_move_is_named(tmp_path: Path, file: str, text: str, key: str, needle: str) -> None:
    problems = _problems(_tree(tmp_path, **{file: text}))
    hits = {k: v for k, v in problems.items() if key in k}
    assert hits and all(needle in v for v in hits.values()), problems
    assert surface.main([str(tmp_path)]) == 1


def test_a_module_gone_is_named_and_a_tree_without_vllm_is_refused(tmp_path: Path) -> None:
    root = _tree(tmp_path / "t")
    (root / "vllm/entrypoints/llm.py").unlink()
    assert _problems(root)["vllm.entrypoints.llm:LLM"] == "module vllm.entrypoints.llm is gone"
    assert surface.main([str(tmp_path / "empty")]) == 2
