"""CUDA graphs faked on the CPU (chapter 08): a graph wrapper that records what it captures and replays.

`FakeCUDAGraphWrapper` replays by rerunning the callable on the captured inputs and writing
into the captured outputs, which is what a real graph does to memory, so a replay whose
inputs moved is caught. `engine_with_fake_graphs` builds a CPU engine that runs the
runner's padding, capture and dispatch with it; `run_greedy` drives an engine step by step.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from helpers.checkpoints import make_vllm_config
from nano_v1 import SamplingParams
from nano_v1.compilation.counter import compilation_counter
from nano_v1.compilation.cuda_graph import CUDAGraphEntry, CUDAGraphWrapper, GraphPool
from nano_v1.config import CUDAGraphMode
from nano_v1.engine.llm_engine import LLMEngine
from nano_v1.worker.gpu_model_runner import GPUModelRunner


class FakeCUDAGraphWrapper(CUDAGraphWrapper):
    """Records captures and replays; a replay reruns the callable on the captured inputs and
    writes into the captured outputs, which is what a real graph does to memory."""

    events: ClassVar[list[tuple[str, str, int]]] = []

    def capture(self, entry: CUDAGraphEntry, args: tuple):
        self.events.append(("capture", self.runtime_mode.name, entry.batch_descriptor.num_tokens))
        output = self.runnable(*args)
        entry.graph = (args, output)  # keep the capture's tensors alive: a CPU has no graph pool
        return output

    def replay(self, entry: CUDAGraphEntry) -> None:
        self.events.append(("replay", self.runtime_mode.name, entry.batch_descriptor.num_tokens))
        args, captured = entry.graph
        new = self.runnable(*args)
        for old, fresh in zip(*(o if isinstance(o, tuple) else (o,) for o in (captured, new))):
            old.copy_(fresh)


def engine_with_fake_graphs(
    path: str, mode: CUDAGraphMode, sizes: list[int], monkeypatch, attention_backend: str = "TORCH_REFERENCE"
) -> LLMEngine:
    """A CPU engine that runs the runner's padding, capture and dispatch with fake graphs."""
    vllm_config = make_vllm_config(
        path, dtype="float32", max_num_seqs=8, compilation_config={"level": 3},
        attention_backend=attention_backend,
    )  # fmt: skip
    vllm_config.compilation_config = dataclasses.replace(
        vllm_config.compilation_config, cudagraph_mode=mode, cudagraph_capture_sizes=sizes
    )
    vllm_config.compilation_config.max_capture_size = max(sizes)
    monkeypatch.setattr(GPUModelRunner, "cudagraph_wrapper_cls", FakeCUDAGraphWrapper)
    monkeypatch.setattr(GraphPool, "create", classmethod(lambda cls, device: None))
    monkeypatch.setattr(FakeCUDAGraphWrapper, "events", [])
    seen = compilation_counter.num_graphs_seen
    engine = LLMEngine(vllm_config)
    # Its own trace and backend: nothing reused from another engine's compiled model.
    assert compilation_counter.num_graphs_seen == seen + 1
    return engine


def run_greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: list[int]) -> dict[str, list[int]]:
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(
            f"r{i}", {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=n)
        )
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = output.outputs[0].token_ids
    return tokens

