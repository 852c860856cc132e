"""omni-core: checked sleep/wake lifecycles for GPU inference stages.

Layers, inside out: `protocol` (wire types, no IO) and `fsm` (lifecycles, no IO); then
`workers` (rank processes, memory backends), `transport` (sockets), `engine`
(orchestrator and Python API), `conformance` and `formal` (checking).
"""

__version__ = "0.1.0"
