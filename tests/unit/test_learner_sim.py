"""The simulated learner (SIMULATED step time): its step-time model, its config, and the real bookkeeping around it."""

from __future__ import annotations

import numpy as np
import pytest

from actors.learner_sim import SimulatedLearner, describe, publish_seconds, sample_tokens, step_seconds
from modelserver.llm import build_char_tokenizer, build_tiny_model, tiny_config
from engine.config import ConfigError, LearnerConfig, LearnerSimulateConfig, load_config
from engine.schemas import Experience

pytestmark = pytest.mark.timeout(60)


def make_exp(sid: str, *, prompt: int = 3, response: int = 5, version: int = 0, advantage: float = 0.5) -> Experience:
    return Experience(
        sample_id=sid, task_id=f"task-{sid}", domain="arith",
        prompt_ids=np.arange(prompt, dtype=np.int32) + 5, response_ids=np.arange(response, dtype=np.int32) + 5,
        logprobs=np.full(response, -1.0, dtype=np.float32), loss_mask=np.ones(response, dtype=np.uint8),
        weight_versions=np.full(response, version, dtype=np.int32), reward=1.0, advantage=advantage, group_size=4)


def test_step_time_is_six_params_tokens_over_gpus_peak_mfu() -> None:
    sim = LearnerSimulateConfig(gpus=8, model_params=7e9, mfu=0.4, peak_flops=989e12)
    # 6 * 7e9 * 1e6 / (8 * 989e12 * 0.4) = 4.2e16 / 3.1648e15
    assert step_seconds(sim, 1_000_000) == pytest.approx(13.2710, rel=1e-4)
    assert step_seconds(sim, 2_000_000) == pytest.approx(2 * step_seconds(sim, 1_000_000))
    twice_the_gpus = sim.model_copy(update={"gpus": 16})
    assert step_seconds(twice_the_gpus, 1_000_000) == pytest.approx(step_seconds(sim, 1_000_000) / 2)
    assert step_seconds(sim, 0) == 0.0
    with pytest.raises(ValueError, match="tokens must be >= 0"):
        step_seconds(sim, -1)


def test_publish_time_is_model_bytes_over_bandwidth() -> None:
    sim = LearnerSimulateConfig(model_params=7e9, bytes_per_param=2, transfer_bytes_per_s=25e9)
    assert publish_seconds(sim) == pytest.approx(0.56)
    info = describe(sim)
    assert info["simulated"] is True and info["gpu"] == "H100 SXM" and info["publish_seconds"] == pytest.approx(0.56)


def test_config_accepts_the_documented_table(tmp_path) -> None:
    f = tmp_path / "run.toml"
    f.write_text("[learner]\nsimulate = {gpus = 8, model_params = 7e9, mfu = 0.4}\n")
    cfg = load_config(f, environ={})
    assert cfg.learner.simulate is not None
    assert (cfg.learner.simulate.gpus, cfg.learner.simulate.model_params, cfg.learner.simulate.mfu) == (8, 7e9, 0.4)
    assert load_config(environ={}).learner.simulate is None


@pytest.mark.parametrize("table, field", [
    ("{mfu = 1.5}", "learner.simulate.mfu"),
    ("{gpus = 0}", "learner.simulate.gpus"),
    ("{model_params = 7}", "learner.simulate.model_params"),  # billions instead of a count
    ("{time_scale = -1}", "learner.simulate.time_scale"),
    ("{gpu_count = 8}", "learner.simulate.gpu_count"),  # unknown key
])
def test_config_errors_name_the_field(tmp_path, table: str, field: str) -> None:
    f = tmp_path / "run.toml"
    f.write_text(f"[learner]\nsimulate = {table}\n")
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(f, environ={})


def _learner(sleeps: list[float], *, batch_size: int = 2, time_scale: float = 0.5) -> SimulatedLearner:
    tok = build_char_tokenizer()
    model = build_tiny_model(tiny_config(len(tok), hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                                         num_kv_heads=1), seed=0)
    cfg = LearnerConfig(batch_size=batch_size, simulate=LearnerSimulateConfig(time_scale=time_scale))
    return SimulatedLearner(model, cfg, max_staleness=1, sleep=sleeps.append)


def test_simulated_step_waits_the_scaled_step_time_and_keeps_the_real_ledger() -> None:
    sleeps: list[float] = []
    learner = _learner(sleeps)
    before = [p.detach().clone() for p in learner.model.parameters()]
    assert learner.offer(make_exp("a", prompt=3, response=5)) == "train"
    assert learner.offer(make_exp("a")) == "duplicate"
    assert learner.offer(make_exp("old", version=-5)) == "dropped_stale"
    assert not learner.ready
    assert learner.offer(make_exp("b", prompt=4, response=10)) == "train"
    report = learner.step()
    sim = learner.sim
    assert sleeps == [pytest.approx(step_seconds(sim, 3 + 5 + 4 + 10) * 0.5)]
    assert report.metrics["simulated"] == 1.0 and report.metrics["tokens"] == 22.0
    assert set(report.trained) == {"a", "b"} and report.dropped_stale == ("old",) and report.duplicates == 1
    assert (learner.ledger.trained, learner.ledger.dropped_stale, learner.ledger.duplicates) == (2, 1, 1)
    assert learner.version == 1 and learner.step_count == 1
    assert learner.statistics()["simulated"] is True
    # no optimizer step: the published (tiny) weights are the initial ones
    assert all(bool((p == q).all()) for p, q in zip(learner.model.parameters(), before))


def test_sample_tokens_counts_prompt_and_response() -> None:
    assert sample_tokens([make_exp("a", prompt=3, response=5), make_exp("b", prompt=1, response=1)]) == 10
    assert sample_tokens([make_exp("a", prompt=3, response=5)], response_token_scale=32) == 3 + 160


def test_simulated_learner_needs_the_section() -> None:
    tok = build_char_tokenizer()
    model = build_tiny_model(tiny_config(len(tok), hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                                         num_kv_heads=1), seed=0)
    with pytest.raises(ValueError, match="learner.simulate"):
        SimulatedLearner(model, LearnerConfig(), max_staleness=1)
