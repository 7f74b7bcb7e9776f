"""The model runner's part in KV transfers: bind the step's connector metadata, collect what finished.

Mirrors vllm/v1/worker/kv_connector_model_runner_mixin.py (chapter 16).

Why it exists: around every forward pass the worker's connector needs the same four
calls, whatever the connector: take the scheduler's metadata for the step
(`bind_connector_metadata`), start loading external KV (`start_load_kv`), wait until the
step's saves are done (`wait_for_save`, so that no later step overwrites a block still
being saved), and report the transfers that finished (`get_finished`), which travel back to
the scheduler as `ModelRunnerOutput.kv_connector_output`. The mixin keeps them out of
`execute_model`: one context manager around the forward pass (`maybe_get_kv_connector_output`),
and a step with no tokens but pending transfers still drives the connector
(`kv_connector_no_forward`). Between them the attention layers call the per-layer hooks
(nano_v1/attention/layer.py).

What differs from v0.11.0: no connector statistics; the worker shuts the connector down
itself (nano_v1/worker/gpu_worker.py) rather than through this mixin.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING

from nano_v1.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
from nano_v1.forward_context import get_forward_context, set_forward_context
from nano_v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput, ModelRunnerOutput

if TYPE_CHECKING:
    from nano_v1.core.sched.output import SchedulerOutput


class KVConnectorModelRunnerMixin:
    """KV connector calls for a model runner; every method is a no-op without a connector."""

    @staticmethod
    def maybe_setup_kv_connector(scheduler_output: SchedulerOutput) -> None:
        """Give the connector the step's metadata and start its loads (inside the forward context)."""
        if has_kv_transfer_group():
            kv_connector = get_kv_transfer_group()
            assert scheduler_output.kv_connector_metadata is not None, "a connector needs the step's metadata"
            kv_connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
            # Loads may run in the background, for requests not even in this step's batch.
            kv_connector.start_load_kv(get_forward_context())

    @staticmethod
    def maybe_wait_for_kv_save() -> None:
        if has_kv_transfer_group():
            get_kv_transfer_group().wait_for_save()

    @staticmethod
    def get_finished_kv_transfers(scheduler_output: SchedulerOutput) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose KV was sent or saved, requests whose KV was loaded) since the last call."""
        if has_kv_transfer_group():
            return get_kv_transfer_group().get_finished(scheduler_output.finished_req_ids)
        return None, None

    @staticmethod
    def kv_connector_no_forward(scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """A step with no tokens to compute still lets the connector load, and report what finished."""
        with (
            set_forward_context(None),
            KVConnectorModelRunnerMixin._get_kv_connector_output(
                scheduler_output, wait_for_save=False
            ) as kv_connector_output,
        ):
            pass
        if kv_connector_output.is_empty():
            return EMPTY_MODEL_RUNNER_OUTPUT
        output = copy.copy(EMPTY_MODEL_RUNNER_OUTPUT)
        output.kv_connector_output = kv_connector_output
        return output

    @staticmethod
    def maybe_get_kv_connector_output(
        scheduler_output: SchedulerOutput,
    ) -> AbstractContextManager[KVConnectorOutput | None]:
        """Around the forward pass (inside the forward context): the connector's whole step,
        yielding the output it fills as the block exits; None without a connector."""
        if has_kv_transfer_group():
            return KVConnectorModelRunnerMixin._get_kv_connector_output(scheduler_output)
        return nullcontext()

    @staticmethod
    @contextmanager
    def _get_kv_connector_output(
        scheduler_output: SchedulerOutput, wait_for_save: bool = True
    ) -> Iterator[KVConnectorOutput]:
        output = KVConnectorOutput()
        KVConnectorModelRunnerMixin.maybe_setup_kv_connector(scheduler_output)
        try:
            yield output
        finally:
            if wait_for_save:
                KVConnectorModelRunnerMixin.maybe_wait_for_kv_save()
            output.finished_sending, output.finished_recving = (
                KVConnectorModelRunnerMixin.get_finished_kv_transfers(scheduler_output)
            )
            get_kv_transfer_group().clear_connector_metadata()
