"""What `nano-v1 bench` runs: throughput, scheduler, serve, processes, spec, and the roofline they print against.

Mirrors vllm/benchmarks/__init__.py (chapter 00).

Why it exists: an installed nano_v1 measures itself against its peers, as vLLM's
`vllm bench` does, with nothing but the package. The kernel studies and the one-shot GPU
suite need the source checkout and live outside the package, in its top-level
`benchmarks/`.
"""
