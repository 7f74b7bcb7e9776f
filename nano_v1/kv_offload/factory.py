"""Build the offloading spec named in `kv_connector_extra_config["spec_name"]`.

Mirrors vllm/v1/kv_offload/factory.py (chapter 16).

Why it exists: OffloadingConnector is one connector for every tier; the tier (CPU
memory here; disk or a remote store elsewhere) is chosen by name, "CPUOffloadingSpec"
by default, and its module is imported only when named.

What differs from v0.11.0: a name that is not registered is a ValueError listing the
registered ones (v0.11.0 then imports `spec_module_path`; nano_v1's KV connector factory
drops that fallback too). Tests register their own specs with `register_spec`.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, ClassVar

from nano_v1.kv_offload.spec import OffloadingSpec

if TYPE_CHECKING:
    from nano_v1.config import VllmConfig

logger = logging.getLogger(__name__)


class OffloadingSpecFactory:
    # name -> (module path, class name); the module is imported only when the name is used.
    _registry: ClassVar[dict[str, tuple[str, str]]] = {}

    @classmethod
    def register_spec(cls, name: str, module_path: str, class_name: str) -> None:
        if name in cls._registry:
            raise ValueError(f"Offloading spec '{name}' is already registered.")
        cls._registry[name] = (module_path, class_name)

    @classmethod
    def create_spec(cls, config: VllmConfig) -> OffloadingSpec:
        """The spec named by `kv_connector_extra_config["spec_name"]`, built from `config`."""
        kv_transfer_config = config.kv_transfer_config
        assert kv_transfer_config is not None
        spec_name = kv_transfer_config.get_from_extra_config("spec_name", "CPUOffloadingSpec")
        if spec_name not in cls._registry:
            raise ValueError(
                f"Unsupported kv_connector_extra_config['spec_name']: {spec_name!r}; "
                f"registered specs: {sorted(cls._registry)}."
            )
        module_path, class_name = cls._registry[spec_name]
        spec_cls = getattr(importlib.import_module(module_path), class_name)
        assert issubclass(spec_cls, OffloadingSpec)
        logger.info("Creating offloading spec with name: %s", spec_name)
        return spec_cls(config)


# The specs nano_v1 has, as v0.11.0 registers its own here.
OffloadingSpecFactory.register_spec("CPUOffloadingSpec", "nano_v1.kv_offload.cpu", "CPUOffloadingSpec")
