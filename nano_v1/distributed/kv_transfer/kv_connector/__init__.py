"""KV connectors: the interface (v1/base.py) and the factory that builds one by name (factory.py).

Mirrors vllm/distributed/kv_transfer/kv_connector/__init__.py (chapter 16).
"""
