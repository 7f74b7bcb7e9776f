"""The model executor against Hugging Face transformers: logits, paged decoding, loading errors.

Oracle: transformers' own model on the same checkpoint, run one request at a time on the
full token sequence (no KV cache), and its `generate` for greedy tokens. nano_v1 runs a
ragged multi-request batch through the paged KV cache with shuffled block ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.checkpoints import make_tiny_checkpoint
from helpers.model import PagedRunner, load_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from nano_v1.config import ModelConfig
from nano_v1.forward_context import set_forward_context

pytestmark = pytest.mark.ch01

ATOL = 1e-4


def _make_checkpoint(path: Path, arch: str, **overrides) -> str:
    """A tiny checkpoint whose biases (if any) are non-zero, so that loading them is tested."""
    make_tiny_checkpoint(path, arch, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    hf.save_pretrained(path)
    return str(path)


@pytest.fixture(
    scope="module",
    params=[
        ("qwen3", {}),
        ("qwen2", {}),  # q/k/v biases
        ("llama", {"attention_bias": True, "mlp_bias": True}),
    ],
    ids=["qwen3", "qwen2", "llama-bias"],
)
def checkpoint(request, tmp_path_factory) -> str:
    arch, overrides = request.param
    return _make_checkpoint(tmp_path_factory.mktemp(arch), arch, **overrides)


def _hf_model(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _hf_logits(hf, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0].float()  # [len, vocab]


def test_prefill_and_paged_decode_match_transformers(checkpoint):
    model = load_model(checkpoint, dtype="float32")
    hf = _hf_model(checkpoint)
    rng = np.random.default_rng(0)
    prompt_lens = [7, 19, 40, 1]
    prompts = [rng.integers(3, 512, n).tolist() for n in prompt_lens]
    runner = PagedRunner(model, num_reqs=len(prompts))
    seqs = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    last_logits: dict[int, torch.Tensor] = {}
    for step in range(7):
        # Step 0 prefills requests 0, 1, 3 whole and the first 24 tokens of request 2 (a chunk);
        # step 1 finishes request 2's prompt beside three decodes; then everyone decodes.
        # Rows are not in request order: the runner's batch order is arbitrary.
        reqs = [0, 1, 2, 3] if step == 0 else [2, 0, 3, 1]
        new_tokens = []
        for r in reqs:
            if computed[r] < len(seqs[r]):  # (the rest of) a prompt
                new_tokens.append(seqs[r][computed[r] : 24 if (step, r) == (0, 2) else None])
            else:  # a greedy decode of the previous step's last row
                seqs[r].append(int(last_logits[r].argmax()))
                new_tokens.append(seqs[r][-1:])
        logits = runner.step(reqs, new_tokens, [computed[r] for r in reqs])
        end = 0
        for r, toks in zip(reqs, new_tokens):
            start, end = end, end + len(toks)
            # Causal: HF's rows for these positions do not depend on any later token.
            ref = _hf_logits(hf, seqs[r])[computed[r] : computed[r] + len(toks)]
            torch.testing.assert_close(logits[start:end], ref, atol=ATOL, rtol=0)
            computed[r] += len(toks)
            last_logits[r] = logits[end - 1]

    # The tokens nano_v1 chose greedily are the ones transformers' generate() chooses.
    for r, prompt in enumerate(prompts):
        num_new = len(seqs[r]) - len(prompt)
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=num_new,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
        assert out[0].tolist() == seqs[r], f"request {r}: greedy tokens differ from transformers"


def test_without_metadata_the_batch_is_one_causal_sequence(tiny_qwen3):
    """The profiling path (no KV cache) attends within the batch as one sequence."""
    model = load_model(tiny_qwen3)
    tokens = list(range(3, 30))
    with torch.no_grad(), set_forward_context(None):
        logits = model.compute_logits(model(torch.tensor(tokens), torch.arange(len(tokens))))
    torch.testing.assert_close(logits, _hf_logits(_hf_model(tiny_qwen3), tokens), atol=ATOL, rtol=0)


def _prefill_logits(model, tokens: list[int]) -> torch.Tensor:
    return PagedRunner(model, num_reqs=1).step([0], [tokens], [0])


def test_tied_embeddings(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "tied", "qwen3", tie_word_embeddings=True)
    assert not any(k.startswith("lm_head") for k in load_file(f"{path}/model.safetensors"))
    model = load_model(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    tokens = list(range(5, 40))
    torch.testing.assert_close(
        _prefill_logits(model, tokens), _hf_logits(_hf_model(path), tokens), atol=ATOL, rtol=0
    )


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            # With theta 5e5 and head_dim 16 this puts one frequency in each band:
            # kept (wavelength 6 < 16), blended (33), divided by the factor (167 > 64).
            "original_max_position_embeddings": 64,
        },
    ],
    ids=["linear", "llama3"],
)
def test_llama_rope_scaling_matches_transformers(tmp_path, rope_scaling):
    path = make_tiny_checkpoint(tmp_path / "llama", "llama", rope_scaling=rope_scaling, rope_theta=500000.0)
    model = load_model(path)
    tokens = np.random.default_rng(1).integers(3, 512, 120).tolist()  # long enough for scaling to matter
    torch.testing.assert_close(
        _prefill_logits(model, tokens), _hf_logits(_hf_model(path), tokens), atol=ATOL, rtol=0
    )


def test_unsupported_rope_type_is_a_clear_error(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "llama", "llama")
    cfg = json.loads((tmp_path / "llama" / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_scaling"] = {"rope_type": "dynamic", "factor": 2.0}
    (tmp_path / "llama" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="rope type 'dynamic' is not supported"):
        load_model(path)


def test_dummy_load_format_reads_no_checkpoint(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "q", "qwen3")
    (tmp_path / "q" / "model.safetensors").unlink()  # nothing to read: dummy must not try
    model = load_model(path, load_format="dummy", dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(0 < p.abs().max() <= 1e-3 for p in model.parameters())
    logits = _prefill_logits(model, list(range(3, 20)))
    assert logits.dtype == torch.float32 and logits.shape == (17, 512)
    assert torch.isfinite(logits).all()


def test_unsupported_architecture(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "q", "qwen3")
    cfg_file = tmp_path / "q" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        ModelConfig(path)


@pytest.fixture(scope="module")
def qwen3_tensors(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A good tiny checkpoint and its tensors, for writing broken copies of it."""
    path = Path(make_tiny_checkpoint(tmp_path_factory.mktemp("good"), "qwen3"))
    return path, load_file(path / "model.safetensors")


def _broken_copy(tmp_path: Path, good: Path, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    (tmp_path / "config.json").write_text((good / "config.json").read_text())
    if tensors is not None:
        save_file(tensors, tmp_path / "model.safetensors")
    return tmp_path


def test_no_safetensors_files(tmp_path, qwen3_tensors):
    path = _broken_copy(tmp_path, qwen3_tensors[0])
    with pytest.raises(ValueError, match=r"no \*\.safetensors files in .*" + tmp_path.name):
        load_model(str(path))


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors_file(tmp_path, qwen3_tensors, damage):
    good, tensors = qwen3_tensors
    path = _broken_copy(tmp_path, good, tensors)
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(b"\x13\x37not a safetensors file" * 3 if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(ValueError, match="cannot read safetensors file .*model.safetensors"):
        load_model(str(path))


def test_missing_weight(tmp_path, qwen3_tensors):
    good, tensors = qwen3_tensors
    tensors = {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.down_proj.weight"}
    path = _broken_copy(tmp_path, good, tensors)
    with pytest.raises(ValueError, match=r"lacks 1 weight.*model\.layers\.1\.mlp\.down_proj\.weight"):
        load_model(str(path))


def test_shape_mismatch_names_parameter_and_shapes(tmp_path, qwen3_tensors):
    good, tensors = qwen3_tensors
    tensors = dict(tensors)
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(32, 64)  # the k shard is [64, 64]
    path = _broken_copy(tmp_path, good, tensors)
    with pytest.raises(ValueError) as e:
        load_model(str(path))
    message = str(e.value)
    assert "model.layers.0.self_attn.qkv_proj.weight" in message
    assert "(32, 64)" in message and "(64, 64)" in message


def test_unexpected_tensor(tmp_path, qwen3_tensors):
    good, tensors = qwen3_tensors
    path = _broken_copy(tmp_path, good, {**tensors, "model.layers.0.extra.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match="'model.layers.0.extra.weight' matches no parameter"):
        load_model(str(path))
