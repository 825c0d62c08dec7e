import pytest

from engine.config import ConfigError, EngineConfig, env_overrides, load_config


def test_defaults_validate_and_every_field_has_a_docstring():
    cfg = load_config(environ={})
    assert cfg.namespace == "default"
    for section in (cfg.kafka, cfg.nats, cfg.learner, cfg.scheduler, cfg.reward):
        for name, field in type(section).model_fields.items():
            assert field.description, f"{type(section).__name__}.{name} has no docstring"


def test_file_and_environment_overrides(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('namespace = "exp1"\n[learner]\nbatch_size = 8\n[kafka]\nbootstrap = "h:1"\n')
    cfg = load_config(f, environ={"ROLLOUT__LEARNER__BATCH_SIZE": "32", "ROLLOUT__KAFKA__COMPRESSION": "zstd"})
    assert cfg.namespace == "exp1"
    assert cfg.learner.batch_size == 32
    assert cfg.kafka.bootstrap == "h:1" and cfg.kafka.compression == "zstd"


def test_error_names_file_and_field(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("[learner]\nbatch_size = 0\n")
    with pytest.raises(ConfigError) as ei:
        load_config(f, environ={})
    assert str(f) in str(ei.value) and "learner.batch_size" in str(ei.value)


def test_unknown_field_and_bad_toml_and_missing_file(tmp_path):
    f = tmp_path / "x.toml"
    f.write_text("[kafka]\nbootstrapp = 'typo'\n")
    with pytest.raises(ConfigError, match="kafka.bootstrapp"):
        load_config(f, environ={})
    f.write_text("[kafka\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(f, environ={})
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "missing.toml", environ={})


def test_env_values_parse_as_toml_or_string():
    env = env_overrides({"ROLLOUT__SCHEDULER__DOMAINS": '{arith = 1.0, code = 2.0}',
                         "ROLLOUT__NATS__URL": "nats://x:1", "OTHER": "1"})
    assert env == {"scheduler": {"domains": {"arith": 1.0, "code": 2.0}}, "nats": {"url": "nats://x:1"}}
    assert EngineConfig.model_validate(env).scheduler.domains["code"] == 2.0


def test_inference_api_key_from_env_or_file_never_shown(tmp_path):
    from engine.config import INFERENCE_API_KEY_ENV

    assert INFERENCE_API_KEY_ENV == "ROLLOUT__INFERENCE__API_KEY"
    cfg = load_config(environ={INFERENCE_API_KEY_ENV: "123e4567"})  # would parse as a TOML float
    assert cfg.inference.resolved_api_key() == "123e4567"
    assert "123e4567" not in repr(cfg) and "123e4567" not in str(cfg.model_dump())
    key_file = tmp_path / "api-key"
    key_file.write_text("  from-a-secret\n")
    cfg = load_config(environ={"ROLLOUT__INFERENCE__API_KEY_FILE": str(key_file)})
    assert cfg.inference.resolved_api_key() == "from-a-secret"
    assert load_config(environ={}).inference.resolved_api_key() is None
    key_file.write_text("\n")
    with pytest.raises(ConfigError, match="inference.api_key_file: .* is empty"):
        cfg.inference.resolved_api_key()
    with pytest.raises(ConfigError, match="inference.api_key_file: cannot read"):
        load_config(environ={"ROLLOUT__INFERENCE__API_KEY_FILE": str(tmp_path / "none")}).inference.resolved_api_key()
    with pytest.raises(ConfigError, match="api_key and api_key_file are both set"):
        load_config(environ={INFERENCE_API_KEY_ENV: "a", "ROLLOUT__INFERENCE__API_KEY_FILE": str(key_file)})


def test_off_policy_preset_and_band_errors_name_the_field(tmp_path):
    f = tmp_path / "learner.toml"
    f.write_text('[learner]\noff_policy = "tis2"\n')
    with pytest.raises(ConfigError, match=r"learner\.off_policy: Input should be 'token_tis', 'icepop'"):
        load_config(f, environ={})
    f.write_text('[learner]\noff_policy = "icepop"\noff_policy_band = [2.0, 0.5]\n')
    with pytest.raises(ConfigError, match=r"learner\.off_policy_band: the band \[low, high\] needs 0 <= low < high"):
        load_config(f, environ={})
    f.write_text('[learner]\noff_policy = "geo_mask"\noff_policy_band = [0.9, 1.1]\nstaleness_policy = "downweight"\n')
    cfg = load_config(f, environ={}).learner
    assert cfg.off_policy_band == (0.9, 1.1) and cfg.staleness_policy == "downweight"
    f.write_text('[learner]\nstaleness_policy = "keep"\n')
    with pytest.raises(ConfigError, match=r"learner\.staleness_policy"):
        load_config(f, environ={})
    f.write_text('[learner]\npacking = "alone"\n')
    with pytest.raises(ConfigError, match=r"learner\.packing: Input should be 'rows' or 'per_sample'"):
        load_config(f, environ={})
    f.write_text('[learner]\npacking = "per_sample"\n')
    assert load_config(f, environ={}).learner.packing == "per_sample"


@pytest.mark.parametrize("value", [0, -0.5])
def test_a_greedy_or_negative_default_temperature_is_refused_at_start_up(value: float) -> None:
    """Training samples are scored at logits / temperature: greedy is a task's ``top_k = 1``, not T = 0."""
    with pytest.raises(ConfigError, match="inference.temperature"):
        load_config(overrides={"inference": {"temperature": value}})
