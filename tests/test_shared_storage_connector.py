"""SharedStorageConnector end to end: disaggregated prefill through files (chapter 16).

After v0.11.0's examples/offline_inference/disaggregated-prefill-v1/: a prefill engine
("kv_producer", max_tokens=1) saves its prompts' KV; a fresh decode engine
("kv_consumer"), given each prompt plus the prefill's token, loads it. The oracle is a
plain engine that computes everything itself (greedy, float32): equal tokens. The loaded
counts follow v0.11.0's arithmetic, restated here: the whole blocks before the decode
prompt's last token, so the decode engine schedules the rest of the prompt only. A
truncated or corrupted saved file must make the decode engine recompute the prompt (same
tokens again), not crash.

One engine with a connector lives at a time in a process (the worker's connector is
global, nano_v1/distributed/kv_transfer/kv_transfer_state.py), so each is shut down
before the next one starts.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from benchmarks.disagg_itl import shared_storage_config
from nano_v1.distributed.kv_transfer import (
    ensure_kv_transfer_initialized,
    ensure_kv_transfer_shutdown,
    has_kv_transfer_group,
)
from nano_v1.engine.arg_utils import EngineArgs
from nano_v1.entrypoints.llm import LLM
from nano_v1.sampling_params import SamplingParams

pytestmark = pytest.mark.ch16

BLOCK_SIZE = 16
MAX_TOKENS = 3
# Prefill prompts of 10 (less than a block and a token: nothing saved), 20, 33 (32 = two
# whole blocks before its last token), 40, 25 and 32 tokens (its decode prompt's 33rd token
# is the prefill's: v0.11.0 would look for 32 saved tokens there, 16 were saved); distinct
# first tokens, distinct keys.
PREFILL_PROMPTS = [
    [(7 * i + 3 * j + 1) % 500 + 1 for j in range(n)] for i, n in enumerate((10, 20, 33, 40, 25, 32))
]

# The tiny checkpoint's two attention layers, one file each.
LAYER_FILES = [f"model.layers.{i}.self_attn.attn.safetensors" for i in range(2)]


def make_llm(model: str, kv_role: str | None = None, storage: str | None = None) -> LLM:
    kv_transfer_config = None if kv_role is None else shared_storage_config(kv_role, storage)
    args = EngineArgs(
        model=model, dtype="float32", max_model_len=128, block_size=BLOCK_SIZE, num_gpu_blocks_override=64,
        kv_transfer_config=kv_transfer_config,
    )  # fmt: skip
    return LLM.from_engine_args(args, enable_multiprocessing=False)


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


class ScheduledPromptTokens:
    """Records, per prompt, the tokens the scheduler scheduled in the request's first step."""

    def __init__(self, llm: LLM) -> None:
        self.by_prompt: dict[tuple[int, ...], int] = {}
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        schedule = scheduler.schedule

        def recording_schedule() -> Any:
            output = schedule()
            for new_req in output.scheduled_new_reqs:
                self.by_prompt[tuple(new_req.prompt_token_ids)] = output.num_scheduled_tokens[new_req.req_id]
            return output

        scheduler.schedule = recording_schedule


def expected_loaded_tokens(decode_prompt_len: int) -> int:
    """v0.11.0's count: the whole blocks strictly before the decode prompt's last token."""
    return (decode_prompt_len - 2) // BLOCK_SIZE * BLOCK_SIZE


def run_decode(model: str, storage: str, prompts: list[list[int]]) -> tuple[list[list[int]], list[int], list[int]]:
    """(tokens, num_cached_tokens, first-step scheduled tokens) per prompt, from a fresh decode engine."""
    llm = make_llm(model, "kv_consumer", storage)
    try:
        scheduled = ScheduledPromptTokens(llm)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    return (
        [list(o.outputs[0].token_ids) for o in outputs],
        [o.num_cached_tokens for o in outputs],
        [scheduled.by_prompt[tuple(p)] for p in prompts],
    )


@pytest.fixture(scope="module")
def disaggregated(tiny_qwen3, tmp_path_factory) -> Iterator[dict[str, Any]]:
    """Plain engine's tokens; the prefill engine's run into a fresh directory; the prompts for decode."""
    storage = str(tmp_path_factory.mktemp("kv") / "not_yet_created")  # the connector creates it
    plain = make_llm(tiny_qwen3)
    try:
        expected = greedy(plain, PREFILL_PROMPTS, 1 + MAX_TOKENS)
    finally:
        plain.llm_engine.shutdown()
    prefill = make_llm(tiny_qwen3, "kv_producer", storage)
    try:
        first_tokens = greedy(prefill, PREFILL_PROMPTS, 1)
    finally:
        prefill.llm_engine.shutdown()
    assert not has_kv_transfer_group(), "shutting the engine down shuts its worker's connector down"
    yield {
        "model": tiny_qwen3,
        "storage": storage,
        "expected": expected,
        "first_tokens": first_tokens,
        "decode_prompts": [p + t for p, t in zip(PREFILL_PROMPTS, first_tokens)],
    }


@pytest.mark.ch16_t2
def test_prefill_then_decode_equals_plain_engine(disaggregated):
    """The decode engine loads the saved blocks, schedules only the rest of each prompt, and
    generates the plain engine's tokens.

    Rule: a request loads «the whole blocks before the last prompt token» of its prompt
    (`align_to_block_size`), when they were saved; nothing otherwise."""
    expected = disaggregated["expected"]
    assert [t[:1] for t in expected] == disaggregated["first_tokens"]
    prompts = disaggregated["decode_prompts"]
    tokens, num_cached, scheduled = run_decode(disaggregated["model"], disaggregated["storage"], prompts)
    loaded = [expected_loaded_tokens(len(p)) for p in prompts]
    assert loaded == [0, 16, 32, 32, 16, 16]
    assert num_cached == loaded, f"cached tokens per prompt {num_cached}; the saved whole blocks {loaded} expected"
    assert scheduled == [len(p) - n for p, n in zip(prompts, loaded)], (
        f"scheduled prompt tokens {scheduled}; each prompt minus its loaded tokens {loaded} expected"
    )
    assert tokens == [t[1:] for t in expected], "the decode engine's tokens differ from the plain engine's"


@pytest.mark.ch16_t2
def test_local_prefix_hits_are_not_loaded_again(disaggregated):
    """A decode engine's own prefix cache comes first: the connector loads only what lies past
    the local hit, and nothing when the local hit covers more than was saved.

    Rules: the answer counts the saved tokens past `num_computed_tokens` (the local hit), and
    is «never negative»."""
    prompts = disaggregated["decode_prompts"]
    expected = [t[1:] for t in disaggregated["expected"]]
    llm = make_llm(disaggregated["model"], "kv_consumer", disaggregated["storage"])
    try:
        scheduled = ScheduledPromptTokens(llm)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        # The first block of prompts[3] (41 tokens, 32 saved) is computed here: a local hit of 16.
        llm.generate([{"prompt_token_ids": prompts[3][:17]}], params, use_tqdm=False)
        first = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert first[3].num_cached_tokens == 32, f"{first[3].num_cached_tokens} cached; 16 hit locally + 16 loaded expected"
        assert scheduled.by_prompt[tuple(prompts[3])] == len(prompts[3]) - 32, "scheduled more than the prompt minus its hits"
        # Every prompt again: its whole blocks before its last token are local hits now,
        # (L - 1) // 16 * 16 tokens, past what was saved for the 33-token prompt (16).
        again = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    cached = [o.num_cached_tokens for o in first]
    assert cached == [expected_loaded_tokens(len(p)) for p in prompts], f"first pass, cached tokens {cached}"
    local_hits = [(len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in prompts]
    assert local_hits[5] > expected_loaded_tokens(len(prompts[5]))
    cached = [o.num_cached_tokens for o in again]
    assert cached == local_hits, f"second pass, cached tokens {cached}; the local hits {local_hits} expected"
    for outputs in (first, again):
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected, "tokens differ from the plain engine's"


def saved_folder(storage: str, prompt: list[int]) -> str:
    """Where a prefill engine saved `prompt`: the md5 of its first whole blocks' token ids, as int64
    (v0.11.0's layout, which the connector's module docstring states)."""
    num_tokens = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    return os.path.join(storage, hashlib.md5(np.asarray(prompt[:num_tokens], dtype=np.int64).tobytes()).hexdigest())


def test_truncated_or_corrupt_saved_kv_is_recomputed(disaggregated):
    """A truncated file, a garbled header, a flipped data byte: those prompts are computed
    from scratch (nothing counted as loaded) with the plain engine's tokens; the intact ones
    still load."""
    storage = disaggregated["storage"]
    folders = [saved_folder(storage, p) for p in PREFILL_PROMPTS[1:]]
    assert all(sorted(os.listdir(f)) == LAYER_FILES for f in folders)
    truncated = os.path.join(folders[0], LAYER_FILES[1])
    with open(truncated, "r+b") as f:
        f.truncate(os.path.getsize(truncated) - 4)
    with open(os.path.join(folders[1], LAYER_FILES[0]), "r+b") as f:
        f.seek(8)  # past the header's length: into its JSON
        f.write(b"#garbage#")
    flipped = os.path.join(folders[2], LAYER_FILES[1])
    with open(flipped, "r+b") as f:
        f.seek(-5, os.SEEK_END)  # inside the last value
        byte = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x40]))
    prompts = disaggregated["decode_prompts"]
    tokens, num_cached, scheduled = run_decode(disaggregated["model"], storage, prompts)
    assert tokens == [t[1:] for t in disaggregated["expected"]]
    assert num_cached == [0, 0, 0, 0] + [expected_loaded_tokens(len(p)) for p in prompts[4:]]
    assert scheduled == [len(p) - n for p, n in zip(prompts, num_cached)]


def test_one_engine_with_a_connector_per_process(tiny_qwen3, tmp_path):
    """The worker's connector is the process's: a second one is refused, not silently shared;
    shutting it down frees the slot."""
    config = EngineArgs(
        model=tiny_qwen3, dtype="float32",
        kv_transfer_config={"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
                            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}},
    ).create_engine_config()  # fmt: skip
    ensure_kv_transfer_initialized(config)
    try:
        with pytest.raises(ValueError, match="already runs an engine with a KV connector"):
            ensure_kv_transfer_initialized(config)
    finally:
        ensure_kv_transfer_shutdown()
    assert not has_kv_transfer_group()
