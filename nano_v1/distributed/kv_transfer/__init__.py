"""Moving KV caches between engines and storage tiers: the KV connector API.

Mirrors vllm/distributed/kv_transfer/__init__.py (chapter 16).

Why it exists: a request's KV may be computed somewhere else (a prefill engine, a CPU or
disk store) and loaded here, or computed here and kept for someone else. The connector
(kv_connector/v1/base.py) is the one interface through which the scheduler and the
worker take part in such transfers; kv_connector/factory.py builds one by name.
"""
