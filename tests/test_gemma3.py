"""Gemma 3 through the hybrid KV cache (chapter 12): greedy tokens equal transformers' exactly.

The oracle is transformers' own Gemma3ForCausalLM in float32 on tiny random checkpoints
saved to disk (tests/helpers/checkpoints.py::make_tiny_checkpoint): logits position by position, and
`generate(do_sample=False)` one prompt at a time. nano_v1 loads the same files and runs
the prompts as one batch with a 24-token window, shorter than most prompts and than the
outputs, under settings that move the window across block and chunk boundaries, hit the
prefix cache, preempt, run the Triton kernel (interpreted) and compile the model.
"""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
import torch
from helpers.checkpoints import make_tiny_checkpoint
from helpers.compilation import FakeCUDAGraphWrapper, engine_with_fake_graphs, run_greedy
from helpers.generation import hf_greedy, nano_greedy
from helpers.kv_cache import expected_hybrid_hit
from helpers.model import PagedRunner, load_model

from nano_v1 import LLM, SamplingParams
from nano_v1.config import CUDAGraphMode
from nano_v1.core.kv_cache_utils import get_request_block_hasher
from nano_v1.core.sched.scheduler import Scheduler
from nano_v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from nano_v1.request import Request

pytestmark = pytest.mark.ch12

MAX_NEW = 32  # longer than the window


def gemma3_prompts(seed: int, lengths=(2, 23, 30, 70)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("gemma3"), "gemma3")


@pytest.fixture(scope="module")
def hf_reference(tiny_gemma3):
    prompts = gemma3_prompts(0)
    return tiny_gemma3, prompts, hf_greedy(tiny_gemma3, prompts, MAX_NEW)


def engine_core(llm: LLM):
    return llm.llm_engine.engine_core.engine_core


def test_logits_match_transformers_position_by_position(tiny_gemma3):
    """Prefill chunks and paged decodes, the window applied by the kernel: every row's logits."""
    model = load_model(tiny_gemma3, dtype="float32")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_gemma3, dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 512, n).tolist() for n in (40, 7, 60)]
    runner = PagedRunner(model, num_reqs=len(prompts))
    # Step 0: prompts 0 and 1 whole, the first 30 tokens of 2; step 1: the rest of 2 beside two decodes.
    first = runner.step([0, 1, 2], [prompts[0], prompts[1], prompts[2][:30]], [0, 0, 0])
    second = runner.step([2, 0, 1], [prompts[2][30:], [5], [6]], [30, 40, 7])
    with torch.no_grad():
        expected = [hf(torch.tensor([p + extra])).logits[0] for p, extra in zip(prompts, ([5], [6], []))]
    torch.testing.assert_close(first[:40], expected[0][:40], atol=1e-4, rtol=0)
    torch.testing.assert_close(first[40:47], expected[1][:7], atol=1e-4, rtol=0)
    torch.testing.assert_close(first[47:], expected[2][:30], atol=1e-4, rtol=0)
    torch.testing.assert_close(second[:30], expected[2][30:], atol=1e-4, rtol=0)
    torch.testing.assert_close(second[30:31], expected[0][40:41], atol=1e-4, rtol=0)
    torch.testing.assert_close(second[31:], expected[1][7:8], atol=1e-4, rtol=0)


def test_layers_form_hybrid_groups_with_one_shared_pool(hf_reference):
    path, prompts, expected = hf_reference
    got, _ = nano_greedy(path, prompts, MAX_NEW)
    assert got == expected
    llm = LLM(model=path, dtype="float32", max_model_len=512)
    config = engine_core(llm).scheduler.kv_cache_config
    assert [g.layer_names for g in config.kv_cache_groups] == [
        ["model.layers.0.self_attn.attn", "model.layers.3.self_attn.attn"],
        ["model.layers.1.self_attn.attn"],
        ["model.layers.2.self_attn.attn", "model.layers.4.self_attn.attn"],
    ]
    assert [type(g.kv_cache_spec) for g in config.kv_cache_groups] == [
        SlidingWindowSpec, SlidingWindowSpec, FullAttentionSpec
    ]  # fmt: skip
    # Two tensors: layer i of every group shares tensor i (layer 1's group pads the second).
    assert [t.shared_by for t in config.kv_cache_tensors] == [
        ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn", "model.layers.2.self_attn.attn"],
        ["model.layers.3.self_attn.attn", "model.layers.4.self_attn.attn"],
    ]
    runner = engine_core(llm).model_executor.driver_worker.model_runner
    layers = runner.attn_layers
    assert (
        layers["model.layers.0.self_attn.attn"].kv_cache.data_ptr()
        == layers["model.layers.2.self_attn.attn"].kv_cache.data_ptr()
    )
    assert len(runner.input_batch.block_table.block_tables) == 3


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(block_size=4, max_num_batched_tokens=16),  # chunks of 16 cross the 24-token window and blocks
        dict(block_size=16, max_num_batched_tokens=40, long_prefill_token_threshold=13),
        dict(block_size=8, disable_hybrid_kv_cache_manager=True),  # every layer keeps every token
    ],
    ids=["chunked-block4", "threshold13-block16", "hybrid-off"],
)
def test_greedy_tokens_equal_transformers(hf_reference, engine_args):
    path, prompts, expected = hf_reference
    got, _ = nano_greedy(path, prompts, MAX_NEW, **engine_args)
    assert got == expected


def test_the_window_matters(hf_reference, tmp_path):
    """The same weights with no window give other tokens: the tests above do test the window."""
    path, prompts, expected = hf_reference
    shutil.copytree(path, tmp_path / "wide", dirs_exist_ok=True)
    config = json.loads((tmp_path / "wide" / "config.json").read_text())
    config["sliding_window"] = 1024
    (tmp_path / "wide" / "config.json").write_text(json.dumps(config))
    got, _ = nano_greedy(str(tmp_path / "wide"), prompts, MAX_NEW)
    assert got != expected


def test_small_cache_preempts_and_still_matches(hf_reference, monkeypatch):
    path, prompts, expected = hf_reference
    preempted = []
    original = Scheduler._preempt
    monkeypatch.setattr(
        Scheduler, "_preempt", lambda self, req: (preempted.append(req.request_id), original(self, req))
    )
    # One request of 128 tokens needs 16 full-attention blocks + 2 x (ceil((23 + 32) / 8) + 1) = 32:
    # 32 usable blocks hold it, not all four prompts at once.
    got, _ = nano_greedy(
        path,
        prompts,
        MAX_NEW,
        block_size=8,
        max_model_len=128,
        max_num_batched_tokens=32,
        num_gpu_blocks_override=33,
    )
    assert preempted, "the cache was meant to be too small for the batch"
    assert got == expected


def test_prefix_cache_hits_have_the_rules_length(tiny_gemma3):
    prompts = gemma3_prompts(1, lengths=(50, 77))
    shared = prompts[0][:40]
    prompts.append(shared + gemma3_prompts(2, lengths=(20,))[0])  # shares 40 tokens with the first
    expected = hf_greedy(tiny_gemma3, prompts, 8)
    llm = LLM(
        model=tiny_gemma3,
        dtype="float32",
        block_size=8,
        max_num_batched_tokens=32,
        num_gpu_blocks_override=90,
        max_model_len=200,
    )
    params = SamplingParams(temperature=0.0, max_tokens=8)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    manager = engine_core(llm).scheduler.kv_cache_manager
    hasher = get_request_block_hasher(8)
    for prompt, tokens in zip(prompts, expected):
        probe = Request("probe", prompt, params, None, block_hasher=hasher)
        rule = expected_hybrid_hit(manager, probe)
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        assert out.outputs[0].token_ids == tokens
        # Whole blocks short of the last token; the windows' blocks before theirs come back null.
        assert out.num_cached_tokens == rule == (len(prompt) - 1) // 8 * 8


@pytest.mark.slow
def test_triton_backend_in_the_interpreter(hf_reference):
    path, prompts, expected = hf_reference
    # A 30-token prompt: the window already slides inside the prefill and through every decode.
    got, _ = nano_greedy(path, prompts[2:3], 12, attention_backend="TRITON_ATTN", block_size=16)
    assert got == [expected[2][:12]]


@pytest.mark.slow
def test_gemma_pattern_of_five_to_one(tmp_path):
    """Real Gemma 3's layer pattern (every sixth layer global): six groups of one layer, one tensor."""
    path = make_tiny_checkpoint(tmp_path / "g", "gemma3", num_hidden_layers=6, layer_types=None)
    prompts = gemma3_prompts(3, lengths=(40,))
    expected = hf_greedy(path, prompts, 24)
    got, _ = nano_greedy(path, prompts, 24, block_size=4, max_num_batched_tokens=16)
    assert got == expected
    llm = LLM(model=path, dtype="float32", max_model_len=64)
    config = engine_core(llm).scheduler.kv_cache_config
    assert len(config.kv_cache_groups) == 6 and len(config.kv_cache_tensors) == 1


def test_piecewise_graphs_with_hybrid_groups(hf_reference, monkeypatch):
    path, prompts, expected = hf_reference
    engine = engine_with_fake_graphs(path, CUDAGraphMode.PIECEWISE, [1, 2, 4, 8], monkeypatch)
    got = run_greedy(engine, prompts, [MAX_NEW] * len(prompts))
    assert [got[f"r{i}"] for i in range(len(prompts))] == expected
    assert any(kind == "replay" for kind, _, _ in FakeCUDAGraphWrapper.events)


@pytest.mark.slow
def test_full_decode_graphs_with_hybrid_groups(hf_reference, monkeypatch):
    """FULL graphs hold attention: each group's padded metadata, through the Triton kernel."""
    path, prompts, expected = hf_reference
    engine = engine_with_fake_graphs(
        path, CUDAGraphMode.FULL_AND_PIECEWISE, [1], monkeypatch, attention_backend="TRITON_ATTN"
    )
    got = run_greedy(engine, prompts[2:3], [8])
    assert got["r0"] == expected[2][:8]
    assert any(mode == "FULL" and kind == "replay" for kind, mode, _ in FakeCUDAGraphWrapper.events)


def test_unsupported_gemma3_configs_are_clear_errors(tmp_path):
    make_tiny_checkpoint(tmp_path / "g", "gemma3")
    for key, value, message in [
        ("final_logit_softcapping", 30.0, "final_logit_softcapping"),
        ("use_bidirectional_attention", True, "use_bidirectional_attention"),
    ]:
        config = json.loads((tmp_path / "g" / "config.json").read_text())
        (tmp_path / "bad").mkdir(exist_ok=True)
        shutil.copy(tmp_path / "g" / "model.safetensors", tmp_path / "bad" / "model.safetensors")
        (tmp_path / "bad" / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(ValueError, match=message):
            load_model(str(tmp_path / "bad"))
