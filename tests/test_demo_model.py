"""The bundled demo model: it loads in transformers and nano_v1, agrees between them, and learned.

Oracles: transformers' own Qwen3 implementation for the greedy continuations; the empirical
unigram entropy of held-out files (recomputed here, not read from training.json) for quality;
ln(vocab_size), the loss of the near-uniform initial model, for the training smoke run.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from nano_v1.demo_model import DEMO_MODEL_PATH
from nano_v1.demo_model.corpus import corpus_files, read_sources, split_files
from tools.train_demo_model import encode_documents, main, parse_args

pytestmark = pytest.mark.demo_model

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:"]


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    # Upcast the bfloat16 weights exactly to float32 (transformers 5 loads in the stored dtype).
    return AutoModelForCausalLM.from_pretrained(DEMO_MODEL_PATH).to(torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO_MODEL_PATH)


def _window_loss(model, ids: np.ndarray, seq_len: int) -> float:
    """Mean next-token loss over non-overlapping windows of `seq_len` tokens."""
    num_windows = len(ids) // seq_len
    windows = torch.from_numpy(ids[: num_windows * seq_len]).view(num_windows, seq_len)  # [windows, seq_len]
    with torch.no_grad():
        logits = model(input_ids=windows).logits[:, :-1]  # [windows, seq_len - 1, vocab]
    return float(
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
    )


def test_checkpoint_is_a_small_qwen3_that_transformers_loads(hf_model, tokenizer):
    config = hf_model.config
    assert config.model_type == "qwen3" and config.architectures == ["Qwen3ForCausalLM"]
    assert config.tie_word_embeddings
    assert (DEMO_MODEL_PATH / "model.safetensors").stat().st_size < 10 * 2**20
    record = json.loads((DEMO_MODEL_PATH / "training.json").read_text())
    assert {"heldout_loss", "unigram_baseline", "train_seconds"} <= record.keys()

    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == config.eos_token_id
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Reverse a list."}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "# user: Reverse a list.\n# assistant:\n"


def test_tokenizer_round_trips_python_source(tokenizer):
    _, heldout = split_files(corpus_files())
    texts = read_sources(heldout[:3]) + ["\tx = 'héllo → 世界'\r\n  # trailing spaces   \n\n\n"]
    for text in texts:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        assert tokenizer.eos_token_id not in ids


def test_greedy_continuations_match_transformers(hf_model, tokenizer):
    from nano_v1 import LLM, SamplingParams

    expected = []
    for prompt in PROMPTS:
        input_ids = torch.tensor([tokenizer.encode(prompt)])
        out = hf_model.generate(input_ids, do_sample=False, max_new_tokens=32)
        expected.append(out[0, input_ids.shape[1] :].tolist())

    llm = LLM(model=str(DEMO_MODEL_PATH), dtype="float32")
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32))
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected


def test_heldout_loss_is_well_below_unigram_entropy(hf_model, tokenizer):
    _, heldout = split_files(corpus_files())
    ids = encode_documents(tokenizer, read_sources(heldout[:6]))[:8192]
    assert len(ids) == 8192
    # The empirical entropy of the sample itself is the lowest cross-entropy any context-free
    # (unigram) model can reach on it, so this baseline is at least as strict as one fit on training files.
    probs = np.bincount(ids) / len(ids)
    probs = probs[probs > 0]
    unigram_entropy = float(-(probs * np.log(probs)).sum())
    model_loss = _window_loss(hf_model, ids, seq_len=256)
    assert model_loss < 0.7 * unigram_entropy, (model_loss, unigram_entropy)


def test_training_smoke_run_learns_and_loads(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    argv = ["--out", str(tmp_path), "--smoke", "--max-files", "20"]
    args = parse_args(argv)
    # main() pins torch to one thread (tiny matmuls only lose to thread hand-offs); restore it after.
    threads = torch.get_num_threads()
    try:
        main(argv)
    finally:
        torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(tmp_path).to(torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert model.config.model_type == "qwen3"

    train_files, _ = split_files(corpus_files()[: args.max_files])
    ids = encode_documents(tokenizer, read_sources(train_files))[:2048]
    # Freshly initialised, the model predicts nearly uniformly: loss ln(vocab_size).
    loss = _window_loss(model, ids, seq_len=args.seq_len)
    assert loss < math.log(model.config.vocab_size) - 0.4, loss
