"""The worker's KV connector: one per process, built at start-up, reached from the attention layers.

Mirrors vllm/distributed/kv_transfer/kv_transfer_state.py (chapter 16).

Why it exists: the attention layers must call the worker's connector (`wait_for_layer_load`
before attending, `save_kv_layer` after), yet a model's `forward` takes no connector, the
same reason the forward context exists. So the worker builds its connector once, next to
the distributed groups (`ensure_kv_transfer_initialized`), and anyone in the process asks
`has_kv_transfer_group()` / `get_kv_transfer_group()`. Like the forward context, this is
global state that one module owns.

One engine with a connector per process, and no other engine beside it (the hooks of
every engine in the process would see the connector): a second engine with a connector
built while the first one's lives is refused (v0.11.0 silently gives it the first
engine's connector). The engine's shutdown (`ensure_kv_transfer_shutdown`) frees the slot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nano_v1.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from nano_v1.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

if TYPE_CHECKING:
    from nano_v1.config import VllmConfig

_KV_CONNECTOR_AGENT: KVConnectorBase_V1 | None = None


def get_kv_transfer_group() -> KVConnectorBase_V1:
    assert _KV_CONNECTOR_AGENT is not None, "the KV connector is not initialized"
    return _KV_CONNECTOR_AGENT


def has_kv_transfer_group() -> bool:
    return _KV_CONNECTOR_AGENT is not None


def ensure_kv_transfer_initialized(vllm_config: VllmConfig) -> None:
    """Build this process's worker-role connector, if the config names one."""
    global _KV_CONNECTOR_AGENT
    kv_transfer_config = vllm_config.kv_transfer_config
    if kv_transfer_config is None or not kv_transfer_config.is_kv_transfer_instance:
        return
    if _KV_CONNECTOR_AGENT is not None:
        raise ValueError(
            "This process already runs an engine with a KV connector; shut it down "
            "(LLM.llm_engine.shutdown()) before building another one."
        )
    _KV_CONNECTOR_AGENT = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER)


def ensure_kv_transfer_shutdown() -> None:
    """Shut the worker's connector down (finishing its transfers) and forget it."""
    global _KV_CONNECTOR_AGENT
    if _KV_CONNECTOR_AGENT is not None:
        _KV_CONNECTOR_AGENT.shutdown()
        _KV_CONNECTOR_AGENT = None
