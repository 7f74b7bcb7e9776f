"""Run by `torchrun --standalone --nproc-per-node 2` in tests/test_tensor_parallel.py: every rank an engine.

    torchrun --standalone --nproc-per-node 2 tests/helpers/torchrun_generate.py MODEL_DIR PROMPTS_JSON MAX_TOKENS OUT_JSON

Each rank builds `LLM(..., tensor_parallel_size=2, distributed_executor_backend="external_launcher")`
(vLLM's way to run tensor parallelism under torchrun, and across machines) and generates greedily
from the same prompts; rank 0 writes the tokens, whether rank 1 generated the same, and each rank's
KV cache size to OUT_JSON. Rank 1 offers its cache twice the memory of rank 0's: the ranks must
still agree on one size.
"""

from __future__ import annotations

import json
import os
import sys

import torch.distributed

from nano_v1 import LLM, SamplingParams
from nano_v1.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size


def main() -> None:
    model, prompts_json, max_tokens, out = sys.argv[1:5]
    rank = int(os.environ["RANK"])
    llm = LLM(
        model=model, dtype="float32", tensor_parallel_size=2, distributed_executor_backend="external_launcher",
        kv_cache_memory_bytes=(1 + rank) * 2**20, max_model_len=256,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=int(max_tokens))
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in json.loads(prompts_json)], params, use_tqdm=False
    )
    tokens = [o.outputs[0].token_ids for o in outputs]
    gathered: list = [None, None]
    torch.distributed.all_gather_object(
        gathered, (tokens, llm.llm_engine.vllm_config.cache_config.num_gpu_blocks)
    )
    if get_tensor_model_parallel_rank() == 0:
        with open(out, "w") as f:
            json.dump(
                {"tp_size": get_tensor_model_parallel_world_size(), "rank_0_and_1_agree": gathered[0][0] == gathered[1][0],
                 "num_gpu_blocks": [blocks for _, blocks in gathered], "tokens": tokens}, f,
            )  # fmt: skip
    llm.llm_engine.shutdown()


if __name__ == "__main__":
    main()
