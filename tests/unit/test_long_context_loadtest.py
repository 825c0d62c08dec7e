"""``loadtests/long_context.py`` runs end to end on the tiny char-model fixture (the real model named absent).

Its figures are not judged here (tests never assert timings); only that the fallback is labelled and the JSON
carries what the docs quote, with the token counts that do not depend on the machine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtests import long_context

pytestmark = [pytest.mark.timeout(600)]


def test_quick_run_on_the_fixture_writes_every_figure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "long.json"
    assert long_context.main(["--quick", "--model-dir", str(tmp_path / "absent"), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["model_kind"].startswith("tiny char fixture (real model absent")
    assert "tiny char fixture" in capsys.readouterr().out
    group = result["details"]["group"]
    # sharing: the prompt computed once (the 7 copies decode their last prompt token)
    assert group["prefill_tokens_unshared"] == 8 * group["prompt_tokens"]
    assert group["prefill_tokens_shared"] == group["prompt_tokens"]
    assert result["group_prefill_ratio"] == pytest.approx(1 / 8) and result["group_prefill_ratio"] <= 1.2 / 8
    assert group["repeat_group_prefill_tokens"] == 0 and group["prefix_cache_hits"] >= 1
    admission = result["details"]["group_admission"]
    # credited the blocks they share, both groups' 16 samples run at once in a pool of 3 worst cases
    assert admission["max_running_credit"] == 16 > admission["max_running_no_credit"]
    assert result["group_admission_speedup"] > 0
    for key in ("group_ttft_speedup", "paged_decode_speedup", "sparse_speed_ratio"):
        assert result[key] > 0
    tiers = result["max_context_tokens_tiered"]
    assert tiers["with_int8_tier"] > tiers["without_tier"] > 0
    tier = result["details"]["int8_tier"]
    # every prompt went down to the int8 tier and came back from it on its second sending
    assert tier["int8_hits"] == tier["prompts"] and tier["int8_tokens_held"] > 0
    assert tier["int8_bytes_per_token_measured"] < tier["hot_bytes_per_token"]
    assert 0.0 <= result["int8_output_agreement"] <= 1.0
    disk = result["details"]["disk_tier"]
    # the first prompt went down to disk and its second sending was served from there
    assert disk["disk_hits"] == 1 and disk["disk_hit_tokens"] == disk["prompt_tokens"] - 1
    assert disk["disk_tokens_held"] > 0 and result["disk_ttft_speedup"] > 0
    assert -1.0 <= result["sparse_accuracy_delta"] <= 1.0 and 0.0 <= result["sparse_output_agreement"] <= 1.0
    sparse = result["details"]["sparse"]
    assert sparse["answer_logprob_full"] < 0 and sparse["answer_logprob_window"] < 0
    assert 0 < result["sparse_kv_ratio"] < 1  # the window's older blocks went back to the pool
    assert result["answer_logprob_delta"] == pytest.approx(sparse["answer_logprob_window"] - sparse["answer_logprob_full"], abs=1e-3)
    decode = result["details"]["decode"]
    # the group's prompt blocks are shared in the paged store, copied into every row of the slot store
    assert decode["kv_bytes_per_seq_engine"] < decode["kv_bytes_per_seq_slot"]
    assert decode["kv_bytes_per_seq_engine"] < decode["kv_bytes_per_seq_hf"]
    assert result["simulated"] is False


def test_parts_run_alone_and_bad_parts_are_refused(tmp_path: Path) -> None:
    out = tmp_path / "sparse.json"
    assert long_context.main(["--quick", "--model-dir", str(tmp_path / "absent"), "--parts", "sparse",
                              "--sparse-tasks", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["parts"] == ["sparse"] and set(result["details"]) == {"sparse"}
    assert result["details"]["sparse"]["tasks"] == 1 and "group_prefill_ratio" not in result
    for bad in (["--parts", "decode,nonsense"], ["--sparse-tasks", "0"]):
        with pytest.raises(SystemExit) as exc:
            long_context.main(bad)
        assert exc.value.code == 2
