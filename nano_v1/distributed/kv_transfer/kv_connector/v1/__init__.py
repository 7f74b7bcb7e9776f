"""The v1 KV connector interface, split into its scheduler role and its worker role.

Mirrors vllm/distributed/kv_transfer/kv_connector/v1/__init__.py (chapter 16).
"""

from nano_v1.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

__all__ = ["KVConnectorBase_V1", "KVConnectorRole"]
