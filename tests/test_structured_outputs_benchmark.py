"""The structured outputs benchmark (benchmarks/structured_outputs.py) at tiny sizes.

No speed is asserted (these machines are shared). Oracles: the synthetic vocabulary's own
bytes (a tokenization must spell its text back), jsonschema and xgrammar's matcher for the
documents the bitmask walk follows (`check_bitmask`), and xgrammar's own allocation for the
bitmask's size. The end-to-end parts (`measure_throughput`, `measure_whitespace`) load the
demo model and run in the notebook's smoke test.
"""

from __future__ import annotations

import json

import pytest

from benchmarks import structured_outputs as sob

pytest.importorskip("xgrammar")
pytest.importorskip("jsonschema")

pytestmark = pytest.mark.ch15

VOCAB_SIZE = 1000  # not a multiple of 32: the last bitmask word is partly padding


@pytest.fixture(scope="module")
def vllm_config():
    return sob.demo_engine_config(3)


def test_synthetic_vocab_spells_every_text_back():
    vocab = sob.synthetic_vocab(VOCAB_SIZE)
    assert len(vocab) == len(set(vocab)) == VOCAB_SIZE and vocab[-1] == sob.SYNTHETIC_EOS
    assert {bytes([b]) for b in range(256)} <= set(vocab)
    for doc in sob.DOCUMENTS:
        text = json.dumps(doc) + "\n\t naïve"
        ids = sob.greedy_encode(text, vocab)
        assert b"".join(vocab[i] for i in ids) == text.encode()
        assert len(ids) < len(text.encode())  # multi-byte tokens are used


def test_walked_documents_are_valid_and_masked_right(vllm_config):
    """jsonschema validates every document, xgrammar's matcher accepts each token and ends at the EOS,
    and the runner's mask leaves finite exactly the set bits (asserted inside `check_bitmask`)."""
    vocab = sob.vocabulary(VOCAB_SIZE, vllm_config)
    checked = sob.check_bitmask(vocab)
    assert checked["num_positions_checked"] == sum(len(p) for p in sob.document_paths(vocab))


def test_bitmask_cost_rows_have_every_cell(vllm_config):
    import xgrammar as xgr

    result = sob.measure_bitmask_cost((1, 3), (VOCAB_SIZE,), num_steps=2, repeats=2)
    assert [(r["vocab_size"], r["batch_size"]) for r in result["rows"]] == [(VOCAB_SIZE, 1), (VOCAB_SIZE, 3)]
    for row in result["rows"]:
        assert row["bitmask_bytes"] == xgr.allocate_token_bitmask(row["batch_size"], VOCAB_SIZE).numpy().nbytes
        for key in ("scheduler_us", "runner_us", "copy_logits_us"):
            assert 0 < row[f"{key}_min"] <= row[key] <= row[f"{key}_max"], (key, row)
    assert result["before"]["torch_num_threads"] >= 1 and len(result["after"]["load_average"]) == 3


def test_compile_time_has_each_kind_cold_and_cached():
    result = sob.measure_compile_time((VOCAB_SIZE,), repeats=1)
    assert [r["kind"] for r in result["rows"]] == list(sob.COMPILE_KINDS)
    assert all(r["cold_ms"] > 0 and r["cached_ms"] > 0 for r in result["rows"])
