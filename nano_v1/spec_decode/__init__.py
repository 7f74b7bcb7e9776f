"""Speculative decoding: draft proposers, verification metadata and acceptance statistics (chapter 10)."""
