"""Hybrid KV cache groups in numbers: bytes per token of context, and requests that fit (chapter 12).

Mirrors no vLLM file: the arithmetic behind vllm/v1/core/kv_cache_utils.py's "GPU KV cache
size" and "Maximum concurrency" log lines, and a scheduler-only measurement of both.
Needs a source checkout (`pip install .` installs only nano_v1): imported from its root.

Why it exists: a sliding-window layer needs only its window's blocks, so how much memory
the hybrid allocator gives back depends on the layer pattern, the window, the context
and on how vLLM groups the layers (padding included). Everything here goes through the
engine's own code: a model's layers are built on the meta device (no memory), the model
runner names their specs (`GPUModelRunner.get_kv_cache_spec`), `get_kv_cache_configs`
groups them and counts blocks, and the real `Scheduler` admits requests until the cache
is full, with a stand-in for the model that samples a fixed token. So the numbers are
nano_v1's allocator's, and a device only changes how many bytes there are.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from nano_v1.attention.layer import Attention
from nano_v1.config import VllmConfig, set_current_vllm_config
from nano_v1.core.kv_cache_utils import get_kv_cache_configs
from nano_v1.core.sched.scheduler import Scheduler
from nano_v1.engine.arg_utils import EngineArgs
from nano_v1.kv_cache_interface import KVCacheConfig, KVCacheSpec, SlidingWindowSpec
from nano_v1.model_executor.models import resolve_model_cls
from nano_v1.outputs import ModelRunnerOutput
from nano_v1.request import Request
from nano_v1.sampling_params import SamplingParams
from nano_v1.worker.gpu_model_runner import GPUModelRunner

# The token every stand-in step "samples" (requests ignore EOS).
FIXED_TOKEN_ID = 7


def engine_config(model_dir: str, max_model_len: int, disable_hybrid: bool, **engine_args) -> VllmConfig:
    """A CPU engine config for `model_dir` (weights never read) with the hybrid allocator on or off."""
    fixed = dict(device="cpu", load_format="dummy", enable_prefix_caching=False, max_model_len=max_model_len)
    engine_args = EngineArgs(
        model_dir, disable_hybrid_kv_cache_manager=disable_hybrid, **fixed, **engine_args
    )
    return engine_args.create_engine_config()


def model_kv_cache_spec(vllm_config: VllmConfig) -> dict[str, KVCacheSpec]:
    """The layer specs the engine would compute for this model, without allocating its weights.

    The modules are built on the meta device under the config (so each `Attention` layer
    knows its window), then a model runner names their specs. The runner is built for one
    request: its host buffers grow with `max_num_seqs` x `max_model_len` (half a GiB of
    token ids for 4,096 requests of 32k tokens), and the specs do not depend on them.
    """
    hf_config = vllm_config.model_config.hf_config
    with set_current_vllm_config(vllm_config), torch.device("meta"):
        model = resolve_model_cls(hf_config.architectures)(hf_config)
    one_request = copy.copy(vllm_config)
    one_request.scheduler_config = copy.copy(vllm_config.scheduler_config)
    one_request.scheduler_config.max_num_seqs = 1
    runner = GPUModelRunner(one_request, torch.device("cpu"))
    runner.attn_layers = {m.layer_name: m for m in model.modules() if isinstance(m, Attention)}
    return runner.get_kv_cache_spec()


def kv_cache_config_for(vllm_config: VllmConfig, kv_cache_bytes: int) -> KVCacheConfig:
    """The engine's KV cache layout for this model in `kv_cache_bytes`."""
    (kv_cache_config,) = get_kv_cache_configs(
        vllm_config, [model_kv_cache_spec(vllm_config)], [kv_cache_bytes]
    )
    return kv_cache_config


def bytes_per_block(kv_cache_config: KVCacheConfig) -> int:
    """A block id names a page in every tensor: its bytes over all of them."""
    return sum(tensor.size for tensor in kv_cache_config.kv_cache_tensors) // kv_cache_config.num_blocks


def blocks_held(scheduler: Scheduler, request_id: str) -> int:
    """Real blocks (not the null block) the request holds, over all KV cache groups."""
    blocks = scheduler.kv_cache_manager.get_blocks(request_id).blocks
    return sum(not block.is_null for group in blocks for block in group)


def predicted_blocks(
    kv_cache_config: KVCacheConfig, context_len: int, computed_before: int | None = None
) -> int:
    """Blocks one request holds after a step took it from `computed_before` (default: one token
    less, a decode) to `context_len` computed tokens.

    Full attention: a block per `block_size` tokens. A window of w: the step began by dropping
    the blocks wholly before key `computed_before - w + 1`, the oldest its first query read;
    after a decode that leaves ceil((w - 1) / block_size) + 1 blocks at most (a window rarely
    starts on a block boundary), after a prefill chunk every block of the chunk too, until the
    next step drops them.
    """
    if computed_before is None:
        computed_before = context_len - 1
    total = 0
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        total += -(-context_len // spec.block_size)
        if isinstance(spec, SlidingWindowSpec):
            total -= max(computed_before - spec.sliding_window + 1, 0) // spec.block_size  # dropped
    return total


@dataclass(slots=True)
class Admission:
    """What the scheduler did with `num_requests` identical requests in a fixed cache."""

    peak_running: int  # most requests holding KV at once
    preemptions: int
    steps: int


def admit_until_full(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    num_requests: int,
    prompt_len: int,
    output_len: int,
) -> Admission:
    """Run `num_requests` requests (distinct prompts, `output_len` tokens each) through the real
    scheduler; the stand-in model samples `FIXED_TOKEN_ID` whenever a request reaches its end."""
    scheduler = Scheduler(vllm_config, kv_cache_config)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    requests = [
        Request(str(i), [(i * 7919 + j) % 30000 + 3 for j in range(prompt_len)], params, eos_token_id=None)
        for i in range(num_requests)
    ]
    for request in requests:
        scheduler.add_request(request)
    peak, steps = 0, 0
    while scheduler.has_unfinished_requests():
        scheduler_output = scheduler.schedule()
        steps += 1
        peak = max(peak, len(scheduler.running))
        req_ids = list(scheduler_output.num_scheduled_tokens)
        # schedule() has advanced num_computed_tokens: a request at its end samples.
        sampled = [
            [FIXED_TOKEN_ID] if (r := scheduler.requests[req_id]).num_computed_tokens >= r.num_tokens else []
            for req_id in req_ids
        ]
        scheduler.update_from_output(
            scheduler_output, ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)
        )
    return Admission(peak, sum(r.num_preemptions for r in requests), steps)


def write_mini_gemma3(path: str, num_layers: int = 12, sliding_window: int = 512) -> str:
    """Write the config (no weights: load it with `load_format="dummy"`) of a Gemma 3 of tiny width
    with Gemma 3's layer pattern (every sixth layer global) and window; return `path`.

    Small enough for a CPU to generate thousands of tokens; its KV cache groups are those of
    the real models, only narrower: 1 KV head of 64, so 512 bytes per token per layer in float32.
    """
    import transformers

    config = transformers.Gemma3TextConfig(
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        query_pre_attn_scalar=64,
        sliding_window=sliding_window,
        max_position_embeddings=32_768,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )
    config.architectures = ["Gemma3ForCausalLM"]
    config.save_pretrained(path)
    return path
