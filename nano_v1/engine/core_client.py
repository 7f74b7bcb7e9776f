"""How the frontend reaches the engine core.

Mirrors vllm/v1/engine/core_client.py (chapter 09).

Why an interface: `LLMEngine` talks to "an engine core" through four calls
(add_request, get_output, abort_requests, shutdown). `InprocClient` calls an
`EngineCore` in the same process; chapter 09 adds clients that reach a core running in
its own process over ZMQ, without changing the frontend.
"""

from __future__ import annotations

from nano_v1.config import EngineConfig
from nano_v1.engine import EngineCoreOutputs, EngineCoreRequest
from nano_v1.engine.core import EngineCore


class EngineCoreClient:
    """The frontend's handle on an engine core."""

    @staticmethod
    def make_client(engine_config: EngineConfig) -> "EngineCoreClient":
        return InprocClient(engine_config)

    def add_request(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError

    def get_output(self) -> EngineCoreOutputs:
        raise NotImplementedError

    def abort_requests(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        pass


class InprocClient(EngineCoreClient):
    """The engine core in this process: `get_output()` runs one step."""

    def __init__(self, engine_config: EngineConfig) -> None:
        self.engine_core = EngineCore(engine_config)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)
