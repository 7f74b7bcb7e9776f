"""Engine configuration: a few small dataclasses, and the flat engine arguments that build them.

Mirrors vllm/config/ (ModelConfig, CacheConfig, SchedulerConfig, DeviceConfig, VllmConfig)
and vllm/engine/arg_utils.py (EngineArgs) (chapter 01).

Why two layers: users and the CLI speak in flat keyword arguments with vLLM's names
(`LLM(model, block_size=16, max_num_seqs=64)`); the engine's parts each want only their
own slice. `EngineArgs.create_engine_config()` is the single place that checks the
arguments and splits them into the slices.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nano_v1.model_executor.models import SUPPORTED_ARCHITECTURES

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


def _default_model() -> str:
    """The bundled demo checkpoint, used when no model is given."""
    from nano_v1.demo_model import DEMO_MODEL_PATH

    return str(DEMO_MODEL_PATH)


@dataclass
class ModelConfig:
    """Which checkpoint, in which dtype, for how long a context."""

    model: str
    tokenizer: str | None = None
    dtype: str | torch.dtype = "auto"
    seed: int = 0
    max_model_len: int | None = None
    load_format: str = "auto"  # "auto" (safetensors) | "dummy" (random weights from config.json)
    enforce_eager: bool = False
    # Which kernels attend (chapters 06 and 07): "torch" (the plain-PyTorch reference) or
    # "triton"; None picks Triton on CUDA and the reference on CPU (resolved by EngineArgs).
    attention_backend: str | None = None
    # Never run cascade attention over a shared prefix, even where the model says it pays (chapter 07).
    disable_cascade_attn: bool = False
    hf_config: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        config_path = Path(self.model) / "config.json"
        if not config_path.is_file():
            raise ValueError(
                f"model {self.model!r} is not a local checkpoint directory (no config.json there). "
                "nano_v1 never downloads: pass the path of a directory written by save_pretrained."
            )
        try:
            raw = json.loads(config_path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_path} is not valid JSON: {e}") from e
        archs = raw.get("architectures") or []
        if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise ValueError(
                f"model {self.model!r} has architectures {archs}; nano_v1 supports "
                f"{sorted(SUPPORTED_ARCHITECTURES)}."
            )
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format must be 'auto', 'safetensors' or 'dummy', got {self.load_format!r}.")
        from transformers import AutoConfig

        self.hf_config = AutoConfig.from_pretrained(self.model)
        self.tokenizer = self.tokenizer or self.model
        self.dtype = self._resolve_dtype(self.dtype)
        limit = self.hf_config.max_position_embeddings
        if self.max_model_len is None:
            self.max_model_len = limit
        elif not (isinstance(self.max_model_len, int) and 0 < self.max_model_len <= limit):
            raise ValueError(
                f"max_model_len must be a positive integer <= the model's max_position_embeddings "
                f"({limit}), got {self.max_model_len!r}."
            )

    def _resolve_dtype(self, dtype: str | torch.dtype) -> torch.dtype:
        if isinstance(dtype, torch.dtype):
            return dtype
        if dtype == "auto":
            # Like vLLM: the checkpoint's dtype, but float32 checkpoints stay float32.
            name = str(getattr(self.hf_config, "dtype", None) or "float32")
            return _DTYPES.get(name.replace("torch.", ""), torch.float32)
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}.")
        return _DTYPES[dtype]

    # Shape accessors, named as in vLLM's ModelConfig.
    def get_vocab_size(self) -> int:
        return self.hf_config.vocab_size

    def get_hidden_size(self) -> int:
        return self.hf_config.hidden_size

    def get_num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    def get_num_attention_heads(self) -> int:
        return self.hf_config.num_attention_heads

    def get_num_kv_heads(self) -> int:
        return getattr(self.hf_config, "num_key_value_heads", None) or self.hf_config.num_attention_heads

    def get_head_size(self) -> int:
        head_dim = getattr(self.hf_config, "head_dim", None)
        return head_dim or self.hf_config.hidden_size // self.hf_config.num_attention_heads


@dataclass
class CacheConfig:
    """How the paged KV cache is laid out and sized (chapters 02 and 03)."""

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    # On CPU there is nothing to profile against: the KV cache gets this many bytes.
    kv_cache_memory_bytes: int = 1 << 30
    enable_prefix_caching: bool = True
    # Set by the worker once the cache is sized.
    num_gpu_blocks: int | None = None


@dataclass
class SchedulerConfig:
    """The one token budget and its companions (chapter 04)."""

    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int = 0  # copied from ModelConfig
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0: a single request may take the whole budget
    policy: str = "fcfs"  # "fcfs" | "priority"


@dataclass
class DeviceConfig:
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"

    def __post_init__(self) -> None:
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} was requested but CUDA is not available.")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}.")


class CompilationLevel:
    """How much of torch.compile runs (vLLM's `level`, renamed `mode` in later versions).

    nano_v1 implements the two ends: no compilation, or vLLM's piecewise compilation
    (Dynamo traces the model once, the graph is split at attention, chapter 08).
    """

    NO_COMPILATION = 0
    PIECEWISE = 3


class CUDAGraphMode(enum.Enum):
    """Which CUDA graphs the model runner captures and replays (chapter 08).

    NONE: every kernel launched from Python, every step.
    PIECEWISE: the dense layers between attention calls are graphs, attention runs eagerly,
      so one set of graphs serves any mix of prefills and decodes up to the largest size.
    FULL: the whole forward pass of a pure decode step (one token per request) is one
      graph, attention included; other steps run without graphs. Needs an attention kernel
      that reads all its metadata from device buffers (attention_backend="triton").
    FULL_AND_PIECEWISE: FULL for pure decode steps, PIECEWISE for the rest (vLLM's default).
    """

    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_AND_PIECEWISE = 3

    def decode_mode(self) -> CUDAGraphMode:
        """The graph a uniform decode step (one query per request) runs under."""
        return CUDAGraphMode.FULL if self in (CUDAGraphMode.FULL, CUDAGraphMode.FULL_AND_PIECEWISE) else self

    def mixed_mode(self) -> CUDAGraphMode:
        """The graph any other step (prefills, chunks, mixed batches) runs under."""
        if self == CUDAGraphMode.FULL:
            return CUDAGraphMode.NONE
        return CUDAGraphMode.PIECEWISE if self == CUDAGraphMode.FULL_AND_PIECEWISE else self

    def has_full_cudagraphs(self) -> bool:
        return self.decode_mode() == CUDAGraphMode.FULL

    def requires_piecewise_compilation(self) -> bool:
        return CUDAGraphMode.PIECEWISE in (self.decode_mode(), self.mixed_mode())


# The attention op the model graph is split at (registered by nano_v1/attention/layer.py).
ATTENTION_SPLITTING_OPS = ["nano_v1.unified_attention_with_output"]


@dataclass
class CompilationConfig:
    """torch.compile and CUDA graph settings, with vLLM's names (vllm/config/compilation.py).

    Accepted by `LLM(compilation_config=...)` as this class, a dict of its fields (`mode`
    is an alias of `level`; `cudagraph_mode` may be a name such as "PIECEWISE"), an int
    level, or, from the CLI, either as JSON (`--compilation-config '{"level": 3}'`).
    Unset fields are resolved by `resolve()` from the device and `enforce_eager`: on CUDA,
    level 3 with PIECEWISE graphs; on CPU, no compilation (level 3 may be asked for and
    runs the split graph without capture); `enforce_eager` turns everything off.
    """

    level: int | None = None
    splitting_ops: list[str] | None = None
    # Compile each dense piece with Inductor. Off by default: the graphs remove the launch
    # overhead on their own, and Inductor's fusions cost compile time at every start-up.
    use_inductor: bool = False
    cudagraph_mode: CUDAGraphMode | str | None = None
    # Batch sizes (tokens per step) that get a graph; a step is padded up to the next one.
    cudagraph_capture_sizes: list[int] | None = None
    max_capture_size: int = field(default=0, init=False)

    @classmethod
    def from_arg(cls, value: CompilationConfig | dict | int | str | None) -> CompilationConfig:
        """The config from `LLM(compilation_config=...)`: an instance, a dict, an int level, JSON, or None."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"compilation_config {value!r} is neither an int level nor a JSON object: {e}"
                ) from None
        if value is None:
            return cls()
        if isinstance(value, CompilationConfig):
            return dataclasses.replace(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(level=value)
        if isinstance(value, dict):
            kwargs = dict(value)
            if "mode" in kwargs:
                if "level" in kwargs:
                    raise ValueError("compilation_config: give 'level' or its alias 'mode', not both.")
                kwargs["level"] = kwargs.pop("mode")
            known = {f.name for f in dataclasses.fields(cls) if f.init}
            unknown = sorted(set(kwargs) - known)
            if unknown:
                raise ValueError(
                    f"compilation_config has unknown key(s) {unknown}; known: {sorted(known)} and 'mode'."
                )
            return cls(**kwargs)
        raise ValueError(
            f"compilation_config must be a CompilationConfig, a dict or an int level, got {value!r}."
        )

    def resolve(
        self,
        device: str,
        enforce_eager: bool,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        attention_backend: str,
    ) -> None:
        """Fill the unset fields and check the combination (vLLM: VllmConfig.__post_init__)."""
        on_cuda = device.startswith("cuda")
        if self.level is None:
            self.level = (
                CompilationLevel.PIECEWISE
                if on_cuda and not enforce_eager
                else CompilationLevel.NO_COMPILATION
            )
        if enforce_eager:
            self.level = CompilationLevel.NO_COMPILATION
        if self.level not in (CompilationLevel.NO_COMPILATION, CompilationLevel.PIECEWISE):
            raise ValueError(f"compilation level must be 0 (none) or 3 (piecewise), got {self.level!r}.")
        if self.splitting_ops is None:
            self.splitting_ops = list(ATTENTION_SPLITTING_OPS)
        self.cudagraph_mode = self._resolve_cudagraph_mode(on_cuda, enforce_eager, attention_backend)
        if self.cudagraph_mode == CUDAGraphMode.NONE:
            self.cudagraph_capture_sizes = []
        elif self.cudagraph_capture_sizes is None:
            # vLLM's default ladder: 1, 2, 4, then every multiple of 8 up to twice max_num_seqs (at most 512).
            largest = min(2 * max_num_seqs, 512)
            self.cudagraph_capture_sizes = [1, 2, 4] + list(range(8, largest + 1, 8))
        if any(not (isinstance(s, int) and s > 0) for s in self.cudagraph_capture_sizes):
            raise ValueError(
                f"cudagraph_capture_sizes must be positive integers, got {self.cudagraph_capture_sizes!r}."
            )
        # Ascending; a step never has more than max_num_batched_tokens tokens to pad.
        self.cudagraph_capture_sizes = sorted(
            {s for s in self.cudagraph_capture_sizes if s <= max_num_batched_tokens}
        )
        self.max_capture_size = self.cudagraph_capture_sizes[-1] if self.cudagraph_capture_sizes else 0

    def _resolve_cudagraph_mode(
        self, on_cuda: bool, enforce_eager: bool, attention_backend: str
    ) -> CUDAGraphMode:
        mode = self.cudagraph_mode
        if isinstance(mode, str):
            if mode.upper() not in CUDAGraphMode.__members__:
                raise ValueError(
                    f"cudagraph_mode must be one of {list(CUDAGraphMode.__members__)}, got {mode!r}."
                )
            mode = CUDAGraphMode[mode.upper()]
        if enforce_eager:
            return CUDAGraphMode.NONE
        if mode is None:
            # PIECEWISE rather than vLLM's FULL_AND_PIECEWISE: one set of graphs for every
            # step, and the attention backend stays free to plan on the host.
            mode = (
                CUDAGraphMode.PIECEWISE
                if on_cuda and self.level == CompilationLevel.PIECEWISE
                else CUDAGraphMode.NONE
            )
        if mode == CUDAGraphMode.NONE:
            return mode
        if not on_cuda:
            raise ValueError(
                f"cudagraph_mode={mode.name} needs a CUDA device; on the CPU use cudagraph_mode='NONE'."
            )
        if mode.requires_piecewise_compilation() and self.level != CompilationLevel.PIECEWISE:
            raise ValueError(
                f"cudagraph_mode={mode.name} graphs the pieces of the split model: it needs level 3."
            )
        if mode.has_full_cudagraphs() and attention_backend != "triton":
            # The reference attention plans each step on the host, which a graph cannot replay.
            logger.warning("cudagraph_mode=%s needs attention_backend='triton'; using PIECEWISE", mode.name)
            mode = CUDAGraphMode.PIECEWISE if self.level == CompilationLevel.PIECEWISE else CUDAGraphMode.NONE
        return mode

    def pad_for_cudagraph(self, num_tokens: int) -> int:
        """The smallest capture size >= num_tokens (which must be <= max_capture_size)."""
        assert 0 < num_tokens <= self.max_capture_size
        return self.cudagraph_capture_sizes[bisect.bisect_left(self.cudagraph_capture_sizes, num_tokens)]


@dataclass
class SpeculativeConfig:
    """Speculative decoding with an n-gram (prompt lookup) proposer (chapter 10).

    Mirrors vllm/config/speculative.py, which also knows draft models, EAGLE and MTP; we
    keep only `method="ngram"`. Each step a request verifies up to
    `num_speculative_tokens` drafts, copied from what followed the latest earlier
    occurrence of its last n tokens, n from `prompt_lookup_max` down to `prompt_lookup_min`.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(f"speculative_config method must be 'ngram' (the only proposer here), got {self.method!r}.")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and value > 0):
                raise ValueError(f"speculative_config {name} must be a positive integer, got {value!r}.")
        # vLLM's defaults: one bound given means both; none means 5.
        if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
            self.prompt_lookup_min = self.prompt_lookup_max = 5
        self.prompt_lookup_min = self.prompt_lookup_min or self.prompt_lookup_max
        self.prompt_lookup_max = self.prompt_lookup_max or self.prompt_lookup_min
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})."
            )

    @classmethod
    def from_dict(cls, config: dict[str, Any] | str) -> "SpeculativeConfig":
        """From `LLM(speculative_config={...})` or the CLI's JSON string."""
        if isinstance(config, str):
            try:
                config = json.loads(config)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from e
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict, got {config!r}.")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config key(s) {unknown}; nano_v1 accepts {sorted(known)}.")
        return cls(**config)


@dataclass
class EngineConfig:
    """Everything the engine needs, one slice per part (vLLM: VllmConfig)."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device_config: DeviceConfig
    # Built by EngineArgs.create_engine_config; the default is no compilation and no graphs.
    compilation_config: CompilationConfig = field(
        default_factory=lambda: CompilationConfig(
            level=CompilationLevel.NO_COMPILATION, cudagraph_mode=CUDAGraphMode.NONE, cudagraph_capture_sizes=[]
        )
    )
    speculative_config: SpeculativeConfig | None = None


@dataclass
class EngineArgs:
    """The flat keyword arguments of `LLM(...)` and the CLI, with vLLM's names."""

    model: str = field(default_factory=_default_model)
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    load_format: str = "auto"
    enforce_eager: bool = False
    attention_backend: str | None = None
    disable_cascade_attn: bool = False
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int = 1 << 30
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    compilation_config: CompilationConfig | dict | int | str | None = None
    speculative_config: dict[str, Any] | None = None

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; nano_v1 accepts {sorted(known)}.")
        return cls(**kwargs)

    def create_engine_config(self) -> EngineConfig:
        device_config = DeviceConfig(self.device)
        attention_backend = self.attention_backend
        if attention_backend is None:
            attention_backend = "triton" if device_config.device.startswith("cuda") else "torch"
        if attention_backend not in ("torch", "triton"):
            raise ValueError(f"attention_backend must be 'torch' or 'triton', got {attention_backend!r}.")
        model_config = ModelConfig(
            model=os.fspath(self.model),
            tokenizer=self.tokenizer,
            dtype=self.dtype,
            seed=self.seed,
            max_model_len=self.max_model_len,
            load_format=self.load_format,
            enforce_eager=self.enforce_eager,
            attention_backend=attention_backend,
            disable_cascade_attn=self.disable_cascade_attn,
        )
        self._check_positive("block_size", self.block_size)
        self._check_positive("max_num_seqs", self.max_num_seqs)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}.")
        if self.num_gpu_blocks_override is not None:
            self._check_positive("num_gpu_blocks_override", self.num_gpu_blocks_override)
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}.")
        max_model_len = model_config.max_model_len
        max_num_batched_tokens = self.max_num_batched_tokens
        if max_num_batched_tokens is None:
            # With chunked prefill a long prompt is split, so the budget can be smaller than a
            # context; without it, the whole prompt must fit into one step.
            max_num_batched_tokens = 8192 if self.enable_chunked_prefill else max(8192, max_model_len)
        self._check_positive("max_num_batched_tokens", max_num_batched_tokens)
        if not self.enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) is smaller than max_model_len "
                f"({max_model_len}) with chunked prefill disabled: long prompts could never be scheduled."
            )
        compilation_config = CompilationConfig.from_arg(self.compilation_config)
        compilation_config.resolve(
            device_config.device, self.enforce_eager, self.max_num_seqs, max_num_batched_tokens,
            model_config.attention_backend,
        )
        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                gpu_memory_utilization=self.gpu_memory_utilization,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                enable_prefix_caching=self.enable_prefix_caching,
            ),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs,
                max_model_len=max_model_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                policy=self.scheduling_policy,
            ),
            device_config=device_config,
            compilation_config=compilation_config,
            speculative_config=None
            if self.speculative_config is None
            else SpeculativeConfig.from_dict(self.speculative_config),
        )

    @staticmethod
    def _check_positive(name: str, value: Any) -> None:
        if not (isinstance(value, int) and value > 0):
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
