"""How ranks exchange data beyond torch.distributed's collectives (chapter 13): the shared-memory message queue."""
