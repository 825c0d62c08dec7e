"""loadtests/learning.py without running any system: arguments, the task rule, the figures it reports."""

from __future__ import annotations

import ast
import json
import random
import re
from pathlib import Path

import pytest

from engine.config import load_config
from loadtests import _learning_task as task_mod
from loadtests import learning


def args_for(model_dir: Path | None, *extra: str) -> list[str]:
    return ([] if model_dir is None else ["--model-dir", str(model_dir)]) + list(extra)


def bad_input(argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> str:
    """Runs main(); asserts exit 2, one stderr line and that no system was started."""
    monkeypatch.setattr(learning, "run", lambda *a, **k: pytest.fail("a system ran despite bad input"))
    assert learning.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("learning.py: ")
    return err[0]


@pytest.mark.parametrize("seconds", ["0", "-5"])
def test_a_budget_that_is_not_positive_is_refused(seconds, model_dir, monkeypatch, capsys):
    assert "--seconds must be > 0" in bad_input(args_for(model_dir, f"--seconds={seconds}"), monkeypatch, capsys)


def test_an_unknown_system_is_named(model_dir, monkeypatch, capsys):
    line = bad_input(args_for(model_dir, "--only", "engine,vllm"), monkeypatch, capsys)
    assert "unknown system vllm" in line and "engine, minimal, trl" in line


def test_no_model_directory_says_how_to_name_one(monkeypatch, capsys):
    monkeypatch.delenv(learning.MODEL_ENV, raising=False)
    line = bad_input([], monkeypatch, capsys)
    assert "--model-dir" in line and learning.MODEL_ENV in line


def test_a_missing_or_broken_model_directory_is_named(model_dir, tmp_path, monkeypatch, capsys):
    assert "not a directory" in bad_input(args_for(tmp_path / "nope"), monkeypatch, capsys)
    (model_dir / "config.json").write_text("{not json")
    assert "config.json is not JSON" in bad_input(args_for(model_dir), monkeypatch, capsys)
    (model_dir / "config.json").unlink()
    assert "cannot read config.json" in bad_input(args_for(model_dir), monkeypatch, capsys)


def test_a_model_directory_without_weights_or_tokenizer_is_refused(model_dir, monkeypatch, capsys):
    (model_dir / "tokenizer.json").unlink()
    assert "tokenizer.json is missing" in bad_input(args_for(model_dir), monkeypatch, capsys)
    (model_dir / "model.safetensors").unlink()
    assert "no weights" in bad_input(args_for(model_dir), monkeypatch, capsys)


def test_a_missing_plain_loop_is_refused_only_when_it_would_run(model_dir, tmp_path, monkeypatch, capsys):
    missing = str(tmp_path / "grpo_minimal.py")
    assert "the plain loop" in bad_input(args_for(model_dir, "--minimal", missing), monkeypatch, capsys)
    args = learning.parse_args(args_for(model_dir, "--minimal", missing, "--only", "engine"))
    assert learning.validate(args) == ["engine"]


def test_defaults_and_quick(model_dir, monkeypatch):
    monkeypatch.setenv(learning.MODEL_ENV, str(model_dir))
    args = learning.parse_args([])
    assert learning.validate(args) == ["engine", "minimal", "trl"]
    assert (args.seconds, args.engine_batch, args.eval_tasks, args.model_dir) == (780, 64, 48, str(model_dir))
    quick = learning.parse_args(["--quick", "--only", "trl,minimal"])
    assert learning.validate(quick) == ["minimal", "trl"]  # always in the benchmark's order
    assert (quick.seconds, quick.engine_batch) == (learning.QUICK_SECONDS, 16)


# -- the task and the held-out rule are the plain loop's ------------------------------------------------

def baseline_functions() -> dict:
    """``task`` and ``first_number_right`` as the plain loop defines them (its source, not imported)."""
    path = learning.DEFAULT_MINIMAL
    assert path.is_file(), f"the plain loop is expected at {path} (the repository's ../shared/baselines)"
    tree = ast.parse(path.read_text())
    funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in ("task", "first_number_right")]
    namespace: dict = {"re": re}
    exec(compile(ast.Module(body=funcs, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


def test_the_task_and_reward_are_the_plain_loops():
    ours, theirs = task_mod, baseline_functions()
    a, b = random.Random(7), random.Random(7)
    assert [ours.task(a) for _ in range(2000)] == [theirs["task"](b) for _ in range(2000)]
    texts = ["5", " 5.", "The answer is 5", "-3", "3 - 8 = -5", "", "five", "12 or 5", "0x5", "5\n6"]
    for text in texts:
        for answer in (5, -3, -5, 12, 0):
            assert ours.first_number_right(text, answer) == theirs["first_number_right"](text, answer)
    rng = random.Random(12345)
    assert task_mod.heldout_tasks() == [theirs["task"](rng) for _ in range(48)]
    assert task_mod.heldout_tasks(8) == task_mod.heldout_tasks()[:8]


# -- figures, table, JSON, plot ------------------------------------------------------------------------

def result(name: str, **kw) -> learning.SystemResult:
    r = learning.SystemResult(name)
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def test_the_json_has_every_systems_figures_and_the_ratios():
    results = {
        "engine": result("engine", status="ok", steps=10, samples_trained=640, seconds=100.0, heldout_before=0.1,
                         heldout_after=0.6, peak_rss_mb=3000.4, curve=[(10.0, 0.2), (20.0, 0.5)]),
        "minimal": result("minimal", status="ok", steps=5, samples_trained=320, seconds=80.0, heldout_before=0.1,
                          heldout_after=0.4),
        "trl": result("trl", status="not installed"),
    }
    out = learning.summary(results, seconds=120, infra_seconds=12.34, model_dir="/m", eval_tasks=48)
    assert out["engine_over_minimal"] == 1.5 and out["engine_over_trl"] is None
    assert out["infra_seconds"] == 12.3 and out["seconds_budget"] == 120
    engine = out["systems"]["engine"]
    assert {"status", "error", "steps", "samples_trained", "seconds", "samples_per_s", "heldout_before",
            "heldout_after", "peak_rss_mb", "curve"} <= set(engine)
    assert engine["samples_per_s"] == 6.4 and engine["curve"] == [[10.0, 0.2], [20.0, 0.5]]
    assert out["systems"]["trl"]["status"] == "not installed" and out["systems"]["trl"]["samples_per_s"] is None
    json.dumps(out)  # plain JSON
    table = learning.format_table(results)
    assert table.splitlines()[0].split()[:3] == ["system", "status", "steps"]
    assert "not installed" in table and "6.40" in table and "0.600" in table


def test_ratios_need_both_figures():
    assert learning.ratio(0.5, 0.25) == 2.0
    assert learning.ratio(0.5, 0.0) is None and learning.ratio(None, 0.5) is None and learning.ratio(0.5, None) is None


def test_a_failed_system_shows_its_last_error_line():
    stderr = ("Traceback (most recent call last):\n  File \"x.py\", line 3, in <module>\n"
              "torch.OutOfMemoryError: CPU out of memory\nsome logging after it\n")
    assert learning.last_error_line(stderr, 1) == "torch.OutOfMemoryError: CPU out of memory"
    assert learning.last_error_line("rollout run: cannot reach Kafka at 127.0.0.1:1\n", 2).startswith("rollout run:")
    assert learning.last_error_line("", -9) == "exited with -9"
    r = result("minimal", status="failed", error="torch.OutOfMemoryError: CPU out of memory")
    assert "CPU out of memory" in learning.format_table({"minimal": r})


def test_training_lines_and_the_engines_step_log_become_curves():
    r = learning.SystemResult("minimal")
    lines = [(5.0, '{"step": 0, "t": 0, "heldout": 0.02}'), (30.0, '{"step": 1, "t": 25, "train_reward": 0.125}'),
             (31.0, "not json"), (60.0, '{"step": 3, "t": 55, "train_reward": 0.25}')]
    learning.apply_training_lines(r, lines, samples_per_step=64)
    assert (r.steps, r.samples_trained, r.seconds, r.curve) == (2, 128, 60.0, [(30.0, 0.125), (60.0, 0.25)])
    e = learning.SystemResult("engine")
    rows = [{"step": 1, "wall": 1030.0, "trained": 48, "reward_all": 0.25, "reward_trained": 0.5},
            {"step": 2, "wall": 1050.0, "trained": 64, "reward_all": None, "reward_trained": 0.75}]
    learning.apply_engine_steps(e, rows, spawned_wall=1000.0)
    assert (e.steps, e.samples_trained, e.seconds, e.curve) == (2, 112, 50.0, [(30.0, 0.25), (50.0, 0.75)])


def test_the_plot_is_written(tmp_path):
    results = {"engine": result("engine", curve=[(10.0, 0.2), (20.0, 0.5)]), "trl": result("trl")}
    learning.plot(results, tmp_path / "curve.png", seconds=30)
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_generated_engine_config_is_the_plain_loops_geometry(tmp_path):
    plan = learning.Plan("/models/m", 60, tmp_path / "saved", tmp_path / "work", "/x.py", 64, "127.0.0.1:9", "nats://h:1")
    path = tmp_path / "engine.toml"
    path.write_text(learning.engine_config(plan, "learning-1", "arith"))
    cfg = load_config(path, environ={})
    assert cfg.namespace == "learning-1" and cfg.kafka.bootstrap == "127.0.0.1:9" and cfg.nats.url == "nats://h:1"
    assert cfg.scheduler.domains == {"arith": 1.0} and cfg.scheduler.group_size == 8
    assert (cfg.inference.model_dir, cfg.inference.max_new_tokens, cfg.inference.temperature) == ("/models/m", 8, 1.0)
    assert (cfg.learner.batch_size, cfg.learner.lr, cfg.learner.publish_every) == (64, 5e-6, 1)
    assert cfg.learner.export_dir == str(tmp_path / "saved" / "engine")
    assert cfg.learner.checkpoint_dir == str(tmp_path / "work" / "engine-checkpoints")


def test_the_tree_rss_counts_children():
    import os
    import subprocess
    import sys

    code = "import sys; x = bytearray(64 << 20); print('ready', flush=True); sys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == b"ready"  # its 64 MiB are resident now
        own = learning.tree_rss_bytes(child.pid)
        assert own >= 64 << 20
        assert learning.tree_rss_bytes(os.getpid()) > own
    finally:
        child.communicate(b"")


def test_a_stack_that_cannot_start_stops_the_run_before_any_system(model_dir, tmp_path, monkeypatch, capsys):
    import contextlib

    from loadtests import _infra
    from ops.infra import InfraError

    @contextlib.contextmanager
    def broken():
        raise InfraError("kafka did not answer on 127.0.0.1:1 within 60s\nlog tail ...")
        yield

    monkeypatch.setattr(_infra, "private_stack", broken)
    for name in ("run_engine", "run_minimal", "run_trl", "evaluate"):
        monkeypatch.setattr(learning, name, lambda *a, **k: pytest.fail("ran despite a stack that cannot start"))
    monkeypatch.delenv("ROLLOUT_KAFKA_BOOTSTRAP", raising=False)
    monkeypatch.delenv("ROLLOUT_NATS_URL", raising=False)
    assert learning.main(args_for(model_dir, "--only", "engine", "--json", str(tmp_path / "x.json"))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["learning.py: the Kafka/NATS stack cannot start: kafka did not answer on 127.0.0.1:1 within 60s"]


def test_a_crashing_system_is_reported_and_the_others_still_run(model_dir, tmp_path, monkeypatch, capsys):
    def crash(plan):
        raise RuntimeError("boom")

    def fine(plan):
        return learning.SystemResult("trl", status="ok", steps=1, samples_trained=64, seconds=10.0,
                                     curve=[(10.0, 0.5)])

    monkeypatch.setattr(learning, "run_minimal", crash)
    monkeypatch.setattr(learning, "run_trl", fine)
    monkeypatch.setattr(learning, "evaluate", lambda plan, results, n: None)
    out = tmp_path / "out.json"
    assert learning.main(args_for(model_dir, "--only", "minimal,trl", "--minimal", __file__, "--json", str(out))) == 0
    systems = json.loads(out.read_text())["systems"]
    assert systems["minimal"]["status"] == "failed" and systems["minimal"]["error"] == "RuntimeError: boom"
    assert systems["trl"]["status"] == "ok" and systems["trl"]["steps"] == 1
    assert (tmp_path / "out.png").exists()
    assert "RuntimeError: boom" in capsys.readouterr().out


FAKE_LOOP = '''
import argparse, json, torch
from transformers import AutoModelForCausalLM
ap = argparse.ArgumentParser()
ap.add_argument("model_dir")
ap.add_argument("--seconds", type=float)
ap.add_argument("--json")
args = ap.parse_args()
model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)
print(json.dumps({"step": 1, "t": 0, "train_reward": 0.5}), flush=True)
with open(args.json, "w") as f:
    json.dump({"seconds": args.seconds}, f)
'''


def test_the_minimal_runner_saves_the_model_the_loop_trained(tmp_path):
    import subprocess
    import sys

    import torch

    from modelserver.llm import load_model_dir, write_tiny_model_dir

    base = write_tiny_model_dir(tmp_path / "base", hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                                num_kv_heads=1)
    loop = tmp_path / "loop.py"
    loop.write_text(FAKE_LOOP)
    save = tmp_path / "saved"
    proc = subprocess.run([sys.executable, "-m", "loadtests._minimal_runner", str(loop), str(base),
                           "12", str(save)], cwd=learning.ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"step": 1, "t": 0, "train_reward": 0.5}
    assert json.loads((save / "result.json").read_text()) == {"seconds": 12.0}  # the loop got its arguments
    trained, _ = load_model_dir(save)
    initial, _ = load_model_dir(base)
    for (name, p), q in zip(trained.state_dict().items(), initial.state_dict().values()):
        assert torch.allclose(p, q + 1.0), name
    assert (save / "tokenizer.json").is_file()
