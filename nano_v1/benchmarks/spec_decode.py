"""Speculative decoding: acceptance and speed-up of n-gram drafts, and what verification costs.

Mirrors the speculative-decoding benchmarks of vllm/benchmarks/ (chapter 10).

Why it exists: speculation trades compute for steps. A step that verifies k drafts per
request computes 1 + k tokens for each and keeps 1 to k + 1 of them, so it pays when
the tokens gained per step grow faster than the cost of a step. Two measurements give
both sides:
  - CPU, the bundled demo model, greedy, on Python files the model never saw in
    training (the stdlib's held-out split): acceptance rate and tokens per step against
    k and the n-gram size, and the end-to-end speed-up against the same engine without
    speculation, measured in the same run, with a check that outputs are identical;
  - GPU (`benchmarks/spec_decode_verify.py::verify_cost_sweep` of the source checkout,
    run by the GPU suite): on the Qwen3-0.6B shape, the time of a step that verifies
    1 + k tokens per request against a plain decode step, and from their ratio the
    acceptance rate at which speculation starts to pay.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from nano_v1.benchmarks.utils import print_table, step_timing, write_json
from nano_v1.engine.arg_utils import EngineArgs

NAME = "spec"
USES_ENGINE_ARGS = False
DEFAULT_KS = (1, 2, 3, 5)
DEFAULT_LOOKUP_MAXES = (1, 2, 3, 4)
# The goal: on Python code, with the bundled model, n-gram drafts gain at least 1.5x tokens per
# request-step over no speculation (whose tokens per request-step are exactly 1), greedy output identical.
GOAL = {"min_tokens_per_request_step": 1.5, "identical_to_baseline": True}


# ---------------------------------------------------------------------------- CPU: the demo model
def heldout_prompts(tokenizer, num_prompts: int, prompt_len: int) -> list[list[int]]:
    """`prompt_len` tokens from a third of the way into each of the first held-out stdlib files
    long enough (past the license header and imports, into the code)."""
    from nano_v1.demo_model.corpus import corpus_files, read_sources, split_files

    _, heldout = split_files(corpus_files())
    prompts = []
    for text in read_sources(heldout):
        ids = tokenizer.encode(text, verbose=False)  # whole files exceed the model's context: no warning
        if len(ids) >= 3 * prompt_len:
            start = len(ids) // 3
            prompts.append(ids[start : start + prompt_len])
        if len(prompts) == num_prompts:
            return prompts
    raise ValueError(f"only {len(prompts)} held-out files have {3 * prompt_len} tokens; ask for fewer or shorter prompts.")


def generate_and_count(llm, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """One timed greedy `generate`, counting engine steps and request-steps (a request gaining tokens in a step)."""
    from nano_v1 import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with step_timing(llm) as timings:
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall_s = time.perf_counter() - start
    token_ids = [o.outputs[0].token_ids for o in outputs]
    num_output_tokens = sum(map(len, token_ids))
    num_request_steps = sum(t.num_sampled_reqs for t in timings)
    return {
        "wall_s": wall_s,
        "num_output_tokens": num_output_tokens,
        "num_steps": len(timings),
        "num_request_steps": num_request_steps,
        "tokens_per_request_step": num_output_tokens / num_request_steps,
        "token_ids": token_ids,
    }


def run_cpu_sweep(
    num_prompts: int = 8,
    prompt_len: int = 256,
    max_tokens: int = 128,
    ks: tuple[int, ...] = DEFAULT_KS,
    lookup_maxes: tuple[int, ...] = DEFAULT_LOOKUP_MAXES,
    max_num_seqs: int | None = None,
    dtype: str = "float32",
    engine_overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Every (k, prompt_lookup_max) against no speculation, on the demo model.

    Each speculative run is followed by a run of the baseline engine, and its speed-up is
    taken against that neighbour (the machines are shared and noisy). Prefix caching is
    off so that repeated runs of the same prompts cost the same. float32 by default: in
    the checkpoint's bfloat16, a step verifying 4 tokens rounds differently from a step
    decoding 1, and a near-tie between the top two logits can flip (chapter 10). Every
    engine core runs in this process, where its worker counts the steps. Two engines are
    alive at once (the baseline and one speculating); `engine_overrides` go to both.
    """
    from nano_v1 import LLM
    from nano_v1.metrics.reader import spec_decoding_stats_from_metrics

    engine_args = {"max_model_len": prompt_len + max_tokens + 8, "enable_prefix_caching": False, "dtype": dtype,
                   "max_num_seqs": max_num_seqs or num_prompts, **(engine_overrides or {})}

    def in_process_llm(**extra: Any) -> LLM:
        return LLM.from_engine_args(EngineArgs(**engine_args, **extra), enable_multiprocessing=False)

    baseline = in_process_llm()
    prompts = heldout_prompts(baseline.get_tokenizer(), num_prompts, prompt_len)
    generate_and_count(baseline, prompts[:1], 4)  # warm-up
    reference = generate_and_count(baseline, prompts, max_tokens)
    rows = []
    for k in ks:
        for lookup_max in lookup_maxes:
            spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
                    "prompt_lookup_max": lookup_max}
            llm = in_process_llm(speculative_config=spec)
            run = generate_and_count(llm, prompts, max_tokens)
            peer = generate_and_count(baseline, prompts, max_tokens)
            stats = spec_decoding_stats_from_metrics(llm.get_metrics())
            rows.append({
                "k": k,
                "prompt_lookup_max": lookup_max,
                "acceptance_rate": stats.acceptance_rate,
                "mean_acceptance_length": stats.mean_acceptance_length,
                "accepted_per_position": [n / stats.num_drafts for n in stats.num_accepted_tokens_per_pos],
                "tokens_per_request_step": run["tokens_per_request_step"],
                "num_steps": run["num_steps"],
                "steps_ratio": peer["num_steps"] / run["num_steps"],
                "wall_s": run["wall_s"],
                "baseline_wall_s": peer["wall_s"],
                "speedup": peer["wall_s"] / run["wall_s"],
                "identical_to_baseline": run["token_ids"] == reference["token_ids"],
            })
            del llm
    return {
        "model": "bundled demo model",
        "dtype": str(baseline.llm_engine.vllm_config.model_config.dtype).removeprefix("torch."),
        "workload": {"num_prompts": num_prompts, "prompt_len": prompt_len, "max_tokens": max_tokens,
                     "max_num_seqs": engine_args["max_num_seqs"], "prompts": "held-out stdlib files"},
        "baseline": {key: reference[key] for key in ("wall_s", "num_steps", "tokens_per_request_step")},
        "goal": dict(GOAL),
        "rows": rows,
    }


def print_report(report: dict[str, Any]) -> None:
    w = report["workload"]
    title = (f"{report['model']} ({report['dtype']}), {w['num_prompts']} prompts of {w['prompt_len']} tokens, "
             f"{w['max_tokens']} new tokens, batch {w['max_num_seqs']}: baseline {report['baseline']['num_steps']} "
             f"steps, {report['baseline']['wall_s']:.2f} s")
    columns = [("k", "k", "d"), ("n max", "prompt_lookup_max", "d"), ("accept", "acceptance_rate", ".2f"),
               ("mean len", "mean_acceptance_length", ".2f"), ("tok/step", "tokens_per_request_step", ".2f"),
               ("steps x", "steps_ratio", ".2f"), ("speed-up", "speedup", ".2f"), ("same", "identical_to_baseline", "")]
    goal = (f"goal: at least {GOAL['min_tokens_per_request_step']}x tokens per step (tok/step; 1.00 without "
            "speculation), with the same greedy output")
    print_table(columns, report["rows"], title=title, notes=[goal])


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ks", type=int, nargs="+", default=list(DEFAULT_KS), help="num_speculative_tokens values")
    parser.add_argument("--lookup-maxes", type=int, nargs="+", default=list(DEFAULT_LOOKUP_MAXES),
                        help="prompt_lookup_max values (prompt_lookup_min is 1)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="batch size (default: all prompts at once)")
    parser.add_argument("--dtype", default="float32", help="float32: greedy outputs comparable token for token")
    parser.add_argument("--output-json", type=str, default=None, help="write the results here")


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run the CPU sweep from parsed CLI flags; print a table, write JSON, return the results."""
    report = run_cpu_sweep(args.num_prompts, args.prompt_len, args.max_tokens, tuple(args.ks),
                           tuple(args.lookup_maxes), args.max_num_seqs, args.dtype)
    report["benchmark"] = NAME
    print_report(report)
    if args.output_json:
        write_json(args.output_json, report)
    return report
