"""Engine statistics: what the engine core reports each step, and the frontend's view of it.

Mirrors vllm/v1/metrics/ (chapter 10).
"""
