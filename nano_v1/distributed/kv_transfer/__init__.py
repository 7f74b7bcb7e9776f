"""Moving KV caches between engines and storage tiers: the KV connector API.

Mirrors vllm/distributed/kv_transfer/__init__.py (chapter 16).

Why it exists: a request's KV may be computed somewhere else (a prefill engine, a CPU or
disk store) and loaded here, or computed here and kept for someone else. The connector
(kv_connector/v1/base.py) is the one interface through which the scheduler and the
worker take part in such transfers; kv_connector/factory.py builds one by name, and
kv_transfer_state.py holds the worker's own, which the attention layers reach.
"""

from nano_v1.distributed.kv_transfer.kv_transfer_state import (
    ensure_kv_transfer_initialized,
    ensure_kv_transfer_shutdown,
    get_kv_transfer_group,
    has_kv_transfer_group,
)

__all__ = [
    "ensure_kv_transfer_initialized",
    "ensure_kv_transfer_shutdown",
    "get_kv_transfer_group",
    "has_kv_transfer_group",
]
