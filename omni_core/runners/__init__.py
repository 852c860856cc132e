"""Where a model plugs into a worker: the runner interface and its registry (`base`), and
every runner: `synthetic` and its tensor-parallel form (tests, benchmarks), `transformers`
(causal LMs), `diffusers` (diffusion pipelines, step-wise) and `vllm`. The builtin names are
in `omni_core.runners.base.BUILTIN_RUNNERS`; transformers, diffusers and vllm are imported
only when one of their runners is loaded (`pip install omni-core[models]`)."""
