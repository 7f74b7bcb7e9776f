"""Build a KV connector by the name in `KVTransferConfig.kv_connector`.

Mirrors vllm/distributed/kv_transfer/kv_connector/factory.py (chapter 16).

Why it exists: the engine names its connector in its configuration, and the scheduler
and each worker build their own instance of it (one per role). A connector registers a
name with the module and class that define it, so that only the named connector's module
is ever imported.

What differs from v0.11.0: a name that is not registered is an error listing the
registered ones (v0.11.0 falls back to `kv_connector_module_path`, which nano_v1 does
not have). The connectors nano_v1 has are registered at the bottom of this module.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

from nano_v1.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

if TYPE_CHECKING:
    from nano_v1.config import VllmConfig
    from nano_v1.config.kv_transfer import KVTransferConfig

logger = logging.getLogger(__name__)


class KVConnectorFactory:
    # name -> a loader that imports the connector's module and returns its class.
    _registry: ClassVar[dict[str, Callable[[], type[KVConnectorBase_V1]]]] = {}

    @classmethod
    def register_connector(cls, name: str, module_path: str, class_name: str) -> None:
        """Make `name` build `module_path.class_name`; the module is imported only when used."""
        if name in cls._registry:
            raise ValueError(f"Connector '{name}' is already registered.")

        def loader() -> type[KVConnectorBase_V1]:
            return getattr(importlib.import_module(module_path), class_name)

        cls._registry[name] = loader

    @classmethod
    def create_connector(cls, config: VllmConfig, role: KVConnectorRole) -> KVConnectorBase_V1:
        """The connector named by `config.kv_transfer_config`, for one role."""
        kv_transfer_config = config.kv_transfer_config
        connector_cls = cls.get_connector_class(kv_transfer_config)
        logger.info(
            "Creating v1 connector with name: %s and engine_id: %s",
            connector_cls.__name__,
            kv_transfer_config.engine_id,
        )
        return connector_cls(config, role)

    @classmethod
    def get_connector_class(cls, kv_transfer_config: KVTransferConfig) -> type[KVConnectorBase_V1]:
        connector_name = kv_transfer_config.kv_connector
        if connector_name not in cls._registry:
            raise ValueError(
                f"Unsupported connector type: {connector_name!r}; registered connectors: {sorted(cls._registry)}."
            )
        return cls._registry[connector_name]()


# The connectors nano_v1 has, as v0.11.0 registers its own here.
KVConnectorFactory.register_connector(
    "SharedStorageConnector",
    "nano_v1.distributed.kv_transfer.kv_connector.v1.shared_storage_connector",
    "SharedStorageConnector",
)
KVConnectorFactory.register_connector(
    "OffloadingConnector",
    "nano_v1.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    "OffloadingConnector",
)
