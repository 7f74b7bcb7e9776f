"""Environment variables that switch engine behaviour, with vLLM's names.

Mirrors vllm/envs.py (chapter 09).

Why environment variables: these choose how the engine is laid out in processes, which
the code under `LLM(...)` decides long before any argument could reach it (and vLLM's
users already know the names). Each is read when it is needed, not at import.

What differs from v0.11.0: NANO_V1_HTTP_TIMEOUT_REQUEST is nano_v1's own, hence its prefix.
"""

from __future__ import annotations

import os


def enable_v1_multiprocessing() -> bool:
    """VLLM_ENABLE_V1_MULTIPROCESSING (default 1): run the engine core in its own process."""
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") not in ("0", "false", "False")


def worker_multiproc_method() -> str | None:
    """VLLM_WORKER_MULTIPROC_METHOD: how to start the engine-core process (None: the engine chooses)."""
    method = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
    if method not in (None, "fork", "forkserver", "spawn"):
        raise ValueError(
            f"VLLM_WORKER_MULTIPROC_METHOD must be 'fork', 'forkserver' or 'spawn', got {method!r}."
        )
    return method


def attention_backend() -> str | None:
    """VLLM_ATTENTION_BACKEND: the attention backend when `attention_backend` is not given (chapter 06)."""
    return os.environ.get("VLLM_ATTENTION_BACKEND") or None


def rpc_timeout_s() -> float:
    """VLLM_RPC_TIMEOUT (milliseconds, default 10000): how long a utility call waits for the engine core."""
    return int(os.environ.get("VLLM_RPC_TIMEOUT", "10000")) / 1000


def api_key() -> str | None:
    """VLLM_API_KEY: the key the API server requires (`--api-key` takes precedence)."""
    return os.environ.get("VLLM_API_KEY") or None


def log_stats_interval_s() -> float:
    """VLLM_LOG_STATS_INTERVAL (seconds, default 10): how often the server logs its one-line stats."""
    interval = float(os.environ.get("VLLM_LOG_STATS_INTERVAL", "10"))
    return interval if interval > 0 else 10.0


def http_timeout_keep_alive_s() -> int:
    """VLLM_HTTP_TIMEOUT_KEEP_ALIVE (seconds, default 5): when the server closes an idle connection."""
    return int(os.environ.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "5"))


def http_timeout_request_s() -> float:
    """NANO_V1_HTTP_TIMEOUT_REQUEST (seconds, default 60): how long a request may take to arrive, from
    its first byte to its body's end, before the server closes the connection. nano_v1's own (vLLM
    has none)."""
    return float(os.environ.get("NANO_V1_HTTP_TIMEOUT_REQUEST", "60"))
