"""What every notebook shares: sizes, the device, engine cores, where figures go, recorded GPU results.

Mirrors no vLLM file (vLLM has no notebooks); used by every notebook (chapter 00). It lives
beside them, outside the package, because it needs the source checkout (figures/, benchmarks/, tools/).

Why it exists: each notebook runs in three settings, and all of them must leave a record
that says where its numbers came from:
  - default, on a CPU: small sizes, a few minutes on a laptop; figures/NN_*.png and
    figures/data/NN_*.json are the committed results;
  - default, on a GPU: the full sizes, same files;
  - smoke (`NANO_V1_SMOKE=1`): every size shrunk so the whole set executes in CI through
    a real Jupyter kernel in seconds. Smoke runs must not overwrite the committed
    results, so they write to `<tmp>/nano_v1_smoke_figures/` (same file names,
    `"smoke": true` inside the JSON, "[SMOKE]" at the start of every figure's title).
`$NANO_V1_FIGURES_DIR`, when set, takes every run's files instead (a GPU session's
device script collects them there). On a GPU several engines alive at once each ask for
a share of its memory (`gpu_memory_share`), as one engine would take 90% of it.
A measurement that needs a GPU falls back, on a CPU, to the latest recorded GPU run in
figures/data/ (`tools/ledger.py`), labelled with its device and date.
Notebooks that read the scheduler build their own engine core (`engine_core`): `LLM`
hides it, by default in another process (chapter 09).
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

# The checkout's root, where `benchmarks/` and `tools/` are (neither is installed with the package):
# Jupyter runs a notebook in notebooks/, a plain `python notebooks/NN_x.py` puts notebooks/ on the path.
REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.context import CONFIGS_DIR  # noqa: E402 (after the path above)
from tools.ledger import LEDGER_DIR, latest_gpu_results  # noqa: E402
from nano_v1.benchmarks.utils import environment, write_json, write_tiny_qwen3
from nano_v1.config import CacheConfig
from nano_v1.engine import EngineCoreRequest
from nano_v1.engine.arg_utils import EngineArgs
from nano_v1.engine.core import EngineCore
from nano_v1.sampling_params import SamplingParams

SMOKE = os.environ.get("NANO_V1_SMOKE") == "1"
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
# CPU threads for torch in the notebooks (NANO_V1_THREADS overrides). One by default: on a
# shared machine, two OpenMP threads that spin-wait for a busy core made a 256^3 matmul
# 15x slower than one thread, and the models here are too small to gain from more.
CPU_THREADS = int(os.environ.get("NANO_V1_THREADS", "1"))


def set_threads() -> int:
    """Give torch `CPU_THREADS` threads (CPU runs only); return the number in use."""
    if not ON_GPU:
        torch.set_num_threads(CPU_THREADS)
    return torch.get_num_threads()


def pick(cpu: Any, gpu: Any, smoke: Any) -> Any:
    """The size for this run: `smoke` under NANO_V1_SMOKE=1, else `gpu` on CUDA, else `cpu`."""
    return smoke if SMOKE else gpu if ON_GPU else cpu


def dummy_model() -> tuple[str, str, str]:
    """(model directory, dtype, name) of a shape to run with `load_format="dummy"` (random weights).

    On a GPU at full size: the Qwen3-0.6B shape in bfloat16. Otherwise the benchmarks' tiny
    Qwen3 (4 layers, hidden 256) in float32, its config.json written to a temporary directory.
    """
    if ON_GPU and not SMOKE:
        return str(CONFIGS_DIR / "qwen3-0.6b"), "bfloat16", "Qwen3-0.6B shape"
    return (
        write_tiny_qwen3(tempfile.mkdtemp(prefix="nano_v1_nb_"), weights=False),
        "float32",
        "tiny Qwen3 (5.2M)",
    )


def engine_core(**engine_args: Any) -> EngineCore:
    """The engine core of `EngineArgs(**engine_args)` on this run's device, in this process.

    The scheduler and the worker, stepped by `EngineCore.step()`, without a frontend: the
    notebook's own object, so it can read `engine_core(...).scheduler` after every step.
    """
    return EngineCore(EngineArgs(device=DEVICE, **engine_args).create_engine_config())


def core_request(request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> EngineCoreRequest:
    """What `LLMEngine` hands the engine core for a prompt of token ids (no EOS: `ignore_eos` workloads)."""
    return EngineCoreRequest(
        request_id, prompt_token_ids, params, eos_token_id=None, arrival_time=time.monotonic()
    )


def figures_dir() -> Path:
    """`$NANO_V1_FIGURES_DIR` if set; else figures/ of the checkout, or a temporary directory in smoke mode."""
    if os.environ.get("NANO_V1_FIGURES_DIR"):
        return Path(os.environ["NANO_V1_FIGURES_DIR"])
    return Path(tempfile.gettempdir()) / "nano_v1_smoke_figures" if SMOKE else LEDGER_DIR.parent


def gpu_memory_share(num_engines: int) -> dict[str, float]:
    """Engine arguments for one of `num_engines` engines alive at once: on a GPU, an equal part of
    the memory one engine would take (`gpu_memory_utilization`, its KV cache sized from that
    part); on a CPU nothing, each cache being `kv_cache_memory_bytes`."""
    if not ON_GPU:
        return {}
    return {"gpu_memory_utilization": CacheConfig.gpu_memory_utilization / num_engines}


def tick_at(axes, values) -> None:
    """Put the x ticks of every axis in `axes` exactly at `values` (batch sizes, budgets), on log axes too."""
    for ax in axes:
        ax.set_xticks(values, [str(v) for v in values])
        ax.minorticks_off()


def log_ticks(ax, axis: str = "y") -> None:
    """Label a log axis with plain numbers (1, 2, 5 x 10^k; finer if its range is narrow), no minor ticks."""
    low, high = ax.get_ylim() if axis == "y" else ax.get_xlim()
    decades = range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
    for steps in ((1, 2, 5), (1, 1.5, 2, 3, 4, 5, 6, 7, 8, 9)):
        ticks = [m * 10.0**e for e in decades for m in steps if low <= m * 10.0**e <= high]
        if len(ticks) >= 3:
            break
    (ax.set_yticks if axis == "y" else ax.set_xticks)(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()


def finish_figure(fig, title: str) -> None:
    """Legends on every axis that has labelled lines, and a title that ends with where it ran."""
    for ax in fig.axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"{title}: {device_label()}", fontsize=10)
    fig.tight_layout()


SMOKE_MARK = "[SMOKE]"


def mark_smoke(fig) -> None:
    """In a smoke run, start `fig`'s title with "[SMOKE]": its sizes are shrunk, its numbers no result."""
    title = fig.get_suptitle()
    if SMOKE and not title.startswith(SMOKE_MARK):
        fig.suptitle(f"{SMOKE_MARK} {title}".rstrip(), fontsize=10, color="tab:red")


def save_figure(fig, name: str) -> Path:
    """Write `fig` to <figures>/<name>.png (its title marked in a smoke run) and return the path."""
    mark_smoke(fig)
    path = figures_dir() / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def save_data(name: str, results: dict[str, Any]) -> Path:
    """Write <figures>/data/<name>.json: `results` plus date, device, versions and the smoke flag."""
    path = figures_dir() / "data" / f"{name}.json"
    write_json(path, {"notebook": name, "smoke": SMOKE, **results})
    return path


def device_label(env: dict[str, Any] | None = None) -> str:
    """'2-core CPU (AMD EPYC ...), 2026-11-30' or 'NVIDIA H200, 2026-11-30', for plot titles and prose."""
    env = env or environment()
    device = env["device"]
    if "cuda" not in device.lower() and "nvidia" not in device.lower():
        device = f"{env['cpu_count']}-core CPU ({device})"
    return f"{device}, {env['date'][:10]}"


def recorded_gpu_results(measurement: str) -> tuple[dict[str, Any], str] | None:
    """The latest recorded GPU run's result of `measurement` (a gpu_suite name) and its label, or None."""
    record = latest_gpu_results("gpu_suite")
    if record is None:
        return None
    result = record.get("measurements", {}).get(measurement, {}).get("result")
    if not result:
        return None
    return result, f"recorded: {device_label(record['environment'])} ({record['ledger_file']})"
