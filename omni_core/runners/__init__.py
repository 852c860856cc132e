"""Runners for real models: `transformers` (causal LMs) and `diffusers` (diffusion pipelines,
step-wise). Registered as builtin runner names in `omni_core.workers.runner.BUILTIN_RUNNERS`;
transformers and diffusers are imported only when one of them is loaded (`pip install
omni-core[models]`)."""
