"""Benchmarks for chapter 16: KV connectors."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from nano_v1.demo_model import DEMO_MODEL_PATH
from nano_v1.engine.arg_utils import EngineArgs
from nano_v1.entrypoints.llm import LLM
from nano_v1.sampling_params import SamplingParams


def offload_sweep(
    num_cpu_blocks_list: list[int], num_prompts: int = 4, shared_prefix_len: int = 32, unique_len: int = 40,
    num_rounds: int = 2, max_tokens: int = 8, block_size: int = 16, num_gpu_blocks: int = 9,
    model: str | Path = DEMO_MODEL_PATH,
) -> list[dict[str, Any]]:  # fmt: skip
    """Prefix hits and recomputed prompt tokens against the CPU tier's size (OffloadingConnector).

    The workload: `num_prompts` prompts, a `shared_prefix_len`-token prefix in common and
    `unique_len` tokens each, sent one request at a time (each its own `generate`, as turns
    of separate conversations would arrive), cycled `num_rounds` times, on a device cache of
    `num_gpu_blocks` blocks (block 0 is the null block), too small to keep them all. One
    engine per entry of `num_cpu_blocks_list`; 0 means no connector (a plain engine: the
    connector itself refuses an empty tier). Per entry: `prompt_tokens` (all requests),
    `computed_prompt_tokens` (run through the model), `loaded_tokens` (copied from the CPU
    tier), `device_hit_tokens` (the device prefix cache's), `prefix_hit_rate` ((device +
    loaded) / prompt tokens) and `wall_s` (the generate calls only, not the start-up). A
    prompt's last token is always computed, so the counts add up exactly whenever the
    prompt length is not a multiple of `block_size`.

    Prediction, per offloaded block of `block_size` tokens: the working set is
    ceil(shared / block_size) + num_prompts x (unique blocks) blocks; a tier that holds it
    loads every unique block after the first round, while LRU under this cyclic order with
    any smaller tier evicts each prompt just before it returns, and loads nothing.
    """
    vocab_size = 4000  # within the demo model's 4,096 tokens (and the test checkpoints')
    shared = [(5 * j + 3) % vocab_size + 1 for j in range(shared_prefix_len)]
    prompts = [shared + [(7 * i + 3 * j + 11) % vocab_size + 1 for j in range(unique_len)] for i in range(num_prompts)]
    requests = prompts * num_rounds
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rows = []
    for num_cpu_blocks in num_cpu_blocks_list:
        kv_transfer_config = None
        if num_cpu_blocks > 0:
            kv_transfer_config = {
                "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"num_cpu_blocks": num_cpu_blocks},
            }  # fmt: skip
        args = EngineArgs(
            model=str(model), dtype="float32", max_model_len=shared_prefix_len + unique_len + max_tokens,
            block_size=block_size, num_gpu_blocks_override=num_gpu_blocks, kv_transfer_config=kv_transfer_config,
        )  # fmt: skip
        llm = LLM.from_engine_args(args, enable_multiprocessing=False)
        try:
            start = time.perf_counter()
            outputs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in requests]
            wall_s = time.perf_counter() - start
            connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
            loaded_tokens = connector.connector_scheduler.num_loaded_tokens if connector is not None else 0
        finally:
            llm.llm_engine.shutdown()
        prompt_tokens = sum(len(p) for p in requests)
        cached_tokens = sum(o.num_cached_tokens for o in outputs)
        rows.append({
            "num_cpu_blocks": num_cpu_blocks,
            "prompt_tokens": prompt_tokens,
            "computed_prompt_tokens": prompt_tokens - cached_tokens,
            "loaded_tokens": loaded_tokens,
            "device_hit_tokens": cached_tokens - loaded_tokens,
            "prefix_hit_rate": cached_tokens / prompt_tokens,
            "wall_s": wall_s,
        })  # fmt: skip
    return rows
