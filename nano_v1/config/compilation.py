"""torch.compile and CUDA graph settings, with vLLM's names.

Mirrors vllm/config/compilation.py (`CompilationConfig`, `CompilationLevel`, `CUDAGraphMode`)
(chapter 08).
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import json
from dataclasses import dataclass, field


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
      that reads all its metadata from device buffers (FLASH_ATTN or TRITON_ATTN).
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
        self, device: str, enforce_eager: bool, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        """Fill the unset fields and check the combination (vLLM: VllmConfig.__post_init__).

        Whether the attention backend can run inside a FULL graph is checked later, by the
        model runner, once the backend is known (`GPUModelRunner.initialize_cudagraph_capture`, vLLM's name).
        """
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
        self.cudagraph_mode = self._resolve_cudagraph_mode(on_cuda, enforce_eager)
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

    def _resolve_cudagraph_mode(self, on_cuda: bool, enforce_eager: bool) -> CUDAGraphMode:
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
        return mode

    def pad_for_cudagraph(self, num_tokens: int) -> int:
        """The smallest capture size >= num_tokens (which must be <= max_capture_size)."""
        assert 0 < num_tokens <= self.max_capture_size
        return self.cudagraph_capture_sizes[bisect.bisect_left(self.cudagraph_capture_sizes, num_tokens)]
