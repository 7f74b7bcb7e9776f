"""Speculative decoding: draft proposers, verification metadata and acceptance statistics (chapter 10).

Mirrors vllm/v1/spec_decode/.
"""
