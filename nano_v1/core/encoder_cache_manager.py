"""The scheduler's view of the encoder cache: which images' encoder outputs the model runner holds.

Mirrors vllm/v1/core/encoder_cache_manager.py (`EncoderCacheManager`) (chapter 11).

Why it exists: an image's encoder output is needed for every step whose chunk covers one
of its positions, and the image is encoded whole, so the output must outlive the step
that computed it. The model runner keeps the tensors (`GPUModelRunner.encoder_cache`,
keyed by `mm_hash`); this class is the bookkeeping, in units of image tokens, exactly as
the `KVCacheManager` is for KV blocks, and with the same life cycle of an entry:

    allocate          a request needs image X and nobody has it: X is computed this step
    referenced        X's request ids: the requests whose chunks still have to reach X's end
    freeable          no request refers to X any more, but its output stays (LRU order), so
                      a later request showing the same image finds it (check_and_update_cache)
    freed             space was needed: X is evicted, and the next SchedulerOutput tells the
                      runner to drop it (free_encoder_mm_hashes)

Entries are keyed by content (`mm_hash`), so one image in a hundred requests is encoded
once, as long as it is not evicted in between.

What differs from v0.11.0: its `compute_encoder_budget` (the budget and the cache's size,
which the scheduler computes when it is built) is here
`nano_v1/config/scheduler.py::SchedulerConfig.resolve_encoder_budget`, settled once when
the `VllmConfig` is built, so the frontend's check of an image's size reads the config
instead of importing the engine core's modules.
"""

from __future__ import annotations

from collections import OrderedDict

from nano_v1.request import Request


class EncoderCacheManager:
    """Capacity `cache_size` image tokens of encoder output, shared by all requests.

    Invariants, between calls:
      * `cached[h]`: the ids of the requests that refer to entry h (maybe none);
      * `freeable` holds exactly the entries with no referring request, oldest first,
        with their sizes;
      * `num_free_slots` = cache_size - sizes of all entries;
        `num_freeable_slots` = num_free_slots + sizes of the freeable entries.
    """

    def __init__(self, cache_size: int) -> None:
        self.cache_size = cache_size
        self.num_free_slots = cache_size
        self.num_freeable_slots = cache_size
        # mm_hash -> ids of the requests that refer to it
        self.cached: dict[str, set[str]] = {}
        # mm_hash -> its size in image tokens, for entries nobody refers to; oldest first
        self.freeable: OrderedDict[str, int] = OrderedDict()
        # Evicted since the last get_freed_mm_hashes(): the runner must drop these.
        self.freed: list[str] = []

    def check_and_update_cache(self, request: Request, input_id: int) -> bool:
        """True if the output of the request's input `input_id` is cached; the request then refers to it."""
        mm_hash = request.mm_features[input_id].identifier
        if mm_hash not in self.cached:
            return False
        if not self.cached[mm_hash]:
            # Nobody referred to it: it stops being freeable.
            self.num_freeable_slots -= self.freeable.pop(mm_hash)
        self.cached[mm_hash].add(request.request_id)
        return True

    def can_allocate(
        self, request: Request, input_id: int, encoder_compute_budget: int, num_tokens_to_schedule: int
    ) -> bool:
        """Whether input `input_id` can be encoded this step, after `num_tokens_to_schedule`
        tokens of other inputs already chosen in this call.

        False if the step's encoder compute budget cannot take it, or if free plus freeable
        space cannot hold it. Otherwise True, after evicting the oldest freeable entries
        until the free space suffices (their hashes go to `freed`).
        """
        num_tokens = request.get_num_encoder_tokens(input_id)
        if num_tokens > encoder_compute_budget:
            return False
        num_tokens += num_tokens_to_schedule
        if num_tokens <= self.num_free_slots:
            return True
        if num_tokens > self.num_freeable_slots:
            return False
        while num_tokens > self.num_free_slots:
            mm_hash, num_freed = self.freeable.popitem(last=False)
            del self.cached[mm_hash]
            self.freed.append(mm_hash)
            self.num_free_slots += num_freed
        return True

    def allocate(self, request: Request, input_id: int) -> None:
        """Reserve space for input `input_id`'s output, which the runner computes this step.

        Only after `can_allocate` said yes for it (which has made the space free).
        """
        mm_hash = request.mm_features[input_id].identifier
        num_tokens = request.get_num_encoder_tokens(input_id)
        assert self.num_free_slots >= num_tokens and self.num_freeable_slots >= num_tokens
        self.cached.setdefault(mm_hash, set()).add(request.request_id)
        self.num_free_slots -= num_tokens
        self.num_freeable_slots -= num_tokens

    def get_cached_input_ids(self, request: Request) -> set[int]:
        """The request's inputs whose hash has an entry (referred to by it or not)."""
        return {i for i, feature in enumerate(request.mm_features) if feature.identifier in self.cached}

    def free_encoder_input(self, request: Request, input_id: int) -> None:
        """Drop the request's reference to input `input_id`; an entry nobody refers to becomes freeable.

        The output stays in the runner until `can_allocate` needs the space.
        """
        mm_hash = request.mm_features[input_id].identifier
        refs = self.cached.get(mm_hash)
        if not refs:
            return
        refs.discard(request.request_id)
        if not refs:
            num_tokens = request.get_num_encoder_tokens(input_id)
            self.freeable[mm_hash] = num_tokens
            self.num_freeable_slots += num_tokens

    def free(self, request: Request) -> None:
        """Drop every reference the request holds (it finished, was aborted or preempted)."""
        for input_id in self.get_cached_input_ids(request):
            self.free_encoder_input(request, input_id)

    def get_freed_mm_hashes(self) -> list[str]:
        """The entries evicted since the last call (the list is handed over and restarted)."""
        freed, self.freed = self.freed, []
        return freed

