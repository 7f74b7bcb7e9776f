"""KV connectors measured: bytes moved per token, loading against recomputing, a CPU tier's hits.

Mirrors what vLLM measures with its serving benchmark (vllm/benchmarks/serve.py) against
deployed prefill and decode servers (chapter 16), in one process on the demo model. Needs
a source checkout (`pip install .` installs only nano_v1): imported from its root.

Why it exists: chapter 16 predicts, from the KV cache's shape, how many bytes a prompt
token costs to move, and that loading them beats computing them again. This module
measures both on the demo model, through the real engines and connectors:
  - `measure_shared_storage`: bytes per token on disk against the prediction, and the
    decode side's time to first token with the prefill's KV stored against computing the
    prompt itself (`SharedStorageConnector`);
  - `offload_sweep`: prefix hits and recomputed prompt tokens against the CPU tier's size
    (`OffloadingConnector`).
The decode side's inter-token latency, one server against prefill and decode servers, is
benchmarks/disagg_itl.py (it starts servers).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.disagg_itl import shared_storage_config
from nano_v1 import LLM
from nano_v1.benchmarks.utils import spread
from nano_v1.config import VllmConfig
from nano_v1.demo_model import DEMO_MODEL_PATH
from nano_v1.engine.arg_utils import EngineArgs
from nano_v1.outputs import RequestOutput
from nano_v1.sampling_params import SamplingParams


# ---------------------------------------------------------------------------- disaggregated prefill through files
def kv_bytes_per_token(vllm_config: VllmConfig) -> int:
    """Predicted from the model's shape: keys and values, every layer, every KV head, in the cache's dtype."""
    model_config = vllm_config.model_config
    dtype_bytes = model_config.dtype.itemsize
    return 2 * model_config.get_num_layers() * model_config.get_num_kv_heads() * model_config.get_head_size() * dtype_bytes


def _storage_engine(kv_role: str | None, storage: str | None, max_model_len: int) -> LLM:
    """The demo model in float32 in this process; a SharedStorageConnector when `kv_role` is given."""
    kv_transfer_config = None if kv_role is None else shared_storage_config(kv_role, storage)
    args = EngineArgs(
        model=str(DEMO_MODEL_PATH), dtype="float32", seed=0, max_model_len=max_model_len,
        kv_transfer_config=kv_transfer_config,
    )  # fmt: skip
    return LLM.from_engine_args(args, enable_multiprocessing=False)


def _time_first_token(llm: LLM, prompt: list[int]) -> tuple[float, RequestOutput]:
    """Seconds for one request of `prompt` to return its first (greedy) token, and its output."""
    params = SamplingParams(temperature=0.0, max_tokens=1)
    start = time.perf_counter()
    (output,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return time.perf_counter() - start, output


def measure_shared_storage(prompt_lens: tuple[int, ...], repeats: int, storage: str) -> dict[str, Any]:
    """Bytes per token on disk against the prediction, and the decode side's time to first token
    with the prefill's KV stored against computing the prompt itself.

    Each (length, repeat) draws a fresh prompt, so that no engine finds it in its own prefix
    cache. A plain engine times each prompt (recompute); a prefill engine ("kv_producer")
    saves them all; a decode engine ("kv_consumer") is given each prompt plus the prefill's
    token, as the disaggregated-prefill example does, and loads the saved whole blocks. One
    engine with a connector lives at a time in a process, so they run one after the other.
    """
    max_model_len = max(prompt_lens) + 8
    rng = np.random.default_rng(0)
    prompts = {(n, r): rng.integers(1, 4096, size=n).tolist() for n in prompt_lens for r in range(repeats)}
    plain = _storage_engine(None, None, max_model_len)
    try:
        _time_first_token(plain, [1, 2, 3])  # warm up
        recompute = {key: _time_first_token(plain, p) for key, p in prompts.items()}
        predicted = kv_bytes_per_token(plain.llm_engine.vllm_config)
        block_size = plain.llm_engine.vllm_config.cache_config.block_size
    finally:
        plain.llm_engine.shutdown()
    prefill = _storage_engine("kv_producer", storage, max_model_len)
    try:
        save = {key: _time_first_token(prefill, p) for key, p in prompts.items()}
    finally:
        prefill.llm_engine.shutdown()
    decode = _storage_engine("kv_consumer", storage, max_model_len)
    try:
        _time_first_token(decode, [1, 2, 3])
        loaded = {key: _time_first_token(decode, p + list(save[key][1].outputs[0].token_ids)) for key, p in prompts.items()}
    finally:
        decode.llm_engine.shutdown()
    folders = [os.path.join(storage, name) for name in os.listdir(storage)]
    rows = []
    for n in prompt_lens:
        keys = [(n, r) for r in range(repeats)]
        num_saved = (n - 1) // block_size * block_size  # the whole blocks before the prompt's last token
        assert all(loaded[k][1].num_cached_tokens == num_saved for k in keys), "the decode engine did not load"
        # Decode must continue with the plain engine's first token: the prefill's.
        assert all(save[k][1].outputs[0].token_ids == recompute[k][1].outputs[0].token_ids for k in keys)
        rows.append({
            "prompt_len": n,
            "saved_tokens": num_saved,
            "recompute_ttft_ms": spread([1e3 * recompute[k][0] for k in keys]),
            "prefill_and_save_ms": spread([1e3 * save[k][0] for k in keys]),
            "loaded_ttft_ms": spread([1e3 * loaded[k][0] for k in keys]),
        })  # fmt: skip
    saved_bytes = sum(os.path.getsize(os.path.join(f, name)) for f in folders for name in os.listdir(f))
    saved_tokens = sum((n - 1) // block_size * block_size for n, _ in prompts)
    return {
        "model": "demo model (nano_v1/demo_model), float32",
        "block_size": block_size,
        "repeats": repeats,
        "predicted_bytes_per_token": predicted,
        "measured_bytes_per_token": saved_bytes / saved_tokens,
        "num_files": sum(len(os.listdir(f)) for f in folders),
        "rows": rows,
    }


# ---------------------------------------------------------------------------- offloading to a CPU tier

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
