"""Where a model plugs into a worker: the runner interface (`base`), and every runner:
`synthetic` and its tensor-parallel form (tests, benchmarks), `transformers` (causal LMs),
`diffusers` (diffusion pipelines, step-wise) and `vllm`. Their names are registered in
`omni_core.plugins`, beside the memory backends'; transformers, diffusers and vllm are imported
only when one of their runners is loaded (`pip install omni-core[models]`)."""
