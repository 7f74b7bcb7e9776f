"""Which ranks this process talks to, and the collectives it runs with them.

Mirrors vllm/distributed/parallel_state.py (`GroupCoordinator`, `init_distributed_environment`,
`initialize_model_parallel`, `get_tp_group`, ...) (chapter 13).

Why it exists: a sharded layer needs two facts at construction (its rank and the number of
ranks, to know which slice of a weight it holds) and one service in `forward` (an
all-reduce or all-gather with the other ranks). Both come from the process's
tensor-parallel group, a `GroupCoordinator` that wraps torch.distributed process groups:
gloo on the CPU, NCCL between GPUs (plus a gloo group beside it for small CPU-side
messages, as vLLM keeps).

The group is one of nano_v1's few globals, as in vLLM, because the layers that need it
are built deep inside a model constructor that no engine object reaches. The worker owns
it: `nano_v1/worker/gpu_worker.py::init_worker_distributed_environment` sets it up before
the model is built, and `Worker.shutdown` tears it down. Until then a process is a world
of one: `get_tp_group()` answers with a group of one rank whose collectives return their
input, and torch.distributed is never initialised. That is the case of every engine with
tensor_parallel_size=1 and of a model built by hand (tests, the demo model's training).
vLLM initialises a one-rank process group even then; we don't, because torch.distributed
can be initialised once per process and a test process builds many engines.

Under torch.compile (chapter 08) Dynamo traces these torch.distributed calls itself, as
functional collectives. vLLM wraps its collectives in custom ops because its own
communicators (custom all-reduce, pynccl) are opaque to Dynamo; ours are not.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed

logger = logging.getLogger(__name__)

# How long a collective may wait for a peer. A dead peer is noticed sooner (its sockets
# close, the executor watches its process); this bounds a live peer that hangs.
DISTRIBUTED_TIMEOUT = timedelta(minutes=5)


class GroupCoordinator:
    """One group of ranks: who is in it, and all-reduce / all-gather among them.

    `rank` is the global rank, `rank_in_group` the position in `ranks`, `local_rank` the
    device index on this machine. A group of one creates no process group at all.
    """

    def __init__(self, group_ranks: list[list[int]], local_rank: int, torch_distributed_backend: str) -> None:
        self.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.local_rank = local_rank
        self.cpu_group: torch.distributed.ProcessGroup | None = None
        self.device_group: torch.distributed.ProcessGroup | None = None
        for ranks in group_ranks:
            device_group = cpu_group = None
            if len(ranks) > 1:
                # new_group is collective: every rank creates every group, in the same order.
                device_group = torch.distributed.new_group(ranks, backend=torch_distributed_backend)
                cpu_group = (
                    device_group
                    if torch_distributed_backend == "gloo"
                    else torch.distributed.new_group(ranks, backend="gloo")
                )
            if self.rank in ranks:
                self.ranks = ranks
                self.world_size = len(ranks)
                self.rank_in_group = ranks.index(self.rank)
                self.device_group, self.cpu_group = device_group, cpu_group

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of `input_` over the group's ranks, as a new tensor (the input is kept)."""
        if self.world_size == 1:
            return input_
        output = input_.clone()
        torch.distributed.all_reduce(output, group=self.device_group)
        return output

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `input_` concatenated along `dim`, in rank order: `[..., n, ...] -> [..., n * world_size, ...]`."""
        if self.world_size == 1:
            return input_
        if not -input_.dim() <= dim < input_.dim():
            raise ValueError(f"dim {dim} is out of range for a tensor of shape {tuple(input_.shape)}.")
        gathered = [torch.empty_like(input_) for _ in range(self.world_size)]
        torch.distributed.all_gather(gathered, input_.contiguous(), group=self.device_group)
        return torch.cat(gathered, dim=dim)

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier(group=self.cpu_group)

    def destroy(self) -> None:
        for group in {id(g): g for g in (self.device_group, self.cpu_group) if g is not None}.values():
            torch.distributed.destroy_process_group(group)
        self.device_group = self.cpu_group = None


# A world of one, for a process that never set up distribution (see the module docstring).
_SINGLE_PROCESS = GroupCoordinator([[0]], local_rank=0, torch_distributed_backend="gloo")
_WORLD: GroupCoordinator | None = None
_TP: GroupCoordinator | None = None


def get_world_group() -> GroupCoordinator:
    return _SINGLE_PROCESS if _WORLD is None else _WORLD


def get_tp_group() -> GroupCoordinator:
    """This process's tensor-parallel group; a group of one until `initialize_model_parallel` runs."""
    return _SINGLE_PROCESS if _TP is None else _TP


def get_tensor_model_parallel_world_size() -> int:
    return get_tp_group().world_size


def get_tensor_model_parallel_rank() -> int:
    return get_tp_group().rank_in_group


def init_distributed_environment(
    world_size: int, rank: int, distributed_init_method: str, local_rank: int, backend: str
) -> None:
    """Join the `world_size` ranks (torch.distributed's default group) and build the world group.

    `distributed_init_method` is `tcp://host:port` (the multiprocess executor picks a free
    port on the loopback) or `env://` (torchrun's MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE).
    """
    global _WORLD
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            backend=backend,
            init_method=distributed_init_method,
            world_size=world_size,
            rank=rank,
            timeout=DISTRIBUTED_TIMEOUT,
        )
    if _WORLD is None:
        _WORLD = GroupCoordinator([list(range(world_size))], local_rank, backend)
    elif _WORLD.world_size != world_size:
        raise RuntimeError(
            f"this process already joined a world of {_WORLD.world_size} ranks, not {world_size}."
        )


def model_parallel_is_initialized() -> bool:
    return _TP is not None


def initialize_model_parallel(tensor_model_parallel_size: int, backend: str) -> None:
    """Split the world into groups of `tensor_model_parallel_size` consecutive ranks.

    With pipeline and data parallelism (which nano_v1 leaves out) vLLM lays ranks out as
    DP x PP x TP; here the world is one tensor-parallel group.
    """
    global _TP
    world_size = torch.distributed.get_world_size()
    if world_size % tensor_model_parallel_size:
        raise ValueError(
            f"world size {world_size} is not a multiple of tensor_parallel_size {tensor_model_parallel_size}."
        )
    group_ranks = [
        list(range(start, start + tensor_model_parallel_size))
        for start in range(0, world_size, tensor_model_parallel_size)
    ]
    _TP = GroupCoordinator(group_ranks, get_world_group().local_rank, backend)
    logger.info("rank %d of %d is tensor-parallel rank %d", _TP.rank, world_size, _TP.rank_in_group)


def ensure_model_parallel_initialized(tensor_model_parallel_size: int, backend: str) -> None:
    """Initialise the groups once per process; a second engine in the same process must agree on the size."""
    if not model_parallel_is_initialized():
        initialize_model_parallel(tensor_model_parallel_size, backend)
    elif get_tensor_model_parallel_world_size() != tensor_model_parallel_size:
        raise RuntimeError(
            f"this process's tensor-parallel group has {get_tensor_model_parallel_world_size()} ranks, "
            f"not tensor_parallel_size={tensor_model_parallel_size}."
        )


def destroy_model_parallel() -> None:
    global _TP
    if _TP is not None:
        _TP.destroy()
    _TP = None


def destroy_distributed_environment() -> None:
    global _WORLD
    if _WORLD is not None:
        _WORLD.destroy()
    _WORLD = None
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
