"""The KV connector interface: one class, two roles, one piece of metadata per step between them.

Mirrors vllm/distributed/kv_transfer/kv_connector/v1/base.py (chapter 16).

Why it exists: disaggregated prefill (one engine prefills, another decodes) and KV
offloading (blocks copied to CPU or disk and back) both come down to two questions the
engine must ask someone else: "how much of this prompt's KV exists outside my cache?"
(then: load it into these blocks) and "this request is done: may I free its blocks now?"
(not while they are being saved or sent). A connector answers them. It is built twice
per engine, once per role:

- SCHEDULER role, inside the scheduler: `get_num_new_matched_tokens` when a waiting
  request is admitted (external tokens count as computed, like prefix-cache hits),
  `update_state_after_alloc` once it has blocks, `build_connector_meta` once per step
  (what the workers must load and save, sent in `SchedulerOutput.kv_connector_metadata`),
  `update_connector_output` with what the workers finished, `request_finished` before a
  finished request's blocks are freed (True: keep them until the send completes).
- WORKER role, inside each worker: gets the step's metadata (`bind_connector_metadata`),
  starts loads before the forward pass (`start_load_kv`), waits for a layer's KV before
  its attention (`wait_for_layer_load`), saves each layer's KV after it
  (`save_kv_layer`, `wait_for_save`), and reports finished transfers (`get_finished`),
  which reach the scheduler as `ModelRunnerOutput.kv_connector_output`.

A transfer may be asynchronous: a request whose KV is still arriving waits in
`RequestStatus.WAITING_FOR_REMOTE_KVS` with its blocks allocated, while other requests run.

What differs from v0.11.0: no KV cache events (`take_events`), connector statistics,
host-buffer copy ops or KV cache layout requirements; nano_v1 has none of them.
"""

from __future__ import annotations

import enum
import logging
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from nano_v1.config import VllmConfig
    from nano_v1.core.kv_cache_manager import KVCacheBlocks
    from nano_v1.core.sched.output import SchedulerOutput
    from nano_v1.forward_context import ForwardContext
    from nano_v1.outputs import KVConnectorOutput
    from nano_v1.request import Request

logger = logging.getLogger(__name__)


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0  # the connector inside the scheduler: decides what moves
    WORKER = 1  # the connector inside each worker: moves it


class KVConnectorMetadata(ABC):
    """What the scheduler's connector tells the workers' connectors about one step; each
    connector subclasses it with its own fields."""


class KVConnectorBase_V1(ABC):
    """A KV connector; each role calls only its own half of the methods."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole) -> None:
        self._connector_metadata: KVConnectorMetadata | None = None
        self._vllm_config = vllm_config
        self._role = role

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    # ------------------------------------------------------------------ worker role
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Take the step's metadata; the model runner calls this before every forward pass."""
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        """Drop the step's metadata; the model runner calls this after every forward pass."""
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        assert self._connector_metadata is not None, "only valid between bind and clear"
        return self._connector_metadata

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Learn the paged KV cache tensors by layer name, once, before the first step."""
        return

    @abstractmethod
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start loading the step's external KV into the paged cache, before the forward pass
        (it may run asynchronously with the model)."""

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until `layer_name`'s KV is loaded; called from that layer's attention."""

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Start saving `layer_name`'s KV from the paged cache; called from that layer's attention."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Block until every save of the step is done, so that no later step overwrites a
        block being saved; called as the forward context exits."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(ids whose asynchronous send/save finished, ids whose asynchronous load finished).

        `finished_req_ids` are the requests that finished generating since the last call; a
        finished send must belong to one of them (this call's or an earlier one's).
        """
        return None, None

    def shutdown(self) -> None:
        """Finish or cancel outstanding transfers; called when the engine shuts down."""
        return

    # ------------------------------------------------------------------ scheduler role
    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """(tokens the connector can load beyond the `num_computed_tokens` found locally,
        whether it loads them asynchronously, between steps).

        None tokens: not known yet; the scheduler asks again in a later step. The load is
        asynchronous only if there are tokens to load. It may be called several times for
        one request, so it must not change state.
        """

    @abstractmethod
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """The request got `blocks` (its local hits and its new blocks), of which
        `num_external_tokens` tokens' worth are to be loaded by the connector.

        After an asynchronous load this is called a second time, when the request is
        scheduled, with the blocks allocated then and no external tokens.
        """

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The step's metadata for the workers; resets the connector's per-step state.
        Must not change `scheduler_output`."""

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Take in what the workers' connectors reported after a step."""
        return

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A request finished; its blocks are `block_ids`, not freed yet.

        Returns (True if the blocks are being saved or sent asynchronously and must be kept
        until the request id comes back in `finished_sending`, the KV transfer params to put
        in the request's last output, for whoever fetches its KV).
        """
        return False, None
