"""The bundled demo model: a small Qwen3 code model trained here on the Python standard library.

No vLLM counterpart (vLLM downloads checkpoints from the Hub); the default model of chapter 01.

Why it exists: `LLM()`, `nano-v1 generate` and `nano-v1 serve` should work offline out of
the box. The checkpoint directory is a standard Hugging Face one (config.json,
model.safetensors, tokenizer.json), rebuilt from a source checkout by
`python -m tools.train_demo_model` (run from its root).
"""

from pathlib import Path

DEMO_MODEL_PATH = Path(__file__).parent / "checkpoint"

__all__ = ["DEMO_MODEL_PATH"]
