"""Adapters for the RL frameworks that drive their inference engine in-process (each optional;
none imports its framework): `StageExtension`, the named allowlist of extension methods that
`collective_rpc` may call, mapped onto omni-core's typed commands; `OpenRLHFActor`, the calls
OpenRLHF's vLLM actor makes; `OmniRollout`, verl's `BaseRollout` over a stage."""

from omni_core.integrations.extension import EXTENSION_METHODS, ExtensionRefusedError, StageExtension
from omni_core.integrations.openrlhf import OpenRLHFActor
from omni_core.integrations.verl import OmniRollout

__all__ = ["EXTENSION_METHODS", "ExtensionRefusedError", "OmniRollout", "OpenRLHFActor", "StageExtension"]
