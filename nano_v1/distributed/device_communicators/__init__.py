"""How ranks exchange data beyond torch.distributed's collectives: the shared-memory message queue.

Mirrors vllm/distributed/device_communicators/__init__.py (chapter 13); of vLLM's
communicators, nano_v1 keeps only `shm_broadcast.py`.
"""
