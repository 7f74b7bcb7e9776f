"""torch.distributed for tensor parallelism: the process's groups and their collectives.

Mirrors vllm/distributed/__init__.py (chapter 13): `parallel_state.py` (who is in the
group), `communication_op.py` (what layers call), `device_communicators/shm_broadcast.py`
(the shared-memory queue the multiprocess executor broadcasts each step through).
"""

from nano_v1.distributed.communication_op import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from nano_v1.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
)

__all__ = [
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tp_group",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
]
