"""Kernel studies and the one-shot GPU suite: the measurements behind the chapters, outside the package.

Mirrors vLLM's top-level benchmarks/ (kernel benchmarks, kept out of the `vllm` package) (chapter 00).

Why it exists: `nano-v1 bench` (`nano_v1/benchmarks/`) is what an installed nano_v1 runs;
these are what the course measures on a borrowed GPU and the notebooks plot. They read the
shipped model shapes in `benchmarks/configs/` and are not installed by `pip install .`:
run them from the root of a source checkout, e.g. `python -m benchmarks.gpu_suite --smoke --out OUT`.
"""

# Every command-line entry point here and in tools/ ends its --help with this.
NEEDS_CHECKOUT = "Needs a source checkout: run from its root (pip install . installs only nano_v1)."
