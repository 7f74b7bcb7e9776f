"""Piecewise compilation and CUDA graphs (chapter 08). Mirrors vllm/compilation/."""
