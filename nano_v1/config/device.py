"""Which device the engine runs on.

Mirrors vllm/config/device.py (`DeviceConfig`) (chapter 01).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DeviceConfig:
    device: str = "auto"
    """auto (CUDA when there is a GPU, else the CPU), cpu, cuda or cuda:N."""

    def __post_init__(self) -> None:
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} was requested but CUDA is not available.")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}.")
