"""Roofline: the bytes a step must move and the FLOPs it must compute, and the time floor they set.

Mirrors no single vLLM file: it is the arithmetic behind the numbers of vllm/benchmarks/
(chapter 00).

Why it exists: "12,000 tokens/s" says nothing until it is set against what the device
could do. A step of a decoder reads every weight once, reads the KV cache of every
context it attends over, writes the KV of its new tokens, and does two FLOPs per weight
per token plus attention. Divide the bytes by the memory bandwidth and the FLOPs by the
matmul rate: the larger of the two is a time no implementation can beat, and every GPU
figure in this repository is reported as a fraction of it. Decode steps (one token per
request) read 1-2 GB of weights to do a few GFLOPs: memory bound. A prefill chunk of
thousands of tokens reuses each weight thousands of times: compute bound.

The ceilings are measured, not taken from a datasheet: a large device-to-device copy
(bandwidth) and a large matmul (FLOP rate), in `measure_device_ceilings`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Bytes per float32 logit: the LM head's output is upcast for the sampler.
LOGIT_BYTES = 4


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The shapes of a Llama-family decoder (Llama, Qwen2, Qwen3) that decide its cost."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    qk_norm: bool  # Qwen3: an RMSNorm over each query and key head
    qkv_bias: bool  # Qwen2: biased q/k/v projections

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """From a config.json dict, a transformers config, or a nano_v1 `ModelConfig`."""
        config = getattr(config, "hf_config", config)
        get = config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)
        num_heads = get("num_attention_heads")
        model_type = get("model_type")
        return cls(
            num_layers=get("num_hidden_layers"),
            hidden_size=get("hidden_size"),
            num_heads=num_heads,
            num_kv_heads=get("num_key_value_heads") or num_heads,
            head_dim=get("head_dim") or get("hidden_size") // num_heads,
            intermediate_size=get("intermediate_size"),
            vocab_size=get("vocab_size"),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            qk_norm=model_type == "qwen3",
            qkv_bias=model_type == "qwen2" or bool(get("attention_bias", False)),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelShape:
        """From the `config.json` of a checkpoint directory (no weights needed)."""
        return cls.from_config(json.loads((Path(model_dir) / "config.json").read_text()))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def matmul_params_per_layer(self) -> int:
        """Weights of one layer's matmuls: each is read once per step and used twice per token (mul + add)."""
        h, i = self.hidden_size, self.intermediate_size
        qkv_proj = h * (self.q_size + 2 * self.kv_size)  # hidden -> q, k, v (fused)
        o_proj = self.q_size * h  # attention output -> hidden
        gate_up_proj = h * 2 * i  # hidden -> gate, up (fused)
        down_proj = i * h  # intermediate -> hidden
        return qkv_proj + o_proj + gate_up_proj + down_proj

    @property
    def params_per_layer(self) -> int:
        """Every parameter of one layer: matmuls, the two RMSNorms, Qwen3's q/k norms, Qwen2's biases."""
        norms = 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)
        biases = self.q_size + 2 * self.kv_size if self.qkv_bias else 0
        return self.matmul_params_per_layer + norms + biases

    @property
    def num_params(self) -> int:
        """All parameters, a tied LM head counted once (as `model.parameters()` does)."""
        embedding = self.vocab_size * self.hidden_size
        lm_head = 0 if self.tie_word_embeddings else embedding
        return self.num_layers * self.params_per_layer + self.hidden_size + embedding + lm_head

    @property
    def weights_read_per_step(self) -> int:
        """Parameters a step reads in full: all but an untied embedding table, of which only rows are gathered."""
        untied_embedding = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.num_params - untied_embedding

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """One token's K and V, in every layer: 2 x layers x kv_heads x head_dim x bytes (112 KiB for Qwen3-0.6B)."""
        return 2 * self.num_layers * self.kv_size * dtype_bytes


@dataclass(frozen=True, slots=True)
class DeviceCeilings:
    """What a device can do at best: memory bandwidth (bytes/s) and dense matmul rate (FLOP/s) in `dtype`."""

    device: str
    memory_bandwidth: float
    matmul_flops: float
    dtype: str

    def to_dict(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self),
            "memory_bandwidth_GBps": self.memory_bandwidth / 1e9,
            "matmul_TFLOPs": self.matmul_flops / 1e12,
        }


# The H200's datasheet figures (HBM3e; dense bf16 without sparsity), for comparison with what we measure.
H200_DATASHEET = DeviceCeilings("NVIDIA H200 (datasheet)", memory_bandwidth=4.8e12, matmul_flops=989e12, dtype="bfloat16")


@dataclass(frozen=True, slots=True)
class Cost:
    """Bytes and FLOPs of some steps of the model (one step unless `num_steps` says otherwise)."""

    num_steps: int
    num_tokens: int  # query tokens computed
    num_logits: int  # rows that go through the LM head (one per request per step)
    weight_bytes: int
    kv_read_bytes: int
    kv_write_bytes: int
    activation_bytes: int
    matmul_flops: int
    attention_flops: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes + self.activation_bytes

    @property
    def total_flops(self) -> int:
        return self.matmul_flops + self.attention_flops

    @property
    def arithmetic_intensity(self) -> float:
        """FLOPs per byte moved; above the device's `matmul_flops / memory_bandwidth` the step is compute bound."""
        return self.total_flops / self.total_bytes

    def memory_time(self, ceilings: DeviceCeilings) -> float:
        return self.total_bytes / ceilings.memory_bandwidth

    def compute_time(self, ceilings: DeviceCeilings) -> float:
        return self.total_flops / ceilings.matmul_flops

    def time_floor(self, ceilings: DeviceCeilings) -> float:
        """Seconds no implementation can beat on this device: max(bytes / bandwidth, FLOPs / rate)."""
        return max(self.memory_time(ceilings), self.compute_time(ceilings))

    def bound(self, ceilings: DeviceCeilings) -> str:
        return "memory" if self.memory_time(ceilings) >= self.compute_time(ceilings) else "compute"

    def summary(self, ceilings: DeviceCeilings | None = None) -> dict[str, Any]:
        """The counts, and with ceilings the floor in seconds and which resource sets it."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out.update(total_bytes=self.total_bytes, total_flops=self.total_flops,
                   arithmetic_intensity=self.arithmetic_intensity)
        if ceilings is not None:
            out.update(time_floor_s=self.time_floor(ceilings), bound=self.bound(ceilings))
        return out


def step_cost(
    shape: ModelShape,
    query_lens: Sequence[int] | np.ndarray,
    seq_lens: Sequence[int] | np.ndarray,
    dtype_bytes: int = 2,
) -> Cost:
    """The cost of one step that runs `query_lens[r]` new tokens of request r, ending at context `seq_lens[r]`.

    A decode step is `query_lens = [1, 1, ...]`; a prefill chunk of a 300-token prompt
    that starts at token 100 is `query_lens = [300]`, `seq_lens = [400]`. Each request
    samples one token, so the LM head runs once per request. Counts are the minimum any
    implementation must do: each byte read once, masked attention scores not computed.
    """
    q = np.asarray(query_lens, dtype=np.int64)
    s = np.asarray(seq_lens, dtype=np.int64)
    if q.shape != s.shape or q.ndim != 1 or len(q) == 0:
        raise ValueError(f"query_lens and seq_lens must be equal-length, non-empty 1-D, got {q.shape} and {s.shape}.")
    if (q < 1).any() or (s < q).any():
        raise ValueError("every request needs query_len >= 1 and seq_len >= query_len.")
    num_tokens, num_logits = int(q.sum()), len(q)
    L, h, i, b = shape.num_layers, shape.hidden_size, shape.intermediate_size, dtype_bytes

    # Weights: read once per step, whatever the batch (the point of batching).
    weight_bytes = shape.weights_read_per_step * b
    # KV cache: each new token's K and V are written once; attention then reads the whole
    # context of each request (the new tokens included), once per layer.
    kv_per_token = shape.kv_bytes_per_token(b)
    kv_write_bytes = num_tokens * kv_per_token
    kv_read_bytes = int(s.sum()) * kv_per_token
    # Activations, per token per layer: each matmul reads its input and writes its output
    # (elementwise ops such as norms, RoPE and SiLU assumed fused into a neighbour):
    #   qkv_proj h -> q+2kv, attention q -> q, o_proj q -> h, gate_up_proj h -> 2i, down_proj i -> h.
    per_token_per_layer = (h + shape.q_size + 2 * shape.kv_size) + 2 * shape.q_size + (shape.q_size + h) \
        + (h + 2 * i) + (i + h)
    # Plus the embedding row gathered per token, and the LM head's input row and float32 logits per request.
    activation_bytes = (num_tokens * (L * per_token_per_layer + h) + num_logits * h) * b \
        + num_logits * shape.vocab_size * LOGIT_BYTES

    # Matmuls: 2 FLOPs (multiply, add) per weight per token; the LM head only for sampled rows.
    matmul_flops = 2 * num_tokens * L * shape.matmul_params_per_layer + 2 * num_logits * h * shape.vocab_size
    # Attention: a query at position p (0-based) scores p + 1 keys (causal), QK^T and PV each
    # 2 x head_dim FLOPs per key per head. A chunk of q queries ending at context s scores
    # sum_{p=s-q}^{s-1} (p + 1) = q * s - q * (q - 1) / 2 keys.
    keys_scored = int((q * s - q * (q - 1) // 2).sum())
    attention_flops = 4 * L * shape.num_heads * shape.head_dim * keys_scored

    return Cost(
        num_steps=1,
        num_tokens=num_tokens,
        num_logits=num_logits,
        weight_bytes=weight_bytes,
        kv_read_bytes=kv_read_bytes,
        kv_write_bytes=kv_write_bytes,
        activation_bytes=activation_bytes,
        matmul_flops=matmul_flops,
        attention_flops=attention_flops,
    )


def decode_step_cost(shape: ModelShape, batch_size: int, context_len: int, dtype_bytes: int = 2) -> Cost:
    """One decode step: `batch_size` requests, each one new token at context `context_len`."""
    return step_cost(shape, np.ones(batch_size, np.int64), np.full(batch_size, context_len, np.int64), dtype_bytes)


def workload_cost(
    shape: ModelShape,
    prompt_lens: Sequence[int],
    output_lens: Sequence[int],
    max_num_batched_tokens: int,
    dtype_bytes: int = 2,
) -> Cost:
    """A whole offline workload: each prompt prefilled in one chunk, then one decode step per output token.

    Everything but the weights adds up per token, whatever the schedule, so the workload
    is one big "step" over every chunk any step runs. The weights are read once per step,
    and no schedule has fewer steps than the longest output (one token per request per
    step) or than the tokens divided by the step budget: that minimum is used.
    """
    p = np.asarray(prompt_lens, dtype=np.int64)
    o = np.asarray(output_lens, dtype=np.int64)
    if p.shape != o.shape or (p < 1).any() or (o < 1).any():
        raise ValueError("prompt_lens and output_lens must be equal-length and all >= 1.")
    # Request r: one prefill chunk (query p, context p) samples its first token; its other
    # o - 1 tokens each come from a decode step at context p + 1, ..., p + o - 1.
    num_decode = o - 1
    owner = np.repeat(np.arange(len(p)), num_decode)  # [total decode steps]
    k = np.arange(len(owner)) - np.repeat(np.cumsum(num_decode) - num_decode, num_decode) + 1  # 1 .. o_r - 1
    query_lens = np.concatenate([p, np.ones(len(owner), np.int64)])
    seq_lens = np.concatenate([p, p[owner] + k])
    cost = step_cost(shape, query_lens, seq_lens, dtype_bytes)
    num_steps = max(int(o.max()), math.ceil(cost.num_tokens / max_num_batched_tokens))
    return dataclasses.replace(cost, num_steps=num_steps, weight_bytes=cost.weight_bytes * num_steps)


# ---------------------------------------------------------------------------- measured ceilings
def best_time(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Fastest of `repeats` timed calls, in seconds (CUDA events on a GPU, so only device time counts)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return min(times)


def _copy_seconds(num_bytes: int, device: torch.device, repeats: int) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return best_time(lambda: dst.copy_(src), device, repeats)


def _matmul_seconds(n: int, dtype: torch.dtype, device: torch.device, repeats: int) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return best_time(lambda: torch.mm(a, b), device, repeats)


def measure_device_ceilings(
    device: str | torch.device, dtype: torch.dtype | None = None, smoke: bool = False
) -> DeviceCeilings:
    """Measure memory bandwidth with a large device-to-device copy and the matmul rate with a large matmul.

    GPU: a 2 GiB copy (it reads and writes, so 4 GiB move) and an 8192^3 bf16 matmul
    (1.1 TFLOP), each the best of 10, about a second in all. CPU: 256 MiB and 2048^3 in
    float32. `smoke` shrinks both to seconds-on-any-machine sizes, for tests.
    """
    device = torch.device(device)
    on_gpu = device.type == "cuda"
    dtype = dtype or (torch.bfloat16 if on_gpu else torch.float32)
    copy_bytes = (64 << 20 if smoke else 2 << 30) if on_gpu else (16 << 20 if smoke else 256 << 20)
    n = (1024 if smoke else 8192) if on_gpu else (256 if smoke else 2048)
    repeats = 3 if smoke else 10

    copy_s = _copy_seconds(copy_bytes, device, repeats)
    matmul_s = _matmul_seconds(n, dtype, device, repeats)
    name = torch.cuda.get_device_name(device) if on_gpu else "cpu"
    return DeviceCeilings(
        device=name,
        memory_bandwidth=2 * copy_bytes / copy_s,  # every byte is read once and written once
        matmul_flops=2 * n**3 / matmul_s,
        dtype=str(dtype).removeprefix("torch."),
    )
