"""What the project needs beside the engine: the GPU session's device script, the results ledger, the demo model's trainer.

Mirrors no vLLM package: vLLM keeps its CI and release tooling outside `vllm/` too (chapter 00).

Why it exists: none of this is the engine, and all of it reads or writes the source
checkout (notebooks/, figures/data/, the demo model's checkpoint), so it is not installed
by `pip install .`: run it from the checkout's root, e.g. `python -m tools.device_run --out $OUT`.
"""
