"""Piecewise compilation and CUDA graphs (chapter 08).

On the CPU: the split of a real model (tiny Qwen3) into its pieces, the split module
against the unsplit model, one Dynamo trace for every batch size, the capture-size ladder
and padding, and greedy parity with transformers with compilation on. Capture and replay
run through a fake graph wrapper that records what it was asked to capture and replay and
checks, as a real graph needs, that every replay reads its inputs from the addresses of
its capture. On a GPU (`gpu`): real graphs against eager execution.
"""

from __future__ import annotations

import gc

import pytest
import torch
from helpers.checkpoints import make_vllm_config
from helpers.compilation import FakeCUDAGraphWrapper, engine_with_fake_graphs, run_greedy
from helpers.generation import hf_greedy, make_prompts

from nano_v1 import LLM, SamplingParams
from nano_v1.compilation.backends import split_graph
from nano_v1.compilation.counter import compilation_counter
from nano_v1.config import CompilationConfig, CompilationLevel, CUDAGraphMode
from nano_v1.forward_context import BatchDescriptor, set_forward_context
from nano_v1.worker.gpu_model_runner import GPUModelRunner

pytestmark = pytest.mark.ch08

ATTENTION_OP = "nano_v1.unified_attention_with_output"
MAX_NEW = 12


def runner_of(llm: LLM) -> GPUModelRunner:
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner


@pytest.fixture(scope="module")
def prompts_and_expected(tiny_qwen3):
    prompts = make_prompts(0)
    return prompts, hf_greedy(tiny_qwen3, prompts, MAX_NEW)


@pytest.fixture(scope="module")
def compiled_llm(tiny_qwen3):
    """The tiny Qwen3 with piecewise compilation on the CPU (no graphs): traced once, shared."""
    before = compilation_counter.clone()
    llm = LLM(tiny_qwen3, dtype="float32", device="cpu", compilation_config={"level": 3})
    assert compilation_counter.num_graphs_seen == before.num_graphs_seen + 1
    return llm


@pytest.mark.slow
def test_a_process_compiles_more_engines_than_dynamos_recompile_limit(tiny_qwen3):
    # Each engine adds an entry to Dynamo's cache of the model class's forward; past the
    # limit (8 by default, 2 here to keep the test short) fullgraph=True would raise.
    # (`config.patch`, not monkeypatch: monkeypatch's undo deletes a Dynamo config entry.)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    with torch._dynamo.config.patch(recompile_limit=2):
        for _ in range(3):
            llm = LLM(tiny_qwen3, dtype="float32", device="cpu", compilation_config={"level": 3},
                      max_model_len=64, num_gpu_blocks_override=16)
            outputs = llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
            assert len(outputs[0].outputs[0].token_ids) == 2


# ------------------------------------------------------------------ the split
def dense_sin_dense(x):
    """Three dense ops around two splitting ones (aten.sin stands in for attention)."""
    a = x + 1
    b = torch.ops.aten.sin.default(a)
    c = b * 2
    d = torch.ops.aten.sin.default(c)
    return d - 1


def sin_first_then_twice(x):
    """A splitting op first, and two in a row: no dense piece before, none between."""
    a = torch.ops.aten.sin.default(x)
    b = torch.ops.aten.sin.default(a)
    return b * 3


@pytest.mark.ch08_t1
@pytest.mark.parametrize(
    "fn, expected",
    [
        pytest.param(
            dense_sin_dense, [(0, False, 1), (1, True, 1), (2, False, 1), (3, True, 1), (4, False, 1)],
            id="dense_op_dense",
        ),
        pytest.param(
            sin_first_then_twice, [(1, True, 1), (3, True, 1), (4, False, 1)], id="op_first_and_adjacent"
        ),
    ],
)  # fmt: skip
def test_split_graph_gives_each_splitting_op_its_own_piece(fn, expected):
    """Rule: «each call of a splitting op is a piece of its own», and «the nodes after it the next one», «in
    program order»."""
    graph = torch.fx.symbolic_trace(fn)
    split_gm, items = split_graph(graph, ["aten.sin"])
    got = [
        (
            item.graph_id,
            item.is_splitting_graph,
            len([n for n in item.graph.graph.nodes if n.op == "call_function"]),
        )
        for item in items
    ]
    assert got == expected, (
        f"pieces as (graph id, is a splitting op, number of ops): expected {expected}, got {got}; ids count "
        "up in program order, a splitting op takes an id of its own and the ops after it the next one"
    )
    x = torch.randn(5)
    assert torch.equal(split_gm(x), fn(x)), "the split module must compute what the graph computes"


@pytest.mark.ch08_t1
def test_split_has_one_piece_per_attention_and_between(compiled_llm):
    """Rule: «pieces alternate dense / op / dense / ...»: a model's graph splits into one piece per attention
    call and one between each two."""
    backend = runner_of(compiled_llm).compile_backend
    items = backend.piecewise_graphs
    num_layers = 2
    assert [item.submod_name for item in items] == [f"submod_{i}" for i in range(2 * num_layers + 1)]
    assert [item.is_splitting_graph for item in items] == [False, True, False, True, False]
    for item in items:
        calls = [n for n in item.graph.graph.nodes if n.op == "call_function"]
        attention = [n for n in calls if "unified_attention_with_output" in str(n.target)]
        if item.is_splitting_graph:
            assert len(calls) == len(attention) == 1
        else:
            assert not attention and len(calls) > 5  # norms, projections, RoPE, MLP
    attention_calls = [
        n
        for item in items
        if item.is_splitting_graph
        for n in item.graph.graph.nodes
        if n.op == "call_function"
    ]
    assert [n.args[-1] for n in attention_calls] == [
        f"model.layers.{i}.self_attn.attn" for i in range(num_layers)
    ]
    # The embedding is in the first piece, the final norm in the last.
    first, last = items[0].graph.graph, items[-1].graph.graph
    assert any("embedding" in str(n.target) for n in first.nodes)
    assert not any("embedding" in str(n.target) for n in last.nodes)


def test_split_module_equals_the_unsplit_model_at_every_size_with_one_trace(compiled_llm):
    runner = runner_of(compiled_llm)
    model = runner.model
    seen = compilation_counter.num_graphs_seen
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode(), set_forward_context(None, runner.attn_layers):
        for num_tokens in (1, 2, 7, 33):
            # The runner's persistent buffers, as every step passes them.
            input_ids, positions = runner.input_ids.gpu[:num_tokens], runner.positions.gpu[:num_tokens]
            input_ids.copy_(torch.randint(0, 512, (num_tokens,), generator=generator))
            positions.copy_(torch.arange(num_tokens))
            split = model(input_ids, positions)  # the compiled forward: the split module
            unsplit = type(model).forward(model, input_ids, positions)  # the model's own code
            assert torch.equal(split, unsplit)
    assert compilation_counter.num_graphs_seen == seen, "a new batch size made Dynamo trace again"


def test_greedy_parity_with_compilation(compiled_llm, prompts_and_expected):
    prompts, expected = prompts_and_expected
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    seen = compilation_counter.num_graphs_seen
    outputs = compiled_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert compilation_counter.num_graphs_seen == seen


# ------------------------------------------------------------------ configuration
def test_capture_size_ladder_and_padding():
    config = CompilationConfig(level=3, cudagraph_mode="PIECEWISE")
    config.resolve("cuda", enforce_eager=False, max_num_seqs=256, max_num_batched_tokens=8192)
    assert config.cudagraph_capture_sizes == [1, 2, 4] + list(range(8, 513, 8))
    assert config.max_capture_size == 512
    expected = {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 8: 8, 9: 16, 17: 24, 250: 256, 511: 512, 512: 512}
    assert {n: config.pad_for_cudagraph(n) for n in expected} == expected
    # Sizes above the token budget are never reached; user sizes are sorted and deduplicated.
    small = CompilationConfig(level=3, cudagraph_mode="PIECEWISE", cudagraph_capture_sizes=[16, 4, 4, 64])
    small.resolve("cuda", enforce_eager=False, max_num_seqs=8, max_num_batched_tokens=32)
    assert small.cudagraph_capture_sizes == [4, 16] and small.max_capture_size == 16


@pytest.mark.parametrize(
    ("device", "kwargs", "level", "mode"),
    [
        ("cuda", {}, CompilationLevel.PIECEWISE, CUDAGraphMode.PIECEWISE),
        ("cpu", {}, CompilationLevel.NO_COMPILATION, CUDAGraphMode.NONE),
        ("cpu", {"level": 3}, CompilationLevel.PIECEWISE, CUDAGraphMode.NONE),
        ("cuda", {"mode": 0}, CompilationLevel.NO_COMPILATION, CUDAGraphMode.NONE),
        (
            "cuda",
            {"cudagraph_mode": "FULL_AND_PIECEWISE"},
            CompilationLevel.PIECEWISE,
            CUDAGraphMode.FULL_AND_PIECEWISE,
        ),
    ],
)
def test_defaults_per_device(device, kwargs, level, mode):
    config = CompilationConfig.from_arg(kwargs)
    config.resolve(device, enforce_eager=False, max_num_seqs=16, max_num_batched_tokens=64)
    assert (config.level, config.cudagraph_mode) == (level, mode)
    assert bool(config.cudagraph_capture_sizes) == (mode != CUDAGraphMode.NONE)


def test_full_graphs_with_triton_and_enforce_eager():
    full = CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE")
    full.resolve("cuda", enforce_eager=False, max_num_seqs=16, max_num_batched_tokens=64)
    assert full.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
    eager = CompilationConfig.from_arg(3)
    eager.resolve("cuda", enforce_eager=True, max_num_seqs=16, max_num_batched_tokens=64)
    assert (eager.level, eager.cudagraph_mode, eager.cudagraph_capture_sizes) == (0, CUDAGraphMode.NONE, [])


@pytest.mark.parametrize(
    ("device", "value"),
    [
        ("cpu", {"level": 2}),
        ("cpu", {"cudagraph_mode": "SOMETIMES"}),
        ("cpu", {"level": 3, "mode": 3}),
        ("cpu", {"unknown": 1}),
        ("cpu", "three"),  # the CLI's string: an int or JSON
        ("cpu", {"cudagraph_mode": "PIECEWISE"}),  # graphs need CUDA
        ("cuda", {"level": 0, "cudagraph_mode": "PIECEWISE"}),  # pieces need the split
        ("cuda", {"level": 3, "cudagraph_capture_sizes": [0, 8]}),
    ],
)
def test_bad_compilation_config_is_a_clear_error(device, value):
    with pytest.raises(ValueError, match="compilation|cudagraph|level"):
        config = CompilationConfig.from_arg(value)
        config.resolve(device, enforce_eager=False, max_num_seqs=4, max_num_batched_tokens=64)


@pytest.mark.parametrize("value", [CompilationConfig(level=3), {"mode": 3}, 3, "3", '{"level": 3}'])
def test_engine_args_accept_a_compilation_config(tiny_qwen3, value):
    vllm_config = make_vllm_config(tiny_qwen3, compilation_config=value)
    assert vllm_config.compilation_config.level == 3
    assert vllm_config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    if isinstance(value, CompilationConfig):
        assert value.cudagraph_mode is None  # the argument is copied, not resolved in place


# ------------------------------------------------------------------ capture and replay, faked
@pytest.mark.ch08_t2
def test_wrapper_captures_once_per_batch_size_then_replays_in_place(monkeypatch):
    """Rule: «eagerly otherwise»; «The first call with a descriptor captures its graph», «each capture counted
    in `compilation_counter.num_cudagraph_captured`»; «Later calls replay it» and «return the captured
    output tensors»; a replay whose inputs moved «raises an AssertionError saying the inputs moved»."""
    monkeypatch.setattr(FakeCUDAGraphWrapper, "events", [])
    events = FakeCUDAGraphWrapper.events
    wrapper = FakeCUDAGraphWrapper(lambda x: x * 2, CUDAGraphMode.PIECEWISE, None)
    x4, x8 = torch.arange(4.0), torch.arange(8.0)

    def call(x, mode=CUDAGraphMode.PIECEWISE, num_tokens=4):
        descriptor = None if num_tokens is None else BatchDescriptor(num_tokens)
        with set_forward_context(None, cudagraph_runtime_mode=mode, batch_descriptor=descriptor):
            return wrapper(x)

    for mode, num_tokens, why in [
        (CUDAGraphMode.NONE, 4, "a step without graphs"),
        (CUDAGraphMode.FULL, 4, "a step in another graph mode (FULL) than the wrapper's (PIECEWISE)"),
        (CUDAGraphMode.PIECEWISE, None, "a step without a batch descriptor"),
    ]:
        out = call(x4, mode, num_tokens)
        assert torch.equal(out, x4 * 2) and events == [], (
            f"{why} must run the callable eagerly; events {events}"
        )
    captured = compilation_counter.num_cudagraph_captured
    first = call(x4)
    assert events == [("capture", "PIECEWISE", 4)] and torch.equal(first, x4 * 2), (
        f"the first call at 4 tokens must capture a graph and return its output; events {events}"
    )
    assert compilation_counter.num_cudagraph_captured == captured + 1, "each capture must be counted"
    x4.add_(10)  # the runner writes each step's inputs into the same buffers
    again = call(x4)
    assert events[1:] == [("replay", "PIECEWISE", 4)], (
        f"the second call at 4 tokens must replay; events {events}"
    )
    assert torch.equal(again, x4 * 2) and again.data_ptr() == first.data_ptr(), (
        "a replay returns the captured output tensors, which the graph has just overwritten"
    )
    call(x8, num_tokens=8)
    assert events[2:] == [("capture", "PIECEWISE", 8)], (
        f"a new batch size gets its own graph; events {events}"
    )
    with pytest.raises(AssertionError, match="inputs moved"):
        call(torch.arange(4.0))  # same size, other memory: the graph would read stale inputs
    assert len(events) == 3, "a replay with inputs at other addresses must be refused, not run"


def test_piecewise_capture_at_start_up_then_replay_padded_sizes(
    tiny_qwen3, prompts_and_expected, monkeypatch
):
    prompts, expected = prompts_and_expected
    engine = engine_with_fake_graphs(tiny_qwen3, CUDAGraphMode.PIECEWISE, [1, 2, 4, 8], monkeypatch)
    events = FakeCUDAGraphWrapper.events
    num_dense = 3
    # Start-up: every dense piece at every size, largest first.
    assert events == [("capture", "PIECEWISE", n) for n in (8, 4, 2, 1) for _ in range(num_dense)]
    events.clear()
    runner = engine.engine_core.engine_core.model_executor.driver_worker.model_runner
    steps: list[int] = []
    execute_model = runner.execute_model

    def recording(scheduler_output):
        steps.append(scheduler_output.total_num_scheduled_tokens)
        return execute_model(scheduler_output)

    monkeypatch.setattr(runner, "execute_model", recording)
    # Different lengths: the batch shrinks from 6 decodes to 1 as requests finish.
    got = run_greedy(engine, prompts, [MAX_NEW - i for i in range(len(prompts))])
    assert [got[f"r{i}"] for i in range(len(prompts))] == [e[: MAX_NEW - i] for i, e in enumerate(expected)]
    assert not any(kind == "capture" for kind, _, _ in events)
    padded = {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 6: 8, 7: 8, 8: 8}
    replayed = [n for kind, _, n in events][::num_dense]
    assert replayed == [padded[n] for n in steps if n <= 8]  # larger steps run without graphs


@pytest.mark.slow
def test_full_decode_graph_with_padding(tiny_qwen3, prompts_and_expected, monkeypatch):
    """FULL_AND_PIECEWISE: pure decode steps replay the whole-model graph over padded metadata."""
    # A FULL graph holds attention too: the Triton kernel (interpreted here, at a cost per
    # token), which plans on the device. Prompts of up to 3 blocks of 16 are enough for that.
    prompts = [p[:40] for p in prompts_and_expected[0]]
    expected = hf_greedy(tiny_qwen3, prompts, MAX_NEW)
    engine = engine_with_fake_graphs(
        tiny_qwen3,
        CUDAGraphMode.FULL_AND_PIECEWISE,
        [1, 2, 4, 8],
        monkeypatch,
        attention_backend="TRITON_ATTN",
    )
    events = FakeCUDAGraphWrapper.events
    assert [e for e in events if e[1] == "FULL"] == [("capture", "FULL", n) for n in (8, 4, 2, 1)]
    events.clear()
    got = run_greedy(engine, prompts, [MAX_NEW - i for i in range(len(prompts))])
    assert [got[f"r{i}"] for i in range(len(prompts))] == [e[: MAX_NEW - i] for i, e in enumerate(expected)]
    full = [n for kind, mode, n in events if mode == "FULL"]
    assert all(kind == "replay" for kind, _, _ in events)
    # 6 decodes padded to 8, down to 1: the padding requests wrote only the null block.
    assert full[0] == 8 and full[-1] == 1 and len(full) >= MAX_NEW - len(prompts)


def test_full_graphs_fall_back_to_piecewise_with_the_reference_backend(tiny_qwen3, monkeypatch, caplog):
    """The reference plans each step on the host, which no graph can hold (AttentionCGSupport.NEVER)."""
    with caplog.at_level("WARNING"):
        engine = engine_with_fake_graphs(tiny_qwen3, CUDAGraphMode.FULL_AND_PIECEWISE, [1, 2, 4], monkeypatch)
    assert engine.vllm_config.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    assert "TORCH_REFERENCE" in caplog.text
    assert {mode for _, mode, _ in FakeCUDAGraphWrapper.events} == {"PIECEWISE"}


# ------------------------------------------------------------------ real graphs (CUDA)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_equal_eager_across_batch_changes(tiny_qwen3):
    prompts = make_prompts(1)
    lengths = [MAX_NEW - i for i in range(len(prompts))]

    def greedy(**kwargs) -> list[list[int]]:
        gc.collect()  # the previous engine's KV cache
        torch.cuda.empty_cache()
        llm = LLM(
            tiny_qwen3, dtype="float32", device="cuda", max_num_seqs=8, gpu_memory_utilization=0.2, **kwargs
        )
        params = [SamplingParams(temperature=0.0, max_tokens=n) for n in lengths]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs]

    eager = greedy(enforce_eager=True)
    captured = compilation_counter.num_cudagraph_captured
    # Requests finish one by one, so one padded size (8) replays batches of 6, 5 and then 4 real rows.
    sizes = [1, 2, 4, 8]
    graphs = greedy(
        compilation_config={"level": 3, "cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": sizes}
    )
    assert compilation_counter.num_cudagraph_captured == captured + len(sizes) * 3
    assert graphs == eager
    # FULL graphs need the Triton kernel: compare both against eager on that kernel.
    eager = greedy(enforce_eager=True, attention_backend="TRITON_ATTN")
    full = greedy(
        attention_backend="TRITON_ATTN",
        compilation_config={
            "level": 3,
            "cudagraph_mode": "FULL_AND_PIECEWISE",
            "cudagraph_capture_sizes": sizes,
        },
    )
    assert full == eager
