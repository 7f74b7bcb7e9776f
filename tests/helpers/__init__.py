"""What the tests share: fakes, builders and oracles, and the scripts the tests run as processes.

Test modules import from here (`from helpers.scheduler import FakeModelRunner`), never from
one another or from conftest.py, which keeps only fixtures and pytest hooks.

- assignment_mutants.py: the planted bugs, as exact snippets of the task regions, that the
  assignment integrity check (test_assignments.py) proves each task's tests catch.
- attention.py: ragged paged batches and the float64 attention oracle (chapters 06, 07, 12).
- chapters.py: reading paths as chapters and docstrings write them.
- checkpoints.py: tiny random Hugging Face checkpoints and a CPU engine's `VllmConfig`.
- compilation.py: CUDA graphs faked on the CPU, an engine that uses them (chapter 08).
- generation.py: greedy tokens from transformers (the parity oracle) and from nano_v1; prompts.
- kv_cache.py: KV cache configs, requests and hit oracles without a model (chapters 02, 03, 12).
- model.py: a model loaded as the engine loads it, run over a hand-made paged KV cache (chapter 01).
- sampling.py: `SamplingMetadata` as the persistent batch builds it.
- scheduler.py: a scheduler without a model, the fake model runner and random workloads (chapter 04).
- servers.py: the OpenAI-compatible server in a thread of the test process (chapter 09).
- tp_probes.py: functions the tensor-parallel tests run on every rank (chapter 13).
- trace_fields.py: the fields of a scheduler step, read alike from vLLM v0.11.0 and nano_v1.

Scripts, run in processes of their own:
- record_traces.py: records vLLM v0.11.0's scheduler as the traces in tests/vllm_v0_11_0/traces/
  (in vLLM's own virtual environment; see its docstring).
- torchrun_generate.py: one rank of a `torchrun` tensor-parallel engine (chapter 13).
- triton_aot.py: compiles every Triton kernel variant ahead of time for a GPU target.
- variant_runner.py: runs pytest on many variants of a student copy in forks of one interpreter.
"""
