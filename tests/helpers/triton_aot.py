"""Compile every Triton kernel variant the engine launches for Hopper (sm_90), ahead of time; report what each uses.

Run by tests/test_triton_aot.py in a process of its own, without TRITON_INTERPRET (the
interpreter replaces the kernels that Triton would compile):

    python tests/helpers/triton_aot.py OUT.json

No GPU is needed: `triton.compile` compiles an `ASTSource` for a target it does not see,
with the ptxas Triton ships. The variants are not listed by hand. The attention backend's
own `forward` (`FlashAttentionImpl.forward`, which FLASH_ATTN and TRITON_ATTN share) runs
on meta tensors (shapes, no data) for every attention shape in `attention_shapes()`,
every dtype in `DTYPES` and every kind of step in `STEPS`, and each launch of a kernel
found in `nano_v1/attention/ops/triton_*.py` is recorded instead of run. A new kernel
file, shape, dtype or kind of step is picked up by adding it there. Each distinct launch
(kernel, argument types, constexprs, launch options) is compiled once, and its cubin's
resource usage is read with the cuobjdump Triton ships.
"""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from benchmarks.cascade import AttentionShape, shared_prefix_metadata
from benchmarks.context import CONFIGS_DIR
from nano_v1.attention.backends.flash_attn import FlashAttentionImpl, FlashAttentionMetadataBuilder
from nano_v1.benchmarks.roofline import ModelShape
from nano_v1.benchmarks.utils import TINY_QWEN3_SHAPE
from nano_v1.demo_model import DEMO_MODEL_PATH

HOPPER = GPUTarget("cuda", 90, 32)
# The dtypes an engine runs attention in: bfloat16 (every shipped config and the demo model) and
# float32 (the notebooks' parity checks on a GPU). float16 compiles to bfloat16's code (the same
# 16-bit tensor-core dots; the same registers and shared memory in Triton 3.6 and 3.9): add it
# here to check it again.
DTYPES = (torch.bfloat16, torch.float32)
# (name, query tokens per request, shared-prefix tokens): the steps the model runner sends, each
# with the plain and the cascade path (chapter 07); a step of several queries per request
# stands for prefills and mixed batches, which launch the same variants.
STEPS = (("decode", 1, 0), ("chunk", 16, 0), ("cascade-decode", 1, 256), ("cascade-chunk", 16, 256))
NUM_REQS = 8
SUFFIX_LEN = 64
_TYPE_NAMES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.int32: "i32",
    torch.int64: "i64",
}
_LAUNCH_OPTIONS = ("num_warps", "num_stages")


def attention_shapes() -> list[AttentionShape]:
    """The attention of every model the suite and the notebooks run: the shipped configs, the demo model
    and the benchmarks' tiny Qwen3 (duplicates dropped)."""
    configs = [ModelShape.from_pretrained(d) for d in sorted(CONFIGS_DIR.iterdir())]
    configs += [ModelShape.from_pretrained(DEMO_MODEL_PATH), ModelShape.from_config(TINY_QWEN3_SHAPE)]
    keys = sorted({(s.num_heads, s.num_kv_heads, s.head_dim) for s in configs})
    return [AttentionShape(num_heads=h, num_kv_heads=kv, head_size=d) for h, kv, d in keys]


@dataclass(frozen=True)
class Launch:
    """One kernel launch, as Triton would compile it: argument types, constexpr values, launch options."""

    kernel: str
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, Any], ...]
    options: tuple[tuple[str, int], ...]


class _Recorder:
    """Stands in for a `@triton.jit` kernel: `kernel[grid](*args, **kwargs)` records the launch."""

    def __init__(self, kernel, launches: list[tuple[Any, tuple, dict]]) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.kernel, args, kwargs))


def kernel_modules() -> list[Any]:
    return [
        importlib.import_module(f"nano_v1.attention.ops.{p.stem}")
        for p in sorted((REPO_ROOT / "nano_v1" / "attention" / "ops").glob("triton_*.py"))
    ]


def record_launches() -> list[tuple[Launch, str]]:
    """Every distinct launch the attention backend makes, with the first (shape, dtype, step) that made it."""
    launches: list[tuple[Any, tuple, dict]] = []
    patched = []
    for module in kernel_modules():
        for name, value in vars(module).items():
            if isinstance(value, triton.runtime.JITFunction) and name.endswith("_kernel"):
                patched.append((module, name, value))
                setattr(module, name, _Recorder(value, launches))
    meta = torch.device("meta")
    seen: dict[Launch, str] = {}
    try:
        for shape in attention_shapes():
            impl = FlashAttentionImpl(
                shape.num_heads, shape.head_size, shape.head_size**-0.5, shape.num_kv_heads
            )
            builder = FlashAttentionMetadataBuilder(meta)
            for dtype in DTYPES:
                for step, query_len, prefix_len in STEPS:
                    common = shared_prefix_metadata(256, NUM_REQS, SUFFIX_LEN, query_len, shape, meta)
                    num_tokens = NUM_REQS * query_len
                    num_blocks = 256 // shape.block_size + NUM_REQS * -(-SUFFIX_LEN // shape.block_size)
                    q = torch.empty(num_tokens, shape.num_heads, shape.head_size, dtype=dtype, device=meta)
                    k = torch.empty(num_tokens, shape.num_kv_heads, shape.head_size, dtype=dtype, device=meta)
                    kv_cache = torch.empty(
                        2,
                        num_blocks,
                        shape.block_size,
                        shape.num_kv_heads,
                        shape.head_size,
                        dtype=dtype,
                        device=meta,
                    )
                    launches.clear()
                    impl.forward(
                        None, q, k, k, kv_cache, builder.build(prefix_len, common), torch.empty_like(q)
                    )
                    where = (
                        f"heads {shape.num_heads}/{shape.num_kv_heads} x {shape.head_size}, "
                        f"{_TYPE_NAMES[dtype]}, {step}"
                    )
                    for kernel, args, kwargs in launches:
                        seen.setdefault(as_launch(kernel, args, kwargs), where)
    finally:
        for module, name, value in patched:
            setattr(module, name, value)
    return list(seen.items())


def as_launch(kernel, args: tuple, kwargs: dict) -> Launch:
    """The compile key of a launch: each argument's Triton type (None and constexprs as constexprs)."""
    annotations = {p.name: str(p.annotation) for p in kernel.params}
    signature, constexprs = {}, {}
    for name, value in zip(kernel.arg_names, args):
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPE_NAMES[value.dtype]
        elif value is None:
            signature[name], constexprs[name] = "constexpr", None
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i64" if annotations[name] in ("i64", "tl.int64") else "i32"
    options = {k: kwargs[k] for k in _LAUNCH_OPTIONS if k in kwargs}
    for name, value in kwargs.items():
        if name not in options:
            signature[name], constexprs[name] = "constexpr", value
    return Launch(
        kernel.__name__, tuple(signature.items()), tuple(constexprs.items()), tuple(options.items())
    )


def compile_for_hopper(launch: Launch) -> dict[str, Any]:
    """Compile one launch for sm_90; its registers, local memory (spills) and stack per thread, and shared memory."""
    kernel = next(getattr(m, launch.kernel) for m in kernel_modules() if hasattr(m, launch.kernel))
    source = ASTSource(fn=kernel, signature=dict(launch.signature), constexprs=dict(launch.constexprs))
    compiled = triton.compile(source, target=HOPPER, options=dict(launch.options))
    with tempfile.TemporaryDirectory(prefix="nano_v1_aot_") as work:
        cubin = Path(work) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run(
            [triton.knobs.nvidia.cuobjdump.path, "-res-usage", str(cubin)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    fields = dict(re.findall(r"([A-Z]+):(\d+)", usage.split(f"Function {compiled.metadata.name}:")[1]))
    return {
        "registers": int(fields["REG"]),
        "local_bytes": int(fields["LOCAL"]),
        "stack_bytes": int(fields["STACK"]),
        # Triton launches with its shared memory as dynamic shared memory: the metadata has all of it.
        "shared_bytes": compiled.metadata.shared,
        "num_warps": compiled.metadata.num_warps,
        "num_stages": compiled.metadata.num_stages,
    }


def main(out: str) -> None:
    results = []
    for launch, where in record_launches():
        constexprs = {k: str(v) for k, v in launch.constexprs}
        results.append(
            {
                "kernel": launch.kernel,
                "first_seen": where,
                "constexprs": constexprs,
                "signature": dict(launch.signature),
                **compile_for_hopper(launch),
            }
        )
        print(json.dumps(results[-1]), flush=True)
    Path(out).write_text(
        json.dumps({"triton": triton.__version__, "target": asdict(HOPPER), "variants": results}, indent=2)
    )


if __name__ == "__main__":
    main(sys.argv[1])
