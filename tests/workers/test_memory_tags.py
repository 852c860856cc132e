"""The `cuda_graph` and `comm` tags (issue 42 item 4): what a sleep does to them, the cumem
backend's adoption of vLLM's CUDA graph pool (allocator tag "cudagraph") over the stand-in
allocator of test_cumem_versions, and the vllm runner's engine arguments for them."""

from __future__ import annotations

import pytest
import torch

from omni_core.fsm.tags import COMM_TAG, CUDA_GRAPH_TAG, KV_CACHE_TAG, WEIGHTS_TAG, plan_sleep
from omni_core.runners.vllm_runner import TAG_ENGINE_ARGS, tag_engine_args
from omni_core.workers.backends import CumemBackend
from omni_core.workers.backends.base import BackendStateError
from omni_core.workers.backends.portable import PortableBackend

from .test_cumem_versions import GARBAGE, VARIANTS, FakeCumemModule

ALL = frozenset({WEIGHTS_TAG, KV_CACHE_TAG, CUDA_GRAPH_TAG, COMM_TAG})


def test_level_1_offloads_the_graph_pool_and_discards_the_communicators() -> None:
    plan = plan_sleep(1, ALL)
    assert plan.offload == {WEIGHTS_TAG, CUDA_GRAPH_TAG} and plan.discard == {KV_CACHE_TAG, COMM_TAG}
    assert plan_sleep(2, ALL).discard == ALL


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_cumem_backend_sleeps_and_wakes_vllms_graph_pool_as_cuda_graph(variant: str) -> None:
    module = FakeCumemModule(variant)
    backend = CumemBackend(torch.device("cpu"), module=module)
    with backend.pool(WEIGHTS_TAG):
        weights = backend.allocator.malloc(4096, 0x11)
    with backend.allocator.use_memory_pool(tag="cudagraph"):  # where vLLM captures its graphs
        graphs = backend.allocator.malloc(8192, 0x33)
    with pytest.raises(BackendStateError, match="unknown tag"):
        backend.sleep({CUDA_GRAPH_TAG}, set())
    backend.adopt(CUDA_GRAPH_TAG)
    backend.adopt(CUDA_GRAPH_TAG)  # once is enough
    assert backend.tags.count(CUDA_GRAPH_TAG) == 1
    assert backend.usage() == {WEIGHTS_TAG: 4096, CUDA_GRAPH_TAG: 8192}
    backend.sleep({WEIGHTS_TAG, CUDA_GRAPH_TAG}, set())
    assert module.memory == {} and backend.usage() == {WEIGHTS_TAG: 0, CUDA_GRAPH_TAG: 0}
    assert backend.host_bytes() == 4096 + 8192  # the graphs' bytes kept on the host
    backend.wake({CUDA_GRAPH_TAG})  # alone: the weights stay asleep
    assert set(module.memory) == {graphs} and set(module.memory[graphs]) == {0x33}
    backend.wake({WEIGHTS_TAG})
    assert set(module.memory[weights]) == {0x11} and GARBAGE not in module.memory[graphs]


def test_a_backend_without_a_framework_pool_refuses_to_adopt_naming_the_tag() -> None:
    with pytest.raises(BackendStateError, match=r"'cuda_graph'.*use the cumem backend"):
        PortableBackend(torch.device("cpu")).adopt(CUDA_GRAPH_TAG)
    backend = CumemBackend(torch.device("cpu"), module=FakeCumemModule("0.26"))
    with pytest.raises(BackendStateError, match="'kv_cache'"):
        backend.adopt(KV_CACHE_TAG)


def test_the_vllm_runner_asks_vllms_own_opt_ins_for_the_tags() -> None:
    names = frozenset({"enable_sleep_mode", "sleep_mode_offload_cudagraph", "enable_nccl_comm_suspend"})
    assert tag_engine_args(frozenset({WEIGHTS_TAG, KV_CACHE_TAG}), lambda: frozenset()) == {}
    graphs = tag_engine_args(frozenset({WEIGHTS_TAG, CUDA_GRAPH_TAG}), lambda: names)
    assert graphs == TAG_ENGINE_ARGS[CUDA_GRAPH_TAG] and graphs["sleep_mode_offload_cudagraph"] is True
    both = tag_engine_args(ALL, lambda: names)
    assert both["enable_nccl_comm_suspend"] is True and both["sleep_mode_offload_cudagraph"] is True
    old = frozenset({"enable_sleep_mode"})  # vLLM 0.26: neither opt-in
    with pytest.raises(ValueError, match=r"no engine args \['enable_nccl_comm_suspend'\].*drop those tags"):
        tag_engine_args(frozenset({COMM_TAG}), lambda: old)
