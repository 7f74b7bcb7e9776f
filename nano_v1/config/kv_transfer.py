"""Which KV connector the engine uses, and in which role.

Mirrors vllm/config/kv_transfer.py (`KVTransferConfig`) (chapter 16).

Why it exists: with disaggregated prefill an engine produces KV for others (a prefill
engine), consumes KV made elsewhere (a decode engine), or both (offloading to CPU and
back); the connector (nano_v1/distributed/kv_transfer/) reads its role and its own
settings from here. vLLM's config also carries the buffer device and size, ranks, an IP
and a port for its NCCL-based connectors, and a module path to import unregistered
connectors from; nano_v1 keeps the fields every connector reads.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

KVProducer = Literal["kv_producer", "kv_both"]
KVConsumer = Literal["kv_consumer", "kv_both"]
KVRole = Literal[KVProducer, KVConsumer]


@dataclass
class KVTransferConfig:
    """The KV connector to build, this engine's role in KV transfers, and the connector's own settings."""

    kv_connector: str | None = None
    """Name of the KV connector (registered with KVConnectorFactory)."""
    engine_id: str | None = None
    """This engine's id in KV transfers; a fresh uuid when not given."""
    kv_role: KVRole | None = None
    """'kv_producer' (computes KV for others), 'kv_consumer' (loads KV made elsewhere) or 'kv_both'."""
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    """Settings only the chosen connector reads."""

    def __post_init__(self) -> None:
        if self.engine_id is None:
            self.engine_id = str(uuid.uuid4())
        roles = get_args(KVRole)
        if self.kv_role is not None and self.kv_role not in roles:
            raise ValueError(f"Unsupported kv_role: {self.kv_role!r}. Supported roles are {roles}")
        if self.kv_connector is not None and self.kv_role is None:
            raise ValueError(f"kv_transfer_config sets kv_connector, so it needs a kv_role: one of {roles}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError(
                f"kv_connector_extra_config must be a dict, got {self.kv_connector_extra_config!r}."
            )

    @property
    def is_kv_transfer_instance(self) -> bool:
        return self.kv_connector is not None and self.kv_role in get_args(KVRole)

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in get_args(KVProducer)

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in get_args(KVConsumer)

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)
