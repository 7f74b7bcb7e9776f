"""The encoder budget, the encoder cache and the image keys of block hashes, without a model.

The scheduler runs against the fake model runner of chapter 04 (tests/test_scheduler.py),
extended with a fake encoder cache. A request's image positions hold the placeholder
token, as in a real prompt, but the fake runner's "KV" at those positions is the image's
content (a number unique to the image and the row), so a prefix-cache hit that handed one
image's KV to another image fails its KV check. Every step it also checks what a real
runner relies on: each image a chunk covers is encoded in this step or cached, nothing is
encoded twice while cached, the step's encoding fits the compute budget, and the runner's
cache holds exactly the entries the scheduler's `EncoderCacheManager` counts, within its size.
"""

from __future__ import annotations

import dataclasses
import random
import types

import pytest
from helpers.kv_cache import full_attention_kv_cache_config
from helpers.scheduler import VOCAB, FakeModelRunner, check_kv_invariants, reference_output
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nano_v1.config import CacheConfig, DeviceConfig, SchedulerConfig, VllmConfig
from nano_v1.core import kv_cache_utils
from nano_v1.core.encoder_cache_manager import EncoderCacheManager
from nano_v1.core.kv_cache_utils import get_request_block_hasher
from nano_v1.core.sched.output import SchedulerOutput
from nano_v1.core.sched.scheduler import Scheduler
from nano_v1.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from nano_v1.request import Request, RequestStatus
from nano_v1.sampling_params import SamplingParams

pytestmark = pytest.mark.ch11

PLACEHOLDER = 0  # the image token id every image position holds in the prompt


def make_mm_scheduler(
    *,
    max_image_tokens: int,
    block_size: int = 4,
    num_blocks: int = 256,
    max_model_len: int = 400,
    caching: bool = True,
    **scheduler_config: object,
) -> Scheduler:
    """A scheduler for a multimodal model without weights; `scheduler_config`: SchedulerConfig's fields."""
    config = VllmConfig.__new__(VllmConfig)
    config.cache_config = CacheConfig(
        block_size=block_size, enable_prefix_caching=caching, num_gpu_blocks=num_blocks
    )
    config.scheduler_config = SchedulerConfig(**scheduler_config)
    config.scheduler_config.resolve_encoder_budget(max_image_tokens)  # images of at most this many positions
    config.model_config = types.SimpleNamespace(max_model_len=max_model_len, is_multimodal_model=True)
    config.device_config = DeviceConfig("cpu")
    return Scheduler(config, full_attention_kv_cache_config(num_blocks, block_size))


def image(identifier: str, offset: int, length: int) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(
        data={}, modality="image", identifier=identifier, mm_position=PlaceholderRange(offset, length)
    )


def mm_request(
    req_id: str, layout: list, max_tokens: int = 3, block_size: int | None = 4
) -> tuple[Request, list[int]]:
    """A request from a layout such as `[5, 6, ("A", 4), 7]` (text tokens and (image, length) pairs).

    Returns the request (placeholders at image positions) and its content: what the fake
    runner writes as KV there, a number unique to the image and the row.
    """
    tokens, content, features = [], [], []
    for piece in layout:
        if isinstance(piece, tuple):
            identifier, length = piece
            features.append(image(identifier, len(tokens), length))
            tokens += [PLACEHOLDER] * length
            content += [1000 * (1 + ord(identifier[0])) + row for row in range(length)]
        else:
            tokens.append(piece)
            content.append(piece)
    hasher = get_request_block_hasher(block_size) if block_size else None
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    request = Request(req_id, tokens, params, None, block_hasher=hasher, mm_features=features)
    return request, content


class FakeMMRunner(FakeModelRunner):
    """The chapter-04 fake runner plus an encoder cache: {mm_hash: tokens}, checked every step."""

    def __init__(self, sched: Scheduler, contents: dict[str, list[int]]) -> None:
        super().__init__(sched.block_size)
        self.sched = sched
        self.contents = contents
        self.features: dict[str, list[MultiModalFeatureSpec]] = {}
        self.encoder_cache: dict[str, int] = {}
        self.num_encoded_tokens = 0

    def execute_model(self, so: SchedulerOutput):
        for mm_hash in so.free_encoder_mm_hashes:
            assert mm_hash in self.encoder_cache, f"{mm_hash} freed but never encoded"
            del self.encoder_cache[mm_hash]
        for req_id in so.finished_req_ids:
            self.features.pop(req_id, None)
        start = {new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs}
        start.update(zip(so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.num_computed_tokens))
        self.features.update({new.req_id: new.mm_features for new in so.scheduled_new_reqs})
        num_encoded = 0
        for req_id, input_ids in so.scheduled_encoder_inputs.items():
            for input_id in input_ids:
                feature = self.features[req_id][input_id]
                assert feature.identifier not in self.encoder_cache, (
                    f"{feature.identifier} encoded again while cached"
                )
                self.encoder_cache[feature.identifier] = feature.mm_position.length
                num_encoded += feature.mm_position.length
        self.num_encoded_tokens += num_encoded
        manager = self.sched.encoder_cache_manager
        assert num_encoded <= self.sched.max_num_encoder_input_tokens, "over the encoder compute budget"
        assert sum(self.encoder_cache.values()) <= manager.cache_size, "over the encoder cache size"
        assert self.encoder_cache.keys() == manager.cached.keys(), (
            "the runner's cache and the manager disagree"
        )
        for req_id, num_tokens in so.num_scheduled_tokens.items():
            chunk_start, chunk_end = start[req_id], start[req_id] + num_tokens
            for feature in self.features[req_id]:
                offset, length = feature.mm_position.offset, feature.mm_position.length
                if offset < chunk_end and offset + length > chunk_start:
                    assert feature.identifier in self.encoder_cache, (
                        f"{req_id}'s chunk covers unencoded {feature}"
                    )
                if self.sched.disable_chunked_mm_input:
                    assert not chunk_start < offset < chunk_end < offset + length, f"{req_id} split {feature}"
        # The fake model sees image content where the prompt holds placeholders.
        new_reqs = [
            dataclasses.replace(n, prompt_token_ids=list(self.contents[n.req_id]))
            for n in so.scheduled_new_reqs
        ]
        return super().execute_model(dataclasses.replace(so, scheduled_new_reqs=new_reqs))


def run_to_completion(
    sched: Scheduler,
    requests: list[tuple[Request, list[int]]],
    rng: random.Random | None = None,
    abort_prob: float = 0.0,
    runner: FakeMMRunner | None = None,
):
    """Add the requests (over the first steps, with `rng`), run until all are done; return
    outputs, aborted ids and the runner (pass `runner` to go on with its caches)."""
    runner = runner or FakeMMRunner(sched, {})
    runner.contents.update({r.request_id: content for r, content in requests})
    pending = [r for r, _ in requests]
    outputs: dict[str, list[int]] = {r.request_id: [] for r in pending}
    aborted: set[str] = set()
    for _ in range(3000):
        for _ in range(rng.randint(0, 3) if rng else len(pending)):
            if pending:
                sched.add_request(pending.pop(0))
        if rng and sched.requests and rng.random() < abort_prob:
            victim = rng.choice(sorted(sched.requests))
            sched.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            aborted.add(victim)
        if not (pending or sched.has_unfinished_requests()):
            break
        if not sched.has_unfinished_requests():
            continue
        so = sched.schedule()
        check_kv_invariants(sched)
        check_encoder_references(sched)
        for out in sched.update_from_output(so, runner.execute_model(so)).outputs:
            outputs[out.request_id].extend(out.new_token_ids)
    else:
        raise AssertionError("the scheduler stopped making progress")
    return outputs, aborted, runner


def check_encoder_references(sched: Scheduler) -> None:
    """After a schedule(): a request refers to an image's encoder output only while it runs
    and has not computed the image's last position yet (a waiting request holding one could
    starve the request ahead of it)."""
    holders = {req_id for refs in sched.encoder_cache_manager.cached.values() for req_id in refs}
    assert not holders & {r.request_id for r in sched.waiting}, "a waiting request holds encoder outputs"
    for request in sched.running:
        for feature in request.mm_features:
            position = feature.mm_position
            if position.offset + position.length <= request.num_computed_tokens:
                refs = sched.encoder_cache_manager.cached.get(feature.identifier, set())
                assert request.request_id not in refs, (
                    f"{request.request_id} still holds {feature.identifier}"
                )


def check_all_released(sched: Scheduler) -> None:
    """Nothing runs: every encoder cache entry is freeable, and every KV block free."""
    manager = sched.encoder_cache_manager
    assert all(not refs for refs in manager.cached.values())
    assert manager.num_freeable_slots == manager.cache_size
    assert manager.freeable.keys() == manager.cached.keys()
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == len(pool.blocks) - 1


# ----------------------------------------------------------------------------- EncoderCacheManager


def test_manager_refcounts_evicts_oldest_freeable_and_reports_it():
    manager = EncoderCacheManager(cache_size=10)
    a, _ = mm_request("a", [("A", 4), ("B", 4)], block_size=None)
    b, _ = mm_request("b", [("A", 4), ("C", 4)], block_size=None)
    assert not manager.check_and_update_cache(a, 0)
    assert manager.can_allocate(a, 0, encoder_compute_budget=10, num_tokens_to_schedule=0)
    manager.allocate(a, 0)
    assert not manager.can_allocate(a, 1, encoder_compute_budget=3, num_tokens_to_schedule=0)  # the budget
    manager.allocate(a, 1)
    assert manager.check_and_update_cache(b, 0)  # A is shared: b refers to it too
    assert manager.cached["A"] == {"a", "b"} and manager.num_free_slots == 2
    assert not manager.can_allocate(
        b, 1, encoder_compute_budget=10, num_tokens_to_schedule=0
    )  # all referenced
    manager.free(a)
    assert manager.cached == {"A": {"b"}, "B": set()} and list(manager.freeable) == ["B"]
    manager.free_encoder_input(b, 0)
    assert list(manager.freeable) == ["B", "A"] and manager.num_freeable_slots == 10
    # C needs 4 slots and 2 are free: the oldest freeable entry, B, is evicted; A stays.
    assert manager.can_allocate(b, 1, encoder_compute_budget=10, num_tokens_to_schedule=0)
    assert manager.get_freed_mm_hashes() == ["B"] and manager.get_freed_mm_hashes() == []
    manager.allocate(b, 1)
    assert manager.cached == {"A": set(), "C": {"b"}} and manager.num_free_slots == 2
    # A is cached but unreferenced; a hit makes it referenced again, and not freeable.
    assert manager.check_and_update_cache(a, 0) and manager.num_freeable_slots == 2


# ----------------------------------------------------------------------------- ch11_t1: the encoder-input check


def try_schedule(sched: Scheduler, request: Request, num_computed: int, num_new: int, budget: int):
    return sched._try_schedule_encoder_inputs(request, num_computed, num_new, budget)


def check_try_schedule(
    sched: Scheduler, request: Request, num_computed: int, num_new: int, budget: int, expected, why: str
) -> None:
    """_try_schedule_encoder_inputs must give `expected` (inputs to encode, num_new_tokens, budget left)."""
    got = try_schedule(sched, request, num_computed, num_new, budget)
    assert got == expected, (
        f"{why}: for the chunk [{num_computed}, {num_computed + num_new}) with an encoder budget of "
        f"{budget}, expected to encode inputs {expected[0]}, schedule {expected[1]} tokens and leave "
        f"{expected[2]} of budget; got inputs {got[0]}, {got[1]} tokens, {got[2]} left"
    )


@pytest.mark.ch11_t1
def test_try_schedule_encodes_covered_images_and_cuts_before_the_rest():
    """Rule: «An image whose positions overlap it is needed»; if it does not fit, «the chunk is cut to end
    just before the image, and to nothing if it starts inside it»."""
    sched = make_mm_scheduler(
        max_num_batched_tokens=64, max_num_encoder_input_tokens=16, encoder_cache_size=16, max_image_tokens=8
    )
    req, _ = mm_request("r", [1, 2, ("A", 8), 3, ("B", 8), 4], block_size=None)  # A at 2..9, B at 11..18
    check_try_schedule(sched, req, 0, 2, 16, ([], 2, 16), "text only: A starts at the chunk's end")
    check_try_schedule(sched, req, 0, 5, 16, ([0], 5, 8), "the chunk reaches into A: A is encoded now, whole")
    check_try_schedule(
        sched, req, 0, 20, 12, ([0], 11, 4), "budget for one image: A, then the chunk stops right before B"
    )
    check_try_schedule(sched, req, 0, 20, 4, ([], 2, 4), "no budget for A: only the text before it")
    check_try_schedule(
        sched,
        req,
        10,
        10,
        16,
        ([1], 10, 8),
        "A's positions are behind the chunk (computed): only B is encoded",
    )
    check_try_schedule(
        sched, req, 5, 10, 4, ([], 0, 4), "the chunk starts inside A, which cannot be encoded: nothing at all"
    )


@pytest.mark.ch11_t1
def test_try_schedule_skips_cached_images_and_encodes_a_repeated_one_once():
    """Rule: needed «unless it is computed already», «cached (`check_and_update_cache`, which makes the
    request refer to it) or already chosen in this call»."""
    sched = make_mm_scheduler(
        max_num_batched_tokens=64, max_num_encoder_input_tokens=16, encoder_cache_size=16, max_image_tokens=8
    )
    manager = sched.encoder_cache_manager
    first, _ = mm_request("first", [("A", 8), 1], block_size=None)
    manager.allocate(first, 0)
    twice, _ = mm_request("twice", [1, ("A", 8), ("B", 4), ("B", 4)], block_size=None)
    check_try_schedule(
        sched, twice, 0, 17, 16, ([1], 17, 12),
        "A is cached (encoded for `first`), so not encoded again; B appears twice and is encoded once",
    )  # fmt: skip
    assert manager.cached["A"] == {"first", "twice"}, (
        "a cache hit must make the request refer to the cached image (check_and_update_cache)"
    )


@pytest.mark.ch11_t1
def test_try_schedule_respects_the_cache_size_and_chunked_mm_input():
    """Rule: «it must fit the remaining compute budget and the cache»; «With `disable_chunked_mm_input`, the
    chunk is also cut before any image it would cover only in part, cached or not»."""
    sched = make_mm_scheduler(
        max_num_batched_tokens=64, max_num_encoder_input_tokens=64, encoder_cache_size=12, max_image_tokens=8
    )
    req, _ = mm_request("r", [1, ("A", 8), ("B", 8), 2], block_size=None)
    check_try_schedule(
        sched, req, 0, 18, 64, ([0], 9, 56),
        "the budget would take both images but the encoder cache holds 12 tokens: A only, then stop before B",
    )  # fmt: skip
    unchunked = make_mm_scheduler(
        max_num_batched_tokens=64, max_image_tokens=8, disable_chunked_mm_input=True
    )
    check_try_schedule(
        unchunked, req, 0, 5, 64, ([], 1, 64),
        "with disable_chunked_mm_input, a chunk that would end inside A stops before it",
    )  # fmt: skip
    check_try_schedule(
        unchunked, req, 0, 9, 64, ([0], 9, 56),
        "with disable_chunked_mm_input, a chunk that takes A whole may go on",
    )  # fmt: skip


@pytest.mark.ch11_t1
def test_seed_schedule_text_image_text():
    """Rule: «A needed image is encoded whole»: the seed's example at small sizes (10 text tokens, a 50-token
    image, 10 text tokens).

    The seed's example at small sizes: 10 text tokens, a 50-token image, 10 text tokens."""
    layout = [*range(1, 11), ("A", 50), *range(11, 21)]

    def chunks(**kwargs) -> list[tuple[dict[str, int], dict[str, list[int]]]]:
        sched = make_mm_scheduler(max_num_batched_tokens=50, max_image_tokens=50, caching=False, **kwargs)
        req, content = mm_request("r", layout, max_tokens=2, block_size=None)
        runner = FakeMMRunner(sched, {"r": content})
        sched.add_request(req)
        steps = []
        while sched.has_unfinished_requests():
            so = sched.schedule()
            steps.append((so.num_scheduled_tokens, so.scheduled_encoder_inputs))
            sched.update_from_output(so, runner.execute_model(so))
        return steps

    unchunked = chunks(disable_chunked_mm_input=True)
    assert unchunked == [({"r": 10}, {}), ({"r": 50}, {"r": [0]}), ({"r": 10}, {}), ({"r": 1}, {})], (
        "with disable_chunked_mm_input and a 50-token budget, the steps must be the 10 text tokens, the "
        f"image (encoded), the 10 text tokens, one decode; got (tokens, encoder inputs) {unchunked}"
    )
    across = chunks()
    assert across == [({"r": 50}, {"r": [0]}), ({"r": 20}, {}), ({"r": 1}, {})], (
        "with chunks across images, the first 50-token chunk encodes the image and the next reads the "
        f"cache; got (tokens, encoder inputs) {across}"
    )


def random_mm_workload(
    rng: random.Random, num: int, max_image_tokens: int
) -> list[tuple[Request, list[int]]]:
    """Prompts of text and images; images from a small pool (so repeats happen), some prompts
    sharing a text prefix (so prefix caching meets images)."""
    pool = [(chr(ord("A") + i), rng.randint(1, max_image_tokens)) for i in range(5)]
    shared_prefix = [rng.randrange(1, VOCAB) for _ in range(8)]
    requests = []
    for i in range(num):
        layout: list = list(shared_prefix[: rng.randint(0, 8)])
        for _ in range(rng.randint(0, 3)):
            layout += [rng.randrange(1, VOCAB) for _ in range(rng.randint(0, 6))]
            layout.append(rng.choice(pool))
        layout += [rng.randrange(1, VOCAB) for _ in range(rng.randint(0 if layout else 1, 6))]
        requests.append(mm_request(f"r{i}", layout, max_tokens=rng.randint(1, 6)))
    return requests


@pytest.mark.ch11_t1
@pytest.mark.ch11_t2  # prefix caching meets images: the block hashes' image keys matter too
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10**6),
    budget=st.integers(4, 48),
    max_image_tokens=st.integers(1, 16),
    extra_encoder_budget=st.integers(0, 16),
    extra_cache=st.integers(0, 32),
    caching=st.booleans(),
    disable_chunked_mm_input=st.booleans(),
    policy=st.sampled_from(["fcfs", "priority"]),
)
def test_random_workloads_keep_the_encoder_invariants(
    seed,
    budget,
    max_image_tokens,
    extra_encoder_budget,
    extra_cache,
    caching,
    disable_chunked_mm_input,
    policy,
):
    """Rule: «A needed image is encoded whole» before any chunk reads it, and a block's hash names «every
    image with a position in the block»: over random workloads the encoder's invariants hold."""
    rng = random.Random(seed)
    budget = max(budget, max_image_tokens) if disable_chunked_mm_input else budget
    max_model_len = 8 + 3 * (6 + 16) + 6 + 6 + 1
    sched = make_mm_scheduler(
        max_num_batched_tokens=budget,
        max_num_encoder_input_tokens=max_image_tokens + extra_encoder_budget,
        encoder_cache_size=max_image_tokens + extra_cache,
        max_image_tokens=max_image_tokens,
        # "One request at a time" half the time, else up to plenty: small pools force preemption.
        num_blocks=rng.choice(
            [max_model_len // 4 + 2, rng.randint(max_model_len // 4 + 2, 3 * max_model_len // 4)]
        ),
        max_model_len=max_model_len,
        caching=caching,
        disable_chunked_mm_input=disable_chunked_mm_input,
        policy=policy,
        max_num_seqs=8,
    )
    requests = random_mm_workload(rng, rng.randint(1, 10), max_image_tokens)
    for request, _ in requests:
        request.priority = rng.randint(0, 2)
    outputs, aborted, _ = run_to_completion(sched, requests, rng, abort_prob=0.05)
    for request, content in requests:
        if request.request_id not in aborted:
            assert outputs[request.request_id] == reference_output(content, request.max_tokens)
    check_all_released(sched)


def test_a_repeated_image_is_encoded_once_and_released_after_its_last_request():
    sched = make_mm_scheduler(max_num_batched_tokens=64, max_image_tokens=8)
    requests = [mm_request(f"q{i}", [10 + i, 20 + i, ("A", 8), 5], max_tokens=2) for i in range(4)]
    outputs, _, runner = run_to_completion(sched, requests)
    assert runner.num_encoded_tokens == 8  # four requests, one encoding
    for request, content in requests:
        assert outputs[request.request_id] == reference_output(content, 2)
    check_all_released(sched)
    assert runner.encoder_cache.keys() == {"A"}  # freeable, kept for the next request that shows it
    # An image that needs A's space (the cache holds 64 tokens) evicts it.
    big, content = mm_request("big", [1, ("Z", 60)], max_tokens=1)
    outputs, _, _ = run_to_completion(sched, [(big, content)], runner=runner)
    assert runner.encoder_cache.keys() == sched.encoder_cache_manager.cached.keys() == {"Z"}
    assert outputs["big"] == reference_output(content, 1)


# ----------------------------------------------------------------------------- ch11_t2: image keys of block hashes


def brute_force_keys(request: Request, start: int, end: int) -> list[str]:
    block = set(range(start, end))
    return [
        f.identifier
        for f in request.mm_features
        if block & set(range(f.mm_position.offset, f.mm_position.offset + f.mm_position.length))
    ]


@pytest.mark.ch11_t2
@settings(max_examples=200, deadline=None)
@given(
    layout=st.lists(
        st.one_of(st.integers(1, 9), st.tuples(st.sampled_from("ABC"), st.integers(1, 9))), max_size=12
    ),
    block_size=st.integers(1, 8),
)
def test_mm_extra_keys_are_exactly_the_images_in_the_block(layout, block_size):
    """Rule: «The mm_hash of every image with a position in the block», and no other."""
    request, _ = mm_request("r", layout, block_size=None)
    for start in range(0, request.num_tokens, block_size):
        end = start + block_size
        got = kv_cache_utils._gen_mm_extra_hash_keys(request, start, end)
        expected = brute_force_keys(request, start, end)
        images = [(f.identifier, f.mm_position.offset, f.mm_position.length) for f in request.mm_features]
        assert got == expected, (
            f"block [{start}, {end}) overlaps images {expected}, got {got}; images (id, offset, length): {images}"
        )


@pytest.mark.ch11_t2
def test_block_hashes_differ_from_the_first_block_with_a_different_image():
    """Rule: «identifiers of the images whose positions overlap the block»: two prompts whose images differ
    hash alike up to the first block that holds one."""
    text = [1, 2, 3, 4, 5, 6]
    a, _ = mm_request("a", [*text, ("A", 6), 7, 8, 9, 10])
    b, _ = mm_request("b", [*text, ("B", 6), 7, 8, 9, 10])
    a_again, _ = mm_request("a2", [*text, ("A", 6), 7, 8, 9, 10])
    # 4-token blocks: block 0 is text, block 1 holds text and the image's first two rows.
    assert a.block_hashes[0] == b.block_hashes[0], (
        "block 0 holds text only: its hash must not depend on the image that follows it"
    )
    differ = [x != y for x, y in zip(a.block_hashes[1:], b.block_hashes[1:])]
    assert all(differ), (
        f"blocks 1-4 hold (parts of) image A or B: every hash must differ; equal at blocks "
        f"{[i + 1 for i, d in enumerate(differ) if not d]}"
    )
    assert a.block_hashes == a_again.block_hashes, "the same prompt with the same image must hash the same"
    # A text-only request's hashes are what they were before images existed: no extra keys.
    text_only, _ = mm_request("t", text + [0] * 10)
    assert text_only.block_hashes[0] == a.block_hashes[0], (
        "a text-only block gets no extra keys: its hash must equal the same text's in an image prompt"
    )
    assert text_only.block_hashes[1] != a.block_hashes[1], (
        "block 1 of the image prompt holds image positions: its hash must differ from the same "
        "placeholder tokens without an image"
    )


@pytest.mark.ch11_t2
def test_prefix_cache_shares_blocks_for_the_same_image_only():
    """Rule: «identifiers of the images whose positions overlap the block»: blocks are shared for the same
    image only."""
    sched = make_mm_scheduler(max_num_batched_tokens=64, max_image_tokens=8)
    text = [1, 2, 3, 4, 5, 6]
    first, content = mm_request("first", [*text, ("A", 8), 9, 9, 9])
    _, _, runner = run_to_completion(sched, [(first, content)])
    same, same_content = mm_request("same", [*text, ("A", 8), 9, 9, 9])
    other, other_content = mm_request("other", [*text, ("B", 8), 9, 9, 9])
    outputs, _, _ = run_to_completion(sched, [(same, same_content), (other, other_content)], runner=runner)
    # 17 tokens: the same image hits all 4 full blocks; another image only the text block before it.
    assert (same.num_cached_tokens, other.num_cached_tokens) == (16, 4), (
        "a 17-token prompt with the same image must hit all 4 full blocks (16 tokens), one with another "
        "image only the text block before it (4); got "
        f"{same.num_cached_tokens} and {other.num_cached_tokens}"
    )
    assert outputs["same"] == reference_output(same_content, 3)
    assert outputs["other"] == reference_output(other_content, 3)
