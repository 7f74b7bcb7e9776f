"""The roofline's counts against brute force: real modules' parameters, torch's FLOP counter, explicit schedules.

Oracles: `numel` over the parameters of nano_v1's own models (weights), the model runner's
KV page size (KV bytes), `torch.utils.flop_counter` over transformers' eager Qwen3 (FLOPs),
and a per-request Python loop (the vectorised workload sum).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from helpers.checkpoints import make_tiny_checkpoint, make_vllm_config
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from nano_v1.benchmarks.roofline import (
    H200_DATASHEET,
    ModelShape,
    decode_step_cost,
    measure_device_ceilings,
    step_cost,
    workload_cost,
)
from nano_v1.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from nano_v1.model_executor.model_loader import get_model
from nano_v1.worker.gpu_model_runner import GPUModelRunner

pytestmark = pytest.mark.ch01

QWEN3_0_6B = ModelShape(28, 1024, 16, 8, 128, 3072, 151936, tie_word_embeddings=True, qk_norm=True, qkv_bias=False)


@pytest.fixture(scope="module", params=[("qwen3", True), ("qwen3", False), ("qwen2", False), ("llama", True)])
def tiny_engine_config(request, tmp_path_factory):
    arch, tied = request.param
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(arch), arch, tie_word_embeddings=tied)
    return make_vllm_config(path, load_format="dummy", max_model_len=256)


def test_shipped_configs_have_the_published_shapes():
    from benchmarks.context import CONFIGS_DIR

    assert ModelShape.from_pretrained(CONFIGS_DIR / "qwen3-0.6b") == QWEN3_0_6B
    shape_4b = ModelShape.from_pretrained(CONFIGS_DIR / "qwen3-4b")
    assert (shape_4b.num_layers, shape_4b.hidden_size, shape_4b.num_heads, shape_4b.num_kv_heads) == (36, 2560, 32, 8)
    # Published sizes: 0.6B (596M with the tied embedding) and 4.0B.
    assert QWEN3_0_6B.num_params == 596_049_920
    assert round(shape_4b.num_params / 1e9, 2) == 4.02
    assert QWEN3_0_6B.kv_bytes_per_token(2) == 112 * 1024


def test_weight_counts_match_the_parameters_of_nano_v1_models(tiny_engine_config):
    model_config = tiny_engine_config.model_config
    shape = ModelShape.from_config(model_config)
    model = get_model(tiny_engine_config, torch.device("cpu"))
    params = list(model.parameters())  # a tied head appears once
    assert sum(p.numel() for p in params) == shape.num_params
    linear_types = (QKVParallelLinear, MergedColumnParallelLinear, RowParallelLinear)
    matmul_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, linear_types))
    assert matmul_weights == shape.num_layers * shape.matmul_params_per_layer
    # A step reads every parameter but the rows of an untied embedding it does not gather.
    embedding = model.model.embed_tokens.weight.numel()
    tied = model_config.hf_config.tie_word_embeddings
    assert shape.weights_read_per_step == shape.num_params - (0 if tied else embedding)
    cost = step_cost(shape, [1], [10], dtype_bytes=4)
    assert cost.weight_bytes == sum(p.numel() * p.element_size() for p in params) - (0 if tied else embedding * 4)


def test_kv_bytes_match_the_model_runners_page_size(tiny_engine_config):
    runner = GPUModelRunner(tiny_engine_config, torch.device("cpu"))
    runner.load_model()
    shape = ModelShape.from_config(tiny_engine_config.model_config)
    block_size = tiny_engine_config.cache_config.block_size
    page_size = sum(spec.page_size_bytes for spec in runner.get_kv_cache_spec().values())  # all layers
    assert page_size == shape.kv_bytes_per_token(runner.dtype.itemsize) * block_size
    # Decode: one new token per request is written; each request's whole context is read.
    cost = step_cost(shape, [1, 1, 1], [5, 9, 20], dtype_bytes=4)
    assert cost.kv_write_bytes == 3 * shape.kv_bytes_per_token(4)
    assert cost.kv_read_bytes == 34 * shape.kv_bytes_per_token(4)


@pytest.fixture(scope="module")
def hf_qwen3(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("hf_qwen3"), "qwen3")
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    return model, ModelShape.from_config(model.config)


def _counted_flops(fn) -> int:
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        fn()
    return counter.get_total_flops()


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_decode_flops_match_torch_flop_counter(hf_qwen3):
    model, shape = hf_qwen3
    context = 37
    ids = torch.randint(0, shape.vocab_size, (1, context))
    with torch.no_grad():
        past = model(ids[:, :-1], use_cache=True).past_key_values
    counted = _counted_flops(lambda: model(ids[:, -1:], past_key_values=past, use_cache=True))
    cost = step_cost(shape, [1], [context], dtype_bytes=4)
    assert counted == cost.total_flops


def test_prefill_flops_match_torch_flop_counter(hf_qwen3):
    model, shape = hf_qwen3
    T = 23
    counted = _counted_flops(lambda: model(torch.randint(0, shape.vocab_size, (1, T)), logits_to_keep=1))
    cost = step_cost(shape, [T], [T], dtype_bytes=4)
    # Eager attention computes the whole T x T score matrix and masks it; the roofline counts
    # only the T (T + 1) / 2 causal scores that matter.
    full_square = 4 * shape.num_layers * shape.num_heads * shape.head_dim * T * T
    assert cost.attention_flops == 4 * shape.num_layers * shape.num_heads * shape.head_dim * T * (T + 1) // 2
    assert counted == cost.matmul_flops + full_square


def test_decode_is_memory_bound_and_long_prefill_compute_bound():
    for batch_size in (1, 16, 256):
        decode = decode_step_cost(QWEN3_0_6B, batch_size, 512)
        assert decode.bound(H200_DATASHEET) == "memory"
        assert decode.arithmetic_intensity < H200_DATASHEET.matmul_flops / H200_DATASHEET.memory_bandwidth
    prefill = step_cost(QWEN3_0_6B, [8192], [8192])
    assert prefill.bound(H200_DATASHEET) == "compute"
    # Batching decode is nearly free while weights dominate: 16x the tokens, < 2x the time.
    assert decode_step_cost(QWEN3_0_6B, 16, 512).time_floor(H200_DATASHEET) < \
        2 * decode_step_cost(QWEN3_0_6B, 1, 512).time_floor(H200_DATASHEET)


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(1, 300), st.integers(0, 300)), min_size=1, max_size=8),
    grow=st.integers(0, 7),
    extra=st.integers(1, 50),
)
def test_time_floor_never_drops_when_work_is_added(lens, grow, extra):
    query_lens = np.array([q for q, _ in lens])
    seq_lens = query_lens + np.array([c for _, c in lens])
    base = step_cost(QWEN3_0_6B, query_lens, seq_lens).time_floor(H200_DATASHEET)
    longer = seq_lens.copy()
    longer[grow % len(lens)] += extra  # a longer context
    assert step_cost(QWEN3_0_6B, query_lens, longer).time_floor(H200_DATASHEET) >= base
    more = step_cost(QWEN3_0_6B, np.append(query_lens, 1), np.append(seq_lens, extra))  # one more request
    assert more.time_floor(H200_DATASHEET) >= base


def test_workload_cost_is_the_sum_of_its_steps():
    prompt_lens, output_lens = [5, 12, 3], [4, 1, 7]
    total = None
    for p, o in zip(prompt_lens, output_lens):
        # One request: its prefill, then one decode step per further output token.
        for q, s in [(p, p)] + [(1, p + k) for k in range(1, o)]:
            c = step_cost(QWEN3_0_6B, [q], [s])
            total = c if total is None else dataclasses.replace(
                total, **{f.name: getattr(total, f.name) + getattr(c, f.name) for f in dataclasses.fields(c)}
            )
    cost = workload_cost(QWEN3_0_6B, prompt_lens, output_lens, max_num_batched_tokens=8)
    # At least max(outputs) = 7 steps, and 32 tokens / 8 per step = 4: 7 steps read the weights.
    assert cost.num_steps == 7
    assert cost.weight_bytes == 7 * step_cost(QWEN3_0_6B, [1], [1]).weight_bytes
    for name in ("num_tokens", "num_logits", "kv_read_bytes", "kv_write_bytes", "activation_bytes",
                 "matmul_flops", "attention_flops"):
        assert getattr(cost, name) == getattr(total, name), name


def test_bad_lengths_are_rejected():
    with pytest.raises(ValueError, match="seq_len >= query_len"):
        step_cost(QWEN3_0_6B, [5], [4])
    with pytest.raises(ValueError, match="equal-length"):
        step_cost(QWEN3_0_6B, [1, 1], [4])
    with pytest.raises(ValueError, match=">= 1"):
        workload_cost(QWEN3_0_6B, [3], [0], 8)


def test_measured_cpu_ceilings_are_positive_and_labelled():
    ceilings = measure_device_ceilings("cpu", smoke=True)
    assert ceilings.memory_bandwidth > 1e6 and ceilings.matmul_flops > 1e6
    assert ceilings.device == "cpu" and ceilings.dtype == "float32"
    assert ceilings.to_dict()["memory_bandwidth_GBps"] == ceilings.memory_bandwidth / 1e9


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_measured_gpu_ceilings_are_plausible():
    ceilings = measure_device_ceilings("cuda")
    # Any datacenter GPU of the last years: > 500 GB/s and > 50 bf16 TFLOP/s; none beats 10 TB/s or 5 PFLOP/s.
    assert 5e11 < ceilings.memory_bandwidth < 1e13
    assert 5e13 < ceilings.matmul_flops < 5e15
