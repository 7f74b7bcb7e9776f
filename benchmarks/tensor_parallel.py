"""Tensor parallelism: what the ranks must say to each other per step, what that costs, and what it buys.

Mirrors no single vLLM file: it is the arithmetic behind vLLM's tensor parallelism, and
the measurements of notebook 13 (chapter 13).
Needs a source checkout (`pip install .` installs only nano_v1): imported from its root.

Why it exists: a sharded decoder layer costs two all-reduces of the hidden states (after
`o_proj` and after `down_proj`), so a decode step of batch B on p ranks sends
`(2 x layers + 1) x B x hidden x bytes` through all-reduces (the +1 is the embedding)
and all-gathers the logits once. Whether TP pays is whether the time saved by giving each
rank 1/p of the weights and KV cache to read is more than the time those collectives
take. `predict_decode_step` answers that for H200s from datasheet numbers;
`measure_all_reduce` and `measure_step_times` measure the same things on this machine.
"""

from __future__ import annotations

import dataclasses
import multiprocessing.connection
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nano_v1.benchmarks.roofline import H200_DATASHEET, DeviceCeilings, ModelShape, decode_step_cost
from nano_v1.engine.arg_utils import EngineArgs


@dataclass(frozen=True, slots=True)
class Interconnect:
    """One GPU's link to its peers: bytes/s it can send (and, at the same time, receive), and the
    fixed cost of one collective, whatever its size."""

    name: str
    bandwidth_per_direction: float
    latency_s: float


# The H200's datasheet gives "NVLink: 900 GB/s" per GPU: 18 NVLink-4 links, both directions
# summed. A ring collective sends and receives at once, so what bounds it is one direction,
# 450 GB/s. The latency is not on the datasheet: 10 us per collective is our assumption
# (notebook 13 shows how the answer moves with it).
H200_NVLINK = Interconnect("NVLink 4 (H200 datasheet: 900 GB/s bidirectional)", 450e9, 10e-6)
# GPU memory on one H200 (the datasheet's 141 GB), and the share vLLM gives the engine by default.
H200_MEMORY_BYTES = 141e9
GPU_MEMORY_UTILIZATION = 0.9

# Public config.json values of models too large for one CPU, for the predictions only.
PREDICTION_SHAPES = {
    "Qwen3-4B": ModelShape(36, 2560, 32, 8, 128, 9728, 151936, tie_word_embeddings=True, qk_norm=True, qkv_bias=False),
    "Llama-3.1-8B": ModelShape(32, 4096, 32, 8, 128, 14336, 128256, tie_word_embeddings=False, qk_norm=False,
                               qkv_bias=False),
    "Llama-3.1-70B": ModelShape(80, 8192, 64, 8, 128, 28672, 128256, tie_word_embeddings=False, qk_norm=False,
                                qkv_bias=False),
}  # fmt: skip


def rank_shape(shape: ModelShape, tp_size: int) -> ModelShape:
    """What one of `tp_size` ranks holds, as a model of its own: a tp-th of the heads, of the MLP and
    of the vocabulary; one KV head each when there are fewer KV heads than ranks (replicated)."""
    return dataclasses.replace(
        shape,
        num_heads=shape.num_heads // tp_size,
        num_kv_heads=max(1, shape.num_kv_heads // tp_size),
        intermediate_size=shape.intermediate_size // tp_size,
        vocab_size=shape.vocab_size // tp_size,
    )


def all_reduce_bytes_per_token_per_layer(shape: ModelShape, dtype_bytes: int = 2) -> int:
    """Two all-reduces of one token's hidden state per layer: after o_proj and after down_proj."""
    return 2 * shape.hidden_size * dtype_bytes


def ring_time(num_bytes: float, tp_size: int, link: Interconnect, reduce: bool) -> float:
    """One ring collective over `tp_size` ranks: each rank sends (p - 1)/p of the data once for an
    all-gather, twice for an all-reduce (reduce-scatter, then all-gather), plus the fixed cost."""
    if tp_size == 1:
        return 0.0
    passes = 2 if reduce else 1
    return link.latency_s + passes * (tp_size - 1) / tp_size * num_bytes / link.bandwidth_per_direction


def predict_decode_step(
    shape: ModelShape,
    tp_size: int,
    batch_size: int,
    context_len: int,
    dtype_bytes: int = 2,
    ceilings: DeviceCeilings = H200_DATASHEET,
    link: Interconnect = H200_NVLINK,
) -> dict[str, Any]:
    """One decode step on `tp_size` GPUs: each rank's roofline floor plus the collectives, not overlapped.

    The floor is the larger of the rank's bytes / bandwidth and FLOPs / rate
    (`nano_v1/benchmarks/roofline.py`); the communication is `2 x layers + 1` all-reduces of
    `batch x hidden` and one all-gather of `batch x vocab` logits. `fits`: the rank's weights
    and the batch's KV cache fit in 90% of its memory.
    """
    per_rank = rank_shape(shape, tp_size)
    cost = decode_step_cost(per_rank, batch_size, context_len, dtype_bytes)
    hidden_bytes = batch_size * shape.hidden_size * dtype_bytes
    num_all_reduces = 2 * shape.num_layers + 1
    all_reduce_s = num_all_reduces * ring_time(hidden_bytes, tp_size, link, reduce=True)
    all_gather_s = ring_time(batch_size * shape.vocab_size * dtype_bytes, tp_size, link, reduce=False)
    num_collectives = (num_all_reduces + 1) if tp_size > 1 else 0
    latency_s = num_collectives * link.latency_s
    compute_s, memory_s = cost.compute_time(ceilings), cost.memory_time(ceilings)
    weight_bytes = per_rank.num_params * dtype_bytes
    kv_bytes = batch_size * context_len * per_rank.kv_bytes_per_token(dtype_bytes)
    return {
        "tp_size": tp_size,
        "batch_size": batch_size,
        "context_len": context_len,
        "compute_s": compute_s,
        "memory_s": memory_s,
        "floor_s": max(compute_s, memory_s),
        "comm_bandwidth_s": all_reduce_s + all_gather_s - latency_s,
        "comm_latency_s": latency_s,
        "step_s": max(compute_s, memory_s) + all_reduce_s + all_gather_s,
        "all_reduce_bytes_per_step": num_all_reduces * hidden_bytes,
        "weight_bytes_per_rank": weight_bytes,
        "kv_bytes_per_rank": kv_bytes,
        "fits": weight_bytes + kv_bytes <= GPU_MEMORY_UTILIZATION * H200_MEMORY_BYTES,
    }


# ----------------------------------------------------------------------------- measured on this machine
def _all_reduce_rank(
    rank: int, world_size: int, init_method: str, sizes: list[int], repeats: int, conn: Any
) -> None:
    """One rank of `measure_all_reduce`: join the group, then time each size `repeats` times."""
    from nano_v1.distributed import tensor_model_parallel_all_reduce
    from nano_v1.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    torch.set_num_threads(1)
    init_distributed_environment(world_size, rank, init_method, rank, "gloo")
    initialize_model_parallel(world_size, "gloo")
    results = []
    for num_bytes in sizes:
        x = torch.ones(max(1, num_bytes // 4), dtype=torch.float32)
        for _ in range(3):  # warm up: connections, buffers
            tensor_model_parallel_all_reduce(x)
        times = []
        for _ in range(repeats):
            torch.distributed.barrier()  # start together, so one rank's wait is not counted as the other's time
            start = time.perf_counter()
            tensor_model_parallel_all_reduce(x)
            times.append(time.perf_counter() - start)
        results.append({"bytes": x.numel() * 4, "median_s": statistics.median(times), "min_s": min(times)})
    if rank == 0:
        conn.send(results)
    destroy_model_parallel()
    destroy_distributed_environment()


def measure_all_reduce(sizes: list[int], world_size: int = 2, repeats: int = 30) -> list[dict[str, Any]]:
    """Median and fastest latency of `tensor_model_parallel_all_reduce` (gloo, float32) for each size
    in bytes, in `world_size` processes of one thread each; also the bus bandwidth of the fastest,
    2(p-1)/p x bytes / time."""
    from nano_v1.utils import (
        get_distributed_init_method,
        get_loopback_ip,
        get_mp_context,
        get_open_port,
        start_process,
    )

    ctx = get_mp_context()
    init_method = get_distributed_init_method(get_loopback_ip(), get_open_port())
    receiver, sender = ctx.Pipe(duplex=False)
    procs = [
        ctx.Process(
            target=_all_reduce_rank, args=(rank, world_size, init_method, sizes, repeats, sender), daemon=True
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        start_process(proc)
    try:
        # Rank 0's results, unless a rank dies first (or nothing comes for 600 s).
        ready = multiprocessing.connection.wait([receiver, *(proc.sentinel for proc in procs)], timeout=600)
        if receiver not in ready:
            raise RuntimeError(
                f"an all-reduce benchmark rank exited or hung (exit codes {[p.exitcode for p in procs]})."
            )
        results = receiver.recv()
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    for row in results:
        # From the fastest repeat: what the link can do when nothing else competes for the cores.
        row["bus_GBps"] = 2 * (world_size - 1) / world_size * row["bytes"] / row["min_s"] / 1e9
    return results


def write_qwen3_config(path: str | Path, shape: dict[str, int]) -> str:
    """A Qwen3 config.json of `shape` (no weights: run it with load_format="dummy")."""
    import transformers

    config = transformers.Qwen3Config(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config.architectures = ["Qwen3ForCausalLM"]
    config.save_pretrained(path)
    return str(path)


def measure_step_times(
    model_dir: str, tp_size: int, batch_sizes: list[int], input_len: int, output_len: int
) -> list[dict[str, Any]]:
    """Wall time of each engine step (`LLMEngine.step`, engine core in this process) while `batch`
    requests decode together, on the CPU, with random weights in float32. Returns the median
    decode step per batch size.

    torch's threads are whatever this process has; with tp_size=2 each worker gets half of them.
    """
    from nano_v1.engine.llm_engine import LLMEngine
    from nano_v1.sampling_params import SamplingParams

    max_batch = max(batch_sizes)
    engine_args = EngineArgs(
        model=model_dir, load_format="dummy", dtype="float32", device="cpu", tensor_parallel_size=tp_size,
        max_model_len=input_len + output_len, max_num_seqs=max_batch,
        max_num_batched_tokens=max(max_batch * input_len, 512), enable_prefix_caching=False,
        num_gpu_blocks_override=max_batch * -(-(input_len + output_len) // 16) + 2,
    )  # fmt: skip
    engine = LLMEngine.from_engine_args(engine_args, enable_multiprocessing=False)
    rows = []
    try:
        rng = np.random.default_rng(0)
        vocab = engine.vllm_config.model_config.get_vocab_size()
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        for batch_size in [batch_sizes[0], *batch_sizes]:  # the first pass warms up
            for i in range(batch_size):
                prompt = {"prompt_token_ids": rng.integers(3, vocab, size=input_len).tolist()}
                engine.add_request(f"{batch_size}-{i}-{len(rows)}", prompt, params)
            step_s = []
            while engine.has_unfinished_requests():
                start = time.perf_counter()
                engine.step()
                step_s.append(time.perf_counter() - start)
            decode_s = step_s[1:]  # the first step is the whole batch's prefill
            rows.append({"tp_size": tp_size, "batch_size": batch_size, "threads": torch.get_num_threads(),
                         "median_decode_step_s": statistics.median(decode_s), "num_decode_steps": len(decode_s),
                         "prefill_step_s": step_s[0]})  # fmt: skip
    finally:
        engine.shutdown()
    return rows[1:]
