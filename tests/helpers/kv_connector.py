"""A KV connector for scheduler tests (chapter 16): it records every call and answers as a test says.

`RecordingConnector`, registered with `KVConnectorFactory` under its class name when this
module is imported, plays the scheduler role of a real connector without moving any KV:

- external hits: `num_matched_tokens` tokens past the local prefix-cache hit of every
  request, or `num_matched_tokens_by_req[request_id]` for one (a store that keeps the KV,
  as vLLM's SharedStorageConnector; the tests of v0.11.0's test_scheduler.py mock this
  answer), loaded synchronously, in the step that computes the rest of the prompt; None
  means "not known yet";
- remote prefill: a request whose `kv_transfer_params` has `do_remote_prefill` has its
  whole prompt's KV on another engine and loads it asynchronously, once (vLLM's
  NixlConnector): `get_num_new_matched_tokens` answers (prompt tokens not hit locally, True);
- remote decode: a request whose `kv_transfer_params` has `do_remote_decode` and that
  finishes by length keeps its blocks while another engine fetches them (NixlConnector):
  `request_finished` answers (True if it has blocks, the params naming them).

Its metadata lists the requests whose KV the workers load in the step.

`ParamsSharedStorageConnector` (registered under its class name too) is a whole connector,
workers included, whose finished requests report KV transfer params, for the tests of
`RequestOutput.kv_transfer_params`.
"""

from __future__ import annotations

from typing import Any

from nano_v1.config import VllmConfig
from nano_v1.core.kv_cache_manager import KVCacheBlocks
from nano_v1.core.sched.output import SchedulerOutput
from nano_v1.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from nano_v1.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from nano_v1.distributed.kv_transfer.kv_connector.v1.shared_storage_connector import SharedStorageConnector
from nano_v1.outputs import KVConnectorOutput
from nano_v1.request import Request, RequestStatus


class RecordingConnectorMetadata(KVConnectorMetadata):
    def __init__(self, requests: list[str]) -> None:
        self.requests = requests  # ids whose KV the workers load this step


class RecordingConnector(KVConnectorBase_V1):
    """The scheduler role of a KV connector, scripted by the test; `calls` records every call."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole) -> None:
        super().__init__(vllm_config, role)
        self.num_matched_tokens: int | None = 0
        self.num_matched_tokens_by_req: dict[str, int | None] = {}
        self.calls: list[tuple[Any, ...]] = []
        self._reqs_need_load: list[str] = []

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        self.calls.append(("get_num_new_matched_tokens", request.request_id, num_computed_tokens))
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            count = request.num_prompt_tokens - num_computed_tokens
            if count > 0:
                return count, True
        return self.num_matched_tokens_by_req.get(request.request_id, self.num_matched_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.calls.append(
            ("update_state_after_alloc", request.request_id, [len(group) for group in blocks.blocks], num_external_tokens)
        )
        if num_external_tokens > 0:
            self._reqs_need_load.append(request.request_id)
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            params["do_remote_prefill"] = False  # one transfer per request

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> RecordingConnectorMetadata:
        self.calls.append(("build_connector_meta", sorted(scheduler_output.num_scheduled_tokens)))
        meta = RecordingConnectorMetadata(self._reqs_need_load)
        self._reqs_need_load = []
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.calls.append(
            ("update_connector_output", connector_output.finished_sending, connector_output.finished_recving)
        )

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.calls.append(("request_finished", request.request_id, list(block_ids)))
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode") or request.status != RequestStatus.FINISHED_LENGTH_CAPPED:
            return False, None
        return len(block_ids) > 0, {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": block_ids}

    # The worker role is not played: these tests have no workers.
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        raise NotImplementedError("RecordingConnector plays the scheduler role only")

    def wait_for_layer_load(self, layer_name: str) -> None:
        raise NotImplementedError("RecordingConnector plays the scheduler role only")

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        raise NotImplementedError("RecordingConnector plays the scheduler role only")

    def wait_for_save(self) -> None:
        raise NotImplementedError("RecordingConnector plays the scheduler role only")


KVConnectorFactory.register_connector("RecordingConnector", __name__, RecordingConnector.__name__)


class ParamsSharedStorageConnector(SharedStorageConnector):
    """SharedStorageConnector whose `request_finished` answers params for a remote decode, as
    NixlConnector's does: a request with `do_remote_decode` that finishes gets
    {"do_remote_prefill": True, "remote_block_ids": its block ids, "num_prompt_tokens": ...}.
    Its blocks are freed at once (nothing is sent). What `RequestOutput.kv_transfer_params`
    must carry to the user."""

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode"):
            return False, None
        return False, {
            "do_remote_prefill": True,
            "remote_block_ids": list(block_ids),
            "num_prompt_tokens": request.num_prompt_tokens,
        }


KVConnectorFactory.register_connector(
    "ParamsSharedStorageConnector", __name__, ParamsSharedStorageConnector.__name__
)
