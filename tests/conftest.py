"""Shared fixtures and builders (tests import the builders with `from conftest import ...`).

- Tiny, randomly initialised Hugging Face checkpoints saved to disk: every parity test
  loads these through the same path a real checkpoint takes (`config.json` +
  `model.safetensors` in a directory); nothing is downloaded.
- Configs and inputs that several test files build: a CPU engine's `VllmConfig`, a
  `Scheduler` without any checkpoint, `SamplingMetadata` as the persistent batch builds it.
"""

from __future__ import annotations

import os
import types
from typing import TYPE_CHECKING

import hypothesis
import pytest
import torch

if TYPE_CHECKING:
    from nano_v1.config import VllmConfig
    from nano_v1.core.sched.scheduler import Scheduler
    from nano_v1.sample.metadata import SamplingMetadata

# Engines under test run in-process unless a test asks for the engine-core process itself
# (chapter 09); spawning one per test would cost seconds each.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# Without a GPU, Triton kernels run in Triton's interpreter (numpy on the CPU). Read when a
# kernel is decorated, so it must be set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


TINY_SHAPES = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


# Gemma 3's pattern at tiny size (chapter 12): 3 sliding-window layers and 2 full-attention
# ones, which group as (sw.0, sw.3), (sw.1, padding), (full.2, full.4); a window shorter
# than the prompts and outputs the tests use.
TINY_GEMMA3 = dict(
    head_dim=32,
    num_hidden_layers=5,
    layer_types=[
        "sliding_attention",
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "full_attention",
    ],
    sliding_window=24,
)


def make_tiny_checkpoint(path, arch: str = "qwen3", seed: int = 0, **overrides) -> str:
    """Write a random tiny `arch` checkpoint (qwen3 | qwen2 | llama | gemma3) to `path`; return it."""
    import transformers

    cfg_cls, model_cls = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }[arch]
    kwargs = dict(TINY_SHAPES, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "qwen3":
        kwargs["head_dim"] = 32
    if arch == "gemma3":
        kwargs.update(TINY_GEMMA3)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kwargs)).to(torch.float32).eval()
    # Random init is near-uniform: widen the weights so greedy decoding is not a tie-break lottery.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session", params=["qwen3", "qwen2", "llama"])
def tiny_checkpoint_any(request, tmp_path_factory) -> str:
    """A tiny checkpoint of each supported architecture."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")


def make_vllm_config(model: str, device: str = "cpu", **engine_args) -> VllmConfig:
    """The config `LLM(model, device=device, **engine_args)` would run with (on the CPU by default)."""
    from nano_v1.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, device=device, **engine_args).create_engine_config()


def make_scheduler(
    num_blocks, block_size, budget, max_seqs, max_model_len, caching,
    chunked=True, policy="fcfs", num_spec_tokens=0, reserve_full_isl=False, kv_cache_config=None,
    async_scheduling=False,
) -> Scheduler:  # fmt: skip
    """A scheduler over `num_blocks` KV blocks (block 0 is the null block), with no checkpoint.

    One full-attention KV cache group unless the test brings its own `kv_cache_config` (chapter 12);
    an `AsyncScheduler` with `async_scheduling` (chapter 14).
    """
    from kv_cache_configs import full_attention_kv_cache_config

    from nano_v1.config import CacheConfig, DeviceConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
    from nano_v1.core.sched.async_scheduler import AsyncScheduler
    from nano_v1.core.sched.scheduler import Scheduler

    config = VllmConfig.__new__(VllmConfig)
    config.cache_config = CacheConfig(
        block_size=block_size, enable_prefix_caching=caching, num_gpu_blocks=num_blocks
    )
    config.scheduler_config = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        enable_chunked_prefill=chunked,
        policy=policy,
        scheduler_reserve_full_isl=reserve_full_isl,
        async_scheduling=async_scheduling,
    )
    # The scheduler reads only max_model_len and whether the model takes images (chapter 11)
    # from the model's config: no checkpoint needed.
    config.model_config = types.SimpleNamespace(max_model_len=max_model_len, is_multimodal_model=False)
    config.device_config = DeviceConfig("cpu")
    if num_spec_tokens:
        config.speculative_config = SpeculativeConfig(
            num_speculative_tokens=num_spec_tokens, prompt_lookup_min=1
        )
    scheduler_cls = AsyncScheduler if async_scheduling else Scheduler
    return scheduler_cls(config, kv_cache_config or full_attention_kv_cache_config(num_blocks, block_size))


def make_sampling_metadata(
    temperature: list[float],
    top_p: list[float] | None = None,
    top_k: list[int] | None = None,
    generators: dict[int, torch.Generator] | None = None,
    max_num_logprobs: int | None = None,
) -> SamplingMetadata:
    """Metadata as the persistent batch builds it: greedy rows carry temperature 0."""
    from nano_v1.sample.metadata import SamplingMetadata

    greedy = [t == 0.0 for t in temperature]
    return SamplingMetadata(
        temperature=None if all(greedy) else torch.tensor(temperature),
        all_greedy=all(greedy),
        all_random=not any(greedy),
        top_p=None if top_p is None else torch.tensor(top_p),
        top_k=None if top_k is None else torch.tensor(top_k, dtype=torch.int32),
        generators=generators or {},
        max_num_logprobs=max_num_logprobs,
    )


def pytest_configure(config) -> None:
    """Register one marker per assignment task region in the source (`ch04_t1`, ...).

    Derived from the `# BEGIN TASK` lines, so a new task needs no edit here, and
    `--strict-markers` still rejects a task marker that names no region.
    """
    from nano_v1.assignments import find_tasks, pytest_marker_lines

    for line in pytest_marker_lines(find_tasks()):
        config.addinivalue_line("markers", line)


def pytest_collection_modifyitems(config, items) -> None:
    """Skip `gpu`-marked tests where CUDA is absent (CI and laptops)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# `--hypothesis-profile=fail_fast`: report the first failing example as found, without
# shrinking or explaining it, and keep no example database. The assignment integrity
# check (test_assignments.py) only needs to know that a stubbed or planted-bug task
# fails; shrinking a failure that every example hits costs tens of seconds per test, and
# a database would replay one variant's failing examples against the next.
hypothesis.settings.register_profile(
    "fail_fast",
    phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
    database=None,
)
