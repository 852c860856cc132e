"""Benchmarks: the memory path (sleep/wake GB/s per backend, on a GPU) and the control
plane (protocol round trips of a stage with N rank processes, on CPU)."""
