"""Offline throughput: output tokens/s of `LLM.generate` against transformers, same process, same workload.

Mirrors vllm/benchmarks/throughput.py (chapter 00).

Why it exists: "how many tokens per second" is the number an inference engine is for, and
it only means something next to a peer measured on the same model, workload and machine
a minute apart. The workload is vLLM's random dataset: prompts of random token ids, every
request generating exactly its `output_len` tokens (`ignore_eos`), lengths uniform in a
range. Peers, run on the same weights:
  - `generate_batch`: transformers' continuous batching. `generate_batch` takes one
    `max_new_tokens` for all requests, so we drive the manager it wraps
    (`continuous_batching_context_manager` + `add_request`) to give each request its own
    length; that loop is `generate_batch`'s own body. Needs transformers >= 5.
  - `generate`: classic padded `generate`, left-padded batches of `--hf-max-batch-size`;
    every row runs to the batch's longest output, but only requested tokens are counted
    (as vLLM's `hf` backend does).
All three decode greedily. Without `--model`, a random tiny Qwen3 (4 layers, hidden 256,
`utils.TINY_QWEN3_SHAPE`) is written to a temporary directory. The goal on a CPU, with that
model and the default workload: nano_v1 at least 10x `generate_batch`'s output tokens/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import torch

from nano_v1.benchmarks.utils import (
    BenchRequest,
    length_range,
    print_table,
    release_engines,
    run_on_model,
    sample_random_requests,
    write_json,
)
from nano_v1.config import VllmConfig
from nano_v1.engine.arg_utils import EngineArgs

NAME = "throughput"
USES_ENGINE_ARGS = True
PEERS = ("generate_batch", "generate")
# The CPU goal's workload: 48 requests, prompts of 32-256 tokens, 48 output tokens each; on it,
# with the tiny Qwen3, nano_v1 must reach at least 10x generate_batch's output tokens/s.
DEFAULT_NUM_PROMPTS = 48
DEFAULT_INPUT_LEN_RANGE = (32, 256)
DEFAULT_OUTPUT_LEN = 48
GOAL_RATIO_VS_GENERATE_BATCH = 10.0
# generate_batch's step size on CPU: the fastest of 512, 2048 and 8192 tokens on the 2-core
# CPU (its SDPA path fills a mask per step that grows with the step size); its own default,
# sized from free memory, was slower still.
CPU_HF_MAX_BATCH_TOKENS = 512
# How long a hard stop of transformers' continuous batching manager may wait for its thread.
MANAGER_STOP_TIMEOUT_S = 10.0


@dataclasses.dataclass(slots=True)
class RunResult:
    """One engine's timed pass over the workload."""

    elapsed_s: float
    num_prompt_tokens: int
    num_output_tokens: int

    def summary(self, flops: float) -> dict[str, float]:
        return {
            "elapsed_s": self.elapsed_s,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "output_tokens_per_s": self.num_output_tokens / self.elapsed_s,
            "total_tokens_per_s": (self.num_prompt_tokens + self.num_output_tokens) / self.elapsed_s,
            "gflops_per_s": flops / self.elapsed_s / 1e9,
        }


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=DEFAULT_NUM_PROMPTS, help="number of requests")
    parser.add_argument("--input-len", type=int, default=None, help="prompt length (vLLM's flag)")
    parser.add_argument("--output-len", type=int, default=DEFAULT_OUTPUT_LEN, help="output length (vLLM's flag)")
    parser.add_argument(
        "--random-range-ratio", type=float, default=0.0,
        help="draw lengths from [len*(1-r), len*(1+r)] (vLLM's flag; applies to --input-len and --output-len)",
    )
    parser.add_argument(
        "--input-len-range", type=int, nargs=2, metavar=("LO", "HI"), default=None,
        help=f"prompt lengths uniform in [LO, HI]; default {DEFAULT_INPUT_LEN_RANGE} unless --input-len is given",
    )
    parser.add_argument("--output-len-range", type=int, nargs=2, metavar=("LO", "HI"), default=None,
                        help="output lengths uniform in [LO, HI] (overrides --output-len)")
    parser.add_argument("--peers", choices=("none", *PEERS, "all"), default="all",
                        help="which transformers baselines to run beside nano_v1")
    parser.add_argument("--hf-max-batch-size", type=int, default=None,
                        help="batch size of padded generate (default: all prompts in one batch)")
    parser.add_argument(
        "--hf-max-batch-tokens", type=int, default=None,
        help=f"tokens per step of generate_batch (default: {CPU_HF_MAX_BATCH_TOKENS} on CPU, "
        "transformers' own choice on CUDA)",
    )
    parser.add_argument("--output-json", type=str, default=None, help="write the results here")


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark from parsed CLI flags; print a table, write JSON, return the results."""
    return run_on_model(args, run)


def run(args: argparse.Namespace, engine_args: EngineArgs) -> dict[str, Any]:
    vllm_config = engine_args.create_engine_config()
    model_config = vllm_config.model_config
    input_explicit = args.input_len_range or (DEFAULT_INPUT_LEN_RANGE if args.input_len is None else None)
    input_range = length_range(args.input_len, args.random_range_ratio, input_explicit)
    output_range = length_range(args.output_len, args.random_range_ratio, args.output_len_range)
    if input_range[1] + output_range[1] > model_config.max_model_len:
        raise ValueError(
            f"the longest request ({input_range[1]} + {output_range[1]} tokens) exceeds max_model_len "
            f"({model_config.max_model_len})."
        )
    requests = sample_random_requests(
        args.num_prompts, input_range, output_range, model_config.get_vocab_size(), engine_args.seed
    )
    flops = workload_flops(vllm_config, requests)
    peers = {"none": (), "all": PEERS}.get(args.peers, (args.peers,))

    results: dict[str, RunResult] = {"nano_v1": run_nano_v1(engine_args, requests)}
    device = vllm_config.device_config.device
    # nano_v1's engine is out of scope; free it so its KV cache memory goes to the peers.
    release_engines()
    if peers:
        model = load_hf_model(vllm_config)
        if "generate_batch" in peers:
            max_batch_tokens = args.hf_max_batch_tokens or (CPU_HF_MAX_BATCH_TOKENS if device == "cpu" else None)
            results["generate_batch"] = run_generate_batch(model, requests, max_batch_tokens)
        if "generate" in peers:
            results["generate"] = run_generate(model, requests, args.hf_max_batch_size or len(requests))

    summaries = {name: r.summary(flops) for name, r in results.items()}
    ours = summaries["nano_v1"]["output_tokens_per_s"]
    ratios = {f"nano_v1/{p}": ours / summaries[p]["output_tokens_per_s"] for p in peers}
    report = {
        "benchmark": NAME,
        "model": args.model or "random tiny Qwen3 (nano_v1.benchmarks.utils.TINY_QWEN3_SHAPE)",
        "workload": {
            "num_prompts": len(requests),
            "input_len_range": list(input_range),
            "output_len_range": list(output_range),
            "seed": engine_args.seed,
            "flops": flops,
        },
        "engine_args": {k: str(v) for k, v in dataclasses.asdict(engine_args).items()},
        "results": summaries,
        "ratios": ratios,
        "goal": {"nano_v1/generate_batch": GOAL_RATIO_VS_GENERATE_BATCH},
    }
    print_report(report)
    if args.output_json:
        write_json(args.output_json, report)
    return report


def workload_flops(vllm_config: VllmConfig, requests: list[BenchRequest]) -> float:
    """Matmul FLOPs the workload needs at least: 2 x weights per token, plus the LM head per sampled token.

    This is the compute floor every engine pays; attention over the context comes on top
    (small for these lengths) and is left out. Dividing by the time gives achieved GFLOP/s,
    which on a CPU says how far each engine is from the machine's matmul rate.
    """
    mc = vllm_config.model_config
    hidden, head = mc.get_hidden_size(), mc.get_head_size()
    q_size, kv_size = mc.get_num_attention_heads() * head, mc.get_num_kv_heads() * head
    per_layer = hidden * (q_size + 2 * kv_size) + q_size * hidden + 3 * hidden * mc.hf_config.intermediate_size
    num_tokens = sum(r.prompt_len + r.output_len - 1 for r in requests)  # the last token is never fed back
    num_sampled = sum(r.output_len for r in requests)
    return 2.0 * (mc.get_num_layers() * per_layer * num_tokens + hidden * mc.get_vocab_size() * num_sampled)


def run_nano_v1(engine_args: EngineArgs, requests: list[BenchRequest]) -> RunResult:
    """Time `LLM.generate` over the whole workload, after a short warm-up pass.

    The engine core runs where VLLM_ENABLE_V1_MULTIPROCESSING says, as under `vllm bench
    throughput`.
    """
    from nano_v1 import LLM

    return time_llm_generate(LLM.from_engine_args(engine_args), requests)


def time_llm_generate(llm, requests: list[BenchRequest]) -> RunResult:
    """`run_nano_v1` on an engine that already exists."""
    from nano_v1 import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    _check_lengths("nano_v1", lengths, requests)
    return RunResult(elapsed, sum(len(o.prompt_token_ids) for o in outputs), sum(lengths))


def load_hf_model(vllm_config: VllmConfig):
    """The same checkpoint through transformers, on nano_v1's device and dtype."""
    from transformers import AutoModelForCausalLM

    model_config = vllm_config.model_config
    model = AutoModelForCausalLM.from_pretrained(model_config.model, dtype=model_config.dtype)
    return model.to(vllm_config.device_config.device).eval()


def dummy_hf_model(model_dir: str, dtype: torch.dtype, device: torch.device):
    """The transformers model of a config.json, randomly initialised directly on `device` (no checkpoint)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def _greedy_config(max_new_tokens: int):
    from transformers import GenerationConfig

    # eos_token_id=[]: no token ends a sequence (`ignore_eos`), so lengths are exact.
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=[], pad_token_id=0)


@torch.no_grad()
def run_generate_batch(
    model,
    requests: list[BenchRequest],
    max_batch_tokens: int | None,
    use_cuda_graph: bool | None = None,
    progress: dict[str, Any] | None = None,
) -> RunResult:
    """transformers' continuous batching, each request with its own `max_new_tokens`.

    The KV cache is sized to hold the whole workload at once, as nano_v1's is on CPU; left
    to itself, transformers sizes it from the host's free memory and spends seconds
    filling a cache hundreds of times too large. Under `no_grad`, not `inference_mode`:
    the manager's warm-up makes tensors on this thread that its generation thread then
    updates in place, which tensors made in inference mode refuse outside it (transformers
    5.17). The timed pass keeps `progress` up to date (`timed_s`, seconds since its first
    request went in; `num_finished`, requests done), also when it is interrupted, so a
    caller whose time cap cut it short knows how long it ran.
    """
    try:
        from transformers import ContinuousBatchingConfig
        from transformers.generation.continuous_batching.utils import WorkloadHints
    except ImportError as e:
        raise ValueError("the generate_batch peer needs transformers >= 5; use --peers generate or none.") from e

    page_size = 256
    # The KV page size is `page_size` in recent transformers and `block_size` in older 5.x.
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    page_field = "page_size" if "page_size" in fields else "block_size"
    cb_config = ContinuousBatchingConfig(
        **{page_field: page_size},
        num_blocks=sum(-(-(r.prompt_len + r.output_len) // page_size) for r in requests),
        max_batch_tokens=max_batch_tokens,
        use_cuda_graph=use_cuda_graph,
    )
    hints = WorkloadHints(
        max_prompt_length=max(r.prompt_len for r in requests),
        max_generated_length=max(r.output_len for r in requests),
        num_requests=len(requests),
    )

    def generate(batch: list[BenchRequest], progress: dict[str, Any]) -> tuple[list[int], float]:
        """Output lengths, and seconds from the first request in to the last result out
        (the manager's start-up, graph capture included, and its shutdown are not timed)."""
        manager = model.init_continuous_batching(
            generation_config=_greedy_config(max(r.output_len for r in batch)),
            continuous_batching_config=cb_config,
            workload_hints=hints,
        )
        manager.warmup()
        manager.start()
        lengths: dict[str, int] = {}
        start = time.perf_counter()
        try:
            for i, r in enumerate(batch):
                manager.add_request(r.prompt_token_ids, request_id=f"req_{i}", max_new_tokens=r.output_len)
            while len(lengths) < len(batch):
                result = manager.get_result(timeout=1)
                if result is None and not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread stopped before finishing.")
                if result is not None and result.is_finished():
                    lengths[result.request_id] = len(result.generated_tokens)
                progress.update(timed_s=time.perf_counter() - start, num_finished=len(lengths))
        finally:
            progress.update(timed_s=time.perf_counter() - start, num_finished=len(lengths))
            _stop_manager(manager)
        return [lengths[f"req_{i}"] for i in range(len(batch))], progress["timed_s"]

    generate(requests[:2], {})  # warm-up
    lengths, elapsed = generate(requests, {} if progress is None else progress)
    _check_lengths("generate_batch", lengths, requests)
    return RunResult(elapsed, sum(r.prompt_len for r in requests), sum(lengths))


def _stop_manager(manager) -> None:
    """Stop a continuous batching manager at once, whatever it still has queued.

    Its context manager's exit stops it by flushing, with no time limit: every request
    still queued is generated first (a 5 s cap returned after 166 s on a CPU). A hard stop
    ends the generation thread after its current batch; if the thread is still alive
    `MANAGER_STOP_TIMEOUT_S` later, the manager is left to it rather than destroyed
    (destroying a running manager flushes it).
    """
    manager.stop(block=True, timeout=MANAGER_STOP_TIMEOUT_S, hard_stop=True)
    if not manager.is_running():
        manager.destroy()


@torch.inference_mode()
def run_generate(model, requests: list[BenchRequest], max_batch_size: int) -> RunResult:
    """Padded `generate`: static batches, left padding, every row runs to the batch's longest output."""
    if max_batch_size <= 0:
        raise ValueError(f"--hf-max-batch-size must be positive, got {max_batch_size}.")
    device = model.device

    def generate(batch: list[BenchRequest]) -> None:
        width = max(r.prompt_len for r in batch)
        input_ids = torch.zeros(len(batch), width, dtype=torch.long)  # pad id 0
        attention_mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, r in enumerate(batch):
            input_ids[row, width - r.prompt_len :] = torch.tensor(r.prompt_token_ids)
            attention_mask[row, width - r.prompt_len :] = 1
        out = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            generation_config=_greedy_config(max(r.output_len for r in batch)),
        )
        assert out.shape[1] == width + max(r.output_len for r in batch)

    generate(requests[:2])  # warm-up
    start = time.perf_counter()
    for i in range(0, len(requests), max_batch_size):
        generate(requests[i : i + max_batch_size])
    elapsed = time.perf_counter() - start
    return RunResult(elapsed, sum(r.prompt_len for r in requests), sum(r.output_len for r in requests))


def _check_lengths(engine: str, lengths: list[int], requests: list[BenchRequest]) -> None:
    wrong = [i for i, (n, r) in enumerate(zip(lengths, requests)) if n != r.output_len]
    if wrong:
        i = wrong[0]
        raise RuntimeError(
            f"{engine} generated {lengths[i]} tokens for request {i}, which asked for {requests[i].output_len}: "
            "the workload was not run as specified."
        )


def print_report(report: dict[str, Any]) -> None:
    w = report["workload"]
    title = (f"{w['num_prompts']} requests, prompts {w['input_len_range'][0]}-{w['input_len_range'][1]} tokens, "
             f"outputs {w['output_len_range'][0]}-{w['output_len_range'][1]} tokens; {report['model']}")
    columns = [("engine", "engine", ""), ("time (s)", "elapsed_s", ".2f"),
               ("output tok/s", "output_tokens_per_s", ".1f"), ("total tok/s", "total_tokens_per_s", ".1f"),
               ("GFLOP/s", "gflops_per_s", ".2f")]
    rows = [{"engine": name, **summary} for name, summary in report["results"].items()]
    notes = [f"{name}: {ratio:.2f}x output tokens/s" for name, ratio in report["ratios"].items()]
    notes += [f"goal (tiny Qwen3 on a CPU, the default workload): {name} >= {goal:.0f}x"
              for name, goal in report["goal"].items()]
    print_table(columns, rows, title=title, notes=notes)
