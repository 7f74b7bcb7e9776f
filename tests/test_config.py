"""The configuration: one config per part, `VllmConfig` settling what spans several, and
`EngineArgs` taking every default and every flag's help from the configs.

The oracles: the config classes themselves (a default written twice is a default that can
drift), vLLM v0.11.0's rules for the token budget, and argparse round trips.
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from nano_v1.config import (
    CacheConfig,
    CompilationConfig,
    CUDAGraphMode,
    DeviceConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from nano_v1.config.utils import CONFIG, CONFIG_FIELD, get_attr_docs
from nano_v1.cudagraph_dispatcher import CudagraphDispatcher
from nano_v1.engine.arg_utils import EngineArgs
from nano_v1.forward_context import BatchDescriptor
from nano_v1.outputs import LogprobsTensors
from nano_v1.spec_decode.metadata import calc_spec_decode_metadata

pytestmark = pytest.mark.ch01

def test_every_engine_argument_defaults_to_its_config_field():
    """One place per default: EngineArgs restates none of the configs' defaults."""
    for f in dataclasses.fields(EngineArgs):
        if CONFIG_FIELD not in f.metadata:  # a whole config, given at once (a dict, or JSON on the CLI)
            assert f.default is None and f.metadata["help"], f.name
            continue
        config_cls, name = f.metadata[CONFIG], f.metadata[CONFIG_FIELD]
        (target,) = [g for g in dataclasses.fields(config_cls) if g.name == name]
        assert (f.default, f.default_factory) == (target.default, target.default_factory), f.name


def test_the_cli_groups_each_flag_under_the_config_it_sets_with_a_help_text():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    grouped = {
        group.title: {action.dest for action in group._group_actions}
        for group in parser._action_groups
        if group._group_actions and group.title not in ("positional arguments", "options")
    }
    expected: dict[str, set[str]] = {}
    for f in dataclasses.fields(EngineArgs):
        expected.setdefault(f.metadata[CONFIG].__name__, set()).add(f.name)
    assert grouped == expected
    assert {"ModelConfig", "CacheConfig", "SchedulerConfig", "CompilationConfig"} <= set(grouped)
    assert all(action.help for action in parser._actions if action.dest != "help")


def test_engine_config_passes_every_argument_to_its_config(tiny_qwen3):
    """Each argument, set to something other than its default, reaches the config field it names."""
    changed = dict(
        model=tiny_qwen3, seed=7, max_model_len=96, enforce_eager=True, device="cpu",
        block_size=32, num_gpu_blocks_override=9, enable_prefix_caching=False, max_num_seqs=5,
        scheduling_policy="priority", long_prefill_token_threshold=4, disable_chunked_mm_input=True,
    )  # fmt: skip
    config = EngineArgs(**changed).create_engine_config()
    slices = {type(s): s for s in vars(config).values() if s is not None}
    for f in dataclasses.fields(EngineArgs):
        if f.name in changed:
            value = getattr(slices[f.metadata[CONFIG]], f.metadata[CONFIG_FIELD])
            assert value == changed[f.name], f.name


def test_attribute_docstrings_are_read_from_the_class_body():
    docs = get_attr_docs(CacheConfig)
    assert docs["block_size"] == "Tokens per KV cache block."
    assert "num_gpu_blocks" in docs and "tokenizer" not in docs


def test_cli_round_trip_keeps_only_the_flags_given(tiny_qwen3):
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(
        ["--model", tiny_qwen3, "--max-num-seqs", "3", "--no-enable-prefix-caching", "--scheduling-policy",
         "priority", "--gpu-memory-utilization", "0.5", "--compilation-config", '{"level": 3}']
    )  # fmt: skip
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args == EngineArgs(
        model=tiny_qwen3, max_num_seqs=3, enable_prefix_caching=False, scheduling_policy="priority",
        gpu_memory_utilization=0.5, compilation_config='{"level": 3}',
    )  # fmt: skip
    config = engine_args.create_engine_config()
    assert (config.scheduler_config.max_num_seqs, config.scheduler_config.policy) == (3, "priority")
    assert config.cache_config.enable_prefix_caching is False
    assert config.compilation_config.level == 3
    # Nothing given: every field keeps its default.
    assert EngineArgs.from_cli_args(parser.parse_args([])) == EngineArgs()


def test_vllm_config_settles_the_token_budget(tiny_qwen3):
    """vLLM's defaults: 8192 with chunked prefill; without it, at least max_model_len."""

    def budget(**scheduler) -> int:
        config = VllmConfig(
            ModelConfig(tiny_qwen3, max_model_len=1024), scheduler_config=SchedulerConfig(**scheduler),
            device_config=DeviceConfig("cpu"),
        )  # fmt: skip
        return config.scheduler_config.max_num_batched_tokens

    assert budget() == 8192
    assert budget(enable_chunked_prefill=False) == 8192
    assert budget(max_num_batched_tokens=64) == 64
    with pytest.raises(ValueError, match="max_num_batched_tokens .* smaller than max_model_len"):
        budget(enable_chunked_prefill=False, max_num_batched_tokens=512)


@pytest.mark.parametrize(
    ("config_cls", "kwargs", "message"),
    [
        (CacheConfig, {"block_size": 0}, "block_size"),
        (CacheConfig, {"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        (CacheConfig, {"num_gpu_blocks_override": -3}, "num_gpu_blocks_override"),
        (SchedulerConfig, {"max_num_seqs": 0}, "max_num_seqs"),
        (SchedulerConfig, {"max_num_batched_tokens": True}, "max_num_batched_tokens"),
        (SchedulerConfig, {"long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
        (SchedulerConfig, {"policy": "lifo"}, "scheduling_policy"),
        (DeviceConfig, {"device": "tpu"}, "device"),
    ],
)
def test_each_config_checks_its_own_fields(config_cls, kwargs, message):
    with pytest.raises(ValueError, match=message):
        config_cls(**kwargs)


# ---------------------------------------------------------------- the CUDA graph dispatcher (chapter 08)
def dispatcher(mode: CUDAGraphMode, sizes: list[int], max_num_seqs: int) -> CudagraphDispatcher:
    """A dispatcher over `sizes` without a model (the keys depend on the config only)."""
    config = VllmConfig.__new__(VllmConfig)
    config.compilation_config = CompilationConfig(level=3, cudagraph_mode=mode, cudagraph_capture_sizes=sizes)
    config.compilation_config.max_capture_size = max(sizes)
    config.scheduler_config = SchedulerConfig(max_num_seqs=max_num_seqs)
    d = CudagraphDispatcher(config)
    d.initialize_cudagraph_keys(mode)
    return d


@pytest.mark.ch08
def test_dispatch_pads_to_the_next_captured_key():
    d = dispatcher(CUDAGraphMode.FULL_AND_PIECEWISE, [1, 2, 4, 8, 16], max_num_seqs=4)
    # A pure decode batch of 3 runs the FULL graph of 4; 5 decodes exceed max_num_seqs's FULL
    # graphs and fall back to the PIECEWISE graph of 8; a mixed batch always runs PIECEWISE.
    assert d.dispatch(3, uniform_decode=True) == (CUDAGraphMode.FULL, BatchDescriptor(4, True))
    assert d.dispatch(5, uniform_decode=True) == (CUDAGraphMode.PIECEWISE, BatchDescriptor(8))
    assert d.dispatch(3, uniform_decode=False) == (CUDAGraphMode.PIECEWISE, BatchDescriptor(4))
    assert d.dispatch(17, uniform_decode=False) == (CUDAGraphMode.NONE, None)  # above every size
    keys = d.get_capture_descriptors()
    assert keys == [(CUDAGraphMode.PIECEWISE, BatchDescriptor(n)) for n in (16, 8, 4, 2, 1)] + [
        (CUDAGraphMode.FULL, BatchDescriptor(n, True)) for n in (4, 2, 1)
    ]
    # Every size a step can be dispatched to was captured.
    captured = {key for _, key in keys}
    for n in range(1, 17):
        for uniform in (False, True):
            mode, key = d.dispatch(n, uniform)
            assert mode != CUDAGraphMode.NONE and key in captured and key.num_tokens >= n


@pytest.mark.ch08
@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        (CUDAGraphMode.PIECEWISE, (CUDAGraphMode.PIECEWISE, BatchDescriptor(4))),
        (CUDAGraphMode.FULL, (CUDAGraphMode.FULL, BatchDescriptor(4, True))),
        (CUDAGraphMode.NONE, (CUDAGraphMode.NONE, None)),
    ],
)
def test_dispatch_follows_the_mode(mode, expected):
    d = dispatcher(mode, [1, 2, 4], max_num_seqs=8)
    assert d.dispatch(3, uniform_decode=True) == expected
    # FULL alone has no graph for a mixed batch.
    assert d.dispatch(3, uniform_decode=False)[0] == (
        CUDAGraphMode.PIECEWISE if mode == CUDAGraphMode.PIECEWISE else CUDAGraphMode.NONE
    )


# ---------------------------------------------------------------- pure helpers of the model runner
@pytest.mark.ch10
def test_spec_decode_metadata_against_brute_force():
    rng = torch.Generator().manual_seed(0)
    for _ in range(50):
        num_reqs = int(torch.randint(1, 6, (1,), generator=rng))
        drafts = torch.randint(0, 4, (num_reqs,), generator=rng).numpy()
        scheduled = drafts + 1 + torch.randint(0, 3, (num_reqs,), generator=rng).numpy() * (drafts == 0)
        input_ids = torch.randint(0, 100, (int(scheduled.sum()),), generator=rng).numpy()
        cu = scheduled.cumsum()
        md = calc_spec_decode_metadata(drafts.astype("int64"), cu, input_ids, torch.device("cpu"))
        # Brute force: a request with k drafts takes logits at its last k + 1 tokens.
        rows, targets, bonus, draft_ids = [], [], [], []
        for end, k in zip(cu.tolist(), drafts.tolist()):
            first = len(rows)
            rows += list(range(end - k - 1, end))
            targets += list(range(first, first + k))
            bonus.append(first + k)
            draft_ids += input_ids[end - k : end].tolist()
        assert md.logits_indices.tolist() == rows
        assert md.target_logits_indices.tolist() == targets
        assert md.bonus_logits_indices.tolist() == bonus
        assert md.draft_token_ids.tolist() == draft_ids
        assert md.cu_num_draft_tokens.tolist() == drafts.cumsum().tolist()


def test_logprobs_tensors_tolists_keeps_each_rows_width():
    tensors = LogprobsTensors(
        logprob_token_ids=torch.tensor([[5, 1, 2, 3], [7, 7, 4, 0], [9, 8, 6, 5]]),
        logprobs=torch.tensor([[-0.5, -0.1, -0.2, -0.3], [-0.7, -0.7, -1.0, -2.0], [-3.0, -0.1, -0.2, -0.4]]),
        selected_token_ranks=torch.tensor([5, 1, 9]),
    )
    # Row 0 asked for 2 top logprobs, row 1 for none (or its sample was discarded), row 2 for 3.
    assert tensors.tolists([2, None, 3]) == [
        [{5: -0.5, 1: pytest.approx(-0.1), 2: pytest.approx(-0.2)}],
        [],
        [{9: -3.0, 8: pytest.approx(-0.1), 6: pytest.approx(-0.2), 5: pytest.approx(-0.4)}],
    ]
    # The sampled token is among the top ones: the dict holds it once.
    assert tensors.tolists([None, 1, None])[1] == [{7: pytest.approx(-0.7)}]


# ---------------------------------------------------------------- the hook into the workers
def test_collective_rpc_reaches_the_worker_by_name_and_by_function(tiny_qwen3):
    from nano_v1 import LLM, SamplingParams

    llm = LLM(tiny_qwen3, dtype="float32", max_num_seqs=4)
    assert llm.collective_rpc(lambda worker, x: (type(worker).__name__, x), args=(7,)) == [("Worker", 7)]
    llm.collective_rpc("start_step_timing")
    llm.generate({"prompt_token_ids": [1, 2, 3, 4, 5]}, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    (timings,) = llm.collective_rpc("stop_step_timing")
    # One prefill step of 5 tokens, then 3 decode steps; every step sampled the one request.
    assert [t.num_scheduled_tokens for t in timings] == [5, 1, 1, 1]
    assert all(t.num_sampled_reqs == 1 and 0 < t.forward_s <= t.execute_model_s for t in timings)
    assert llm.collective_rpc("stop_step_timing") == [[]]  # recording stopped


def test_step_timing_is_on_the_runner_only_while_on(tiny_qwen3):
    """The worker times steps by shadowing the runner's `execute_model`, `_execute_mm_encoder`
    and `model` while timing is on; off, the runner is exactly itself and steps run untimed."""
    from nano_v1 import LLM, SamplingParams

    llm = LLM(tiny_qwen3, dtype="float32", max_num_seqs=4)
    (runner,) = llm.collective_rpc(lambda worker: worker.model_runner)
    model = runner.model
    prompts = [{"prompt_token_ids": [1, 2, 3, 4, 5]}, {"prompt_token_ids": [7, 8, 9]}]
    params = SamplingParams(temperature=0.0, max_tokens=4)

    def generate() -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    untimed = generate()
    own_attributes = set(vars(runner))
    assert not {"execute_model", "_execute_mm_encoder"} & own_attributes
    assert not any("timing" in name for name in own_attributes) and runner.model is model
    llm.collective_rpc("start_step_timing")
    assert {"execute_model", "_execute_mm_encoder"} <= set(vars(runner)) and runner.model is not model
    timed = generate()
    (timings,) = llm.collective_rpc("stop_step_timing")
    assert set(vars(runner)) == own_attributes and runner.model is model
    assert timed == untimed == generate()
    # One prefill step of both prompts, then 3 decode steps of both.
    assert [(t.num_scheduled_tokens, t.num_sampled_reqs) for t in timings] == [(8, 2), (2, 2), (2, 2), (2, 2)]
    assert all(0 < t.forward_s <= t.execute_model_s for t in timings)
    assert all(t.encoder_s == 0 and t.num_encoder_tokens == 0 for t in timings)  # no images
