"""Statistics the scheduler attaches to a step's outputs.

Mirrors vllm/v1/metrics/stats.py (chapter 10).

Why it exists: only the engine core knows some facts (how many drafts were accepted),
and only the frontend keeps anything across steps (it outlives the core's steps and,
in chapter 09, lives in another process). So the scheduler packs each step's counts
into `SchedulerStats`, which rides on `EngineCoreOutputs`, and the frontend adds them
up. vLLM's version also carries queue lengths, KV cache usage and prefix-cache hit
counts for its loggers; we carry what something here reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from nano_v1.spec_decode.metrics import SpecDecodingStats


@dataclass(slots=True)
class SchedulerStats:
    """One step's statistics from the scheduler."""

    # Drafts verified this step; None when nothing was speculated.
    spec_decoding_stats: SpecDecodingStats | None = None
