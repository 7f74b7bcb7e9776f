"""The penalty-state benchmark at smoke size: it runs, checks its two paths agree, and writes its JSON.

No timing is asserted (these machines are shared); the workload and the JSON's structure
are, because notebook 05 and the chapters read them.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.ch05


def test_smoke_run_writes_every_batch_size_with_spread(tmp_path):
    from benchmarks import penalties

    out = tmp_path / "penalties.json"
    penalties.main(["--smoke", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["benchmark"] == "penalties" and report["smoke"] is True
    assert report["torch_num_threads"] >= 1 and report["environment"]["date"]
    workload = report["workload"]
    assert workload == {
        "vocab_size": 4096, "prompt_len": 64, "output_len": 8, "num_steps": 3, "num_repeats": 2,
        "num_warmup_steps": 1,
    }  # fmt: skip
    rows = report["rows"]
    assert [row["batch_size"] for row in rows] == list(penalties.SMOKE_BATCH_SIZES)
    for row in rows:
        for path in ("diff", "rebuild", "apply"):
            values = row[f"{path}_ms_repeats"]
            assert len(values) == workload["num_repeats"], f"{path}: one mean per repeat"
            assert row[f"{path}_ms_min"] <= row[f"{path}_ms"] <= row[f"{path}_ms_max"], path
            assert all(v > 0 for v in values), path
        assert row["rebuild_over_diff"] == pytest.approx(row["rebuild_ms"] / row["diff_ms"])
        # The rebuild is its two timed parts: lists made tensors, tables counted from them.
        parts = zip(row["rebuild_lists_ms_repeats"], row["rebuild_tables_ms_repeats"])
        assert row["rebuild_ms_repeats"] == pytest.approx([lists + tables for lists, tables in parts])
    # With answers of 8 tokens, a batch of 8 staggered requests sees one finish and one join per step.
    assert rows[-1]["joined_per_step"] == pytest.approx(1.0)


def test_rebuilt_bins_count_prompt_presence_and_output_occurrences():
    import torch

    from benchmarks.penalties import rebuild_bins

    prompt_mask, counts = rebuild_bins([[1, 1, 3], [0]], [[2, 2, 2], []], 5, torch.device("cpu"))
    assert prompt_mask.tolist() == [[False, True, False, True, False], [True, False, False, False, False]]
    assert counts.tolist() == [[0, 0, 3, 0, 0], [0, 0, 0, 0, 0]]
