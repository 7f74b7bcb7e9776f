"""A custom logits processor: requests that pass `extra_args={"target_token": t}` can only
ever sample token t; the other requests in the same batch are untouched.

Mirrors v0.11.0's examples/offline_inference/logits_processor/custom.py (chapter 01).

Run it from the repository root, as a module, so that the engine-core process (chapter 09)
can import the processor by the name given to the engine:

    python -m examples.offline_inference.logits_processor.custom

A processor is a class, instantiated once per worker with (vllm_config, device,
is_pin_memory). It keeps per-row state, updated from the persistent batch's `BatchUpdate`
(rows removed, added, moved: chapter 05), and edits the whole batch's logits in `apply`.
It forces a token, so it can change an argmax: `is_argmax_invariant()` is False, and the
sampler runs it on the raw logits, before greedy rows take their argmax.
"""

from __future__ import annotations

import torch

from nano_v1 import LLM, SamplingParams
from nano_v1.config import VllmConfig
from nano_v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from nano_v1.sample.logits_processor.builtin import process_dict_updates


# The name the engine imports the processor by, "module.path:ClassName" (v0.11.0's syntax).
FQCN = "examples.offline_inference.logits_processor.custom:DummyLogitsProcessor"


class DummyLogitsProcessor(LogitsProcessor):
    """Masks every token but `extra_args["target_token"]` in the rows of the requests that set it."""

    def __init__(self, vllm_config: VllmConfig | None, device: torch.device, is_pin_memory: bool) -> None:
        self.req_info: dict[int, int] = {}  # row -> its target token, for the rows that have one

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(
            self.req_info,
            batch_update,
            # A request's state from its params (prompt and output ids unused), None to skip it.
            lambda params, _, __: (params.extra_args or {}).get("target_token"),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.req_info:
            return logits
        rows = torch.tensor(list(self.req_info), dtype=torch.long, device=logits.device)
        cols = torch.tensor(list(self.req_info.values()), dtype=torch.long, device=logits.device)
        kept = logits[rows, cols]  # advanced indexing copies
        logits[rows] = float("-inf")
        logits[rows, cols] = kept
        return logits


def main() -> None:
    prompts = ["def fibonacci(n):", "import os\n", "class Stack:", "for i in range(10):"]
    # By name: run as a script, this module is `__main__`, which the engine-core process cannot import.
    llm = LLM(logits_processors=[FQCN])  # the demo model
    target = llm.get_tokenizer().encode(" x", add_special_tokens=False)[0]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, extra_args={"target_token": target}),
        SamplingParams(temperature=0.0, max_tokens=12),
        SamplingParams(temperature=0.0, max_tokens=12, extra_args={"target_token": target}),
        SamplingParams(temperature=0.0, max_tokens=12),
    ]
    print("Generated outputs:\n" + "-" * 60)
    for output in llm.generate(prompts, params):
        print(f"Prompt: {output.prompt!r}\nOutput: {output.outputs[0].text!r}\n" + "-" * 60)


if __name__ == "__main__":
    main()
