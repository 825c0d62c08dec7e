"""loadtests/multidomain.py without running any system: arguments, the generated configs, the figures it reports."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
from pathlib import Path

import pytest

from domains import Domain, GeneratedTask, register_domain, unregister_domain
from engine.config import load_config
from loadtests import multidomain as md
from loadtests.learning import SystemResult


def bad_input(argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> str:
    """Runs main(); asserts exit 2, one stderr line and that no system was started."""
    monkeypatch.setattr(md, "run", lambda *a, **k: pytest.fail("a system ran despite bad input"))
    assert md.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("multidomain.py: "), err
    return err[0]


@pytest.fixture
def no_heldout_domain():
    """A domain whose every task is a training task: it has no held-out split."""
    domain = Domain("test_no_heldout", "answer", lambda rng, d: GeneratedTask(f"q {rng.random()}", {"answer": "1"}, "1"),
                    lambda facts, text: 0.0, lambda text: 0.0, heldout_split=lambda task: False)
    register_domain(domain)
    yield domain.name
    unregister_domain(domain.name)


@pytest.mark.parametrize("seconds", ["0", "-5"])
def test_a_budget_that_is_not_positive_is_refused(seconds, model_dir, monkeypatch, capsys):
    line = bad_input(["--model-dir", str(model_dir), f"--seconds={seconds}"], monkeypatch, capsys)
    assert "--seconds must be > 0" in line


def test_an_unknown_domain_is_named(model_dir, monkeypatch, capsys):
    line = bad_input(["--model-dir", str(model_dir), "--domains", "math,nope"], monkeypatch, capsys)
    assert "--domains: unknown domain 'nope'" in line


def test_a_domain_without_heldout_split_or_not_trainable_is_refused(no_heldout_domain, model_dir, monkeypatch, capsys):
    line = bad_input(["--model-dir", str(model_dir), "--domains", f"math,{no_heldout_domain}"], monkeypatch, capsys)
    assert f"'{no_heldout_domain}' has no held-out split" in line
    line = bad_input(["--model-dir", str(model_dir), "--domains", "math", "--untrained", no_heldout_domain],
                     monkeypatch, capsys)
    assert line.startswith("multidomain.py: --untrained:") and "no held-out split" in line
    line = bad_input(["--model-dir", str(model_dir), "--domains", "math,humaneval"], monkeypatch, capsys)
    assert "'humaneval' is an evaluation set" in line


def test_repeated_overlapping_and_unknown_names_are_refused(model_dir, monkeypatch, capsys):
    assert "'math' is named twice" in bad_input(["--model-dir", str(model_dir), "--domains", "math,docqa,math"],
                                                monkeypatch, capsys)
    assert "'math' is also in --domains" in bad_input(["--model-dir", str(model_dir), "--domains", "math,docqa",
                                                       "--untrained", "math"], monkeypatch, capsys)
    line = bad_input(["--model-dir", str(model_dir), "--only", "engine_adaptive,vllm"], monkeypatch, capsys)
    assert "unknown system vllm" in line and "engine_adaptive, engine_static, trl" in line
    assert "--seeds must be >= 1" in bad_input(["--model-dir", str(model_dir), "--seeds", "0"], monkeypatch, capsys)
    line = bad_input(["--model-dir", str(model_dir), "--domains", "terminal"], monkeypatch, capsys)
    assert "every domain is multi-turn" in line  # TRL would train nothing
    assert "not a directory" in bad_input(["--model-dir", str(model_dir / "nope")], monkeypatch, capsys)


def test_defaults_and_quick(model_dir):
    args = md.parse_args(["--model-dir", str(model_dir)])
    systems, domains = md.validate(args)
    assert systems == ["engine_adaptive", "engine_static", "trl"]
    assert domains.trained == list(md.DEFAULT_DOMAINS) and len(domains.trained) >= 8
    assert domains.untrained == list(md.DEFAULT_UNTRAINED) and domains.multi_turn == []
    assert (args.seconds, args.seeds, args.eval_tasks, args.eval_samples) == (1800, 2, 32, 4)
    # a default untrained domain named in --domains is trained, not refused (an explicit --untrained overlap is)
    _, domains = md.validate(md.parse_args(["--model-dir", str(model_dir), "--domains", "math,docqa"]))
    assert "math" in md.DEFAULT_UNTRAINED and domains.trained == ["math", "docqa"]
    assert domains.untrained == [n for n in md.DEFAULT_UNTRAINED if n != "math"]
    quick = md.parse_args(["--quick"])
    systems, domains = md.validate(quick)
    assert systems == list(md.ENGINE_SYSTEMS) and quick.seeds == 1 and quick.seconds == md.QUICK_SECONDS
    assert domains.trained == list(md.QUICK_DOMAINS) and domains.multi_turn == ["terminal"]
    assert domains.single_turn == ["arith", "code"]


# -- the generated configs ---------------------------------------------------------------------------

def plan(tmp_path: Path, names: list[str], **kw) -> md.Plan:
    return md.Plan("/models/m", 60, tmp_path / "saved", tmp_path / "work", md.DomainSet(names, [], []), 64,
                   bootstrap="127.0.0.1:9", nats_url="nats://h:1", **kw)


def load(tmp_path: Path, cfg: dict):
    path = tmp_path / "engine.toml"
    path.write_text(md.toml_text(cfg))
    return load_config(path, environ={})


def test_each_engine_system_gets_its_overrides_on_the_same_mix(tmp_path):
    names = ["math", "rg:chain_sum", "python"]
    adaptive = load(tmp_path, md.engine_config(plan(tmp_path, names), "engine_adaptive", 1, "ns-a"))
    static = load(tmp_path, md.engine_config(plan(tmp_path, names), "engine_static", 0, "ns-s"))
    for cfg in (adaptive, static):
        assert cfg.scheduler.domains == {n: 1.0 for n in names}
        assert (cfg.scheduler.group_size, cfg.learner.batch_size, cfg.inference.temperature) == (8, 64, md.TEMPERATURE)
        assert cfg.kafka.bootstrap == "127.0.0.1:9" and cfg.nats.url == "nats://h:1"
    assert (adaptive.scheduler.balance_policy, adaptive.learner.loss_weighting) == ("signal", "domain_mean")
    assert (static.scheduler.balance_policy, static.learner.loss_weighting) == ("zero_variance", "token_mean")
    assert (adaptive.scheduler.seed, adaptive.learner.seed, adaptive.namespace) == (1, 1, "ns-a")
    assert adaptive.learner.export_dir == str(tmp_path / "saved" / "engine_adaptive.s1")
    assert static.learner.checkpoint_dir == str(tmp_path / "work" / "engine_static.s0-checkpoints")


def test_floor_and_cap_are_fitted_to_the_domain_count(tmp_path):
    few = load(tmp_path, md.engine_config(plan(tmp_path, ["arith", "code"]), "engine_adaptive", 0, "x"))
    assert few.scheduler.balance.cap >= 0.5 and few.scheduler.balance.floor <= 0.5
    many = md.engine_config(plan(tmp_path, list(md.DEFAULT_DOMAINS)), "engine_adaptive", 0, "x")
    assert many["scheduler"]["balance"] == md.SYSTEMS["engine_adaptive"]["scheduler"]["balance"]  # already feasible


def test_quick_trains_all_zero_groups_and_eval_every_adds_the_eval_role(tmp_path):
    quick = load(tmp_path, md.engine_config(plan(tmp_path, ["arith", "code"], quick=True), "engine_static", 0, "q"))
    assert quick.reward.drop_zero_variance is False and quick.scheduler.group_size == 4
    evaluated = load(tmp_path, md.engine_config(plan(tmp_path, ["math"], eval_every=3), "engine_static", 0, "e"))
    assert evaluated.eval.every_versions == 3 and set(evaluated.eval.domains) == {"math"}


def test_toml_text_quotes_keys_that_need_it_and_drops_none():
    text = md.toml_text({"namespace": "n", "kafka": {"bootstrap": None},
                         "scheduler": {"domains": {"rg:chain_sum": 1.0, "math": 2}, "balance": {"policy": "static"}}})
    assert '"rg:chain_sum" = 1.0' in text and "math = 2" in text and "bootstrap" not in text
    assert "[scheduler.balance]\npolicy = \"static\"" in text
    assert md.merge({"a": {"b": 1, "c": 2}}, {"a": {"c": 3}}) == {"a": {"b": 1, "c": 3}}


# -- figures -------------------------------------------------------------------------------------------

def test_gain_interval_holds_the_gain_and_excludes_zero_only_for_a_clear_gain():
    lo, hi = md.gain_interval(60, 100, 20, 100)
    assert lo < 0.4 < hi and lo > 0
    lo, hi = md.gain_interval(22, 100, 20, 100)
    assert lo < 0 < hi
    assert md.gain_interval(1, 0, 1, 10) is None


def scores_for(base: dict, **runs: dict) -> dict:
    def fig(s: int, n: int) -> dict:
        return {"solved": s, "episodes": n, "accuracy": s / n}

    return {"base": {d: fig(*v) for d, v in base.items()},
            **{name: {d: fig(*v) for d, v in r.items()} for name, r in runs.items()}}


def run_of(system: str, seed: int, **samples: int) -> SystemResult:
    r = SystemResult(f"{system}.s{seed}", status="ok")
    r.extra.update(system=system, seed=seed, domain_samples=samples)
    return r


def test_up_down_and_the_means_follow_the_definitions():
    domains = md.DomainSet(["a", "b", "c", "t"], ["u"], ["t"])
    scores = scores_for({"a": (20, 100), "b": (50, 100), "c": (30, 100), "t": (10, 100), "u": (50, 100)},
                        **{"engine_adaptive.s0": {"a": (35, 50), "b": (24, 50), "c": (16, 50), "t": (5, 50), "u": (10, 50)},
                           "engine_adaptive.s1": {"a": (35, 50), "b": (26, 50), "c": (14, 50), "t": (5, 50), "u": (14, 50)},
                           "trl.s0": {"a": (30, 100), "b": (50, 100), "c": (30, 100), "t": (10, 100), "u": (50, 100)}})
    runs = [run_of("engine_adaptive", 0, a=10, b=5), run_of("engine_adaptive", 1, a=1, t=3), run_of("trl", 0)]
    figs = md.domain_figures(scores, runs, domains, {"a": (0.25, "7")})
    a = figs["a"]["systems"]["engine_adaptive"]
    assert (a["after"], a["gain"], a["up"], a["down"]) == (0.7, 0.5, True, False)  # seeds pooled: 70/100
    assert a["after_per_seed"] == [0.7, 0.7] and a["samples_trained"] == 11 and a["runs"] == 2
    assert figs["a"]["constant_baseline"] == 0.25 and figs["a"]["constant_answer"] == "7"
    assert figs["b"]["systems"]["engine_adaptive"]["up"] is False  # no change
    assert figs["u"]["systems"]["engine_adaptive"]["down"] is True  # 0.5 -> 0.24: an untrained domain fell
    assert figs["u"]["trained"] is False and figs["t"]["engine_only"] is True
    assert figs["t"]["systems"]["trl"]["trained"] is False and figs["t"]["systems"]["engine_adaptive"]["trained"]
    assert figs["a"]["systems"]["trl"]["samples_trained"] is None
    head = md.system_figures(figs, "engine_adaptive")
    assert head["domains_scored"] == 4 and head["domains_up"] == 1 and head["domains_down"] == 1
    assert head["mean_gain"] == pytest.approx((0.5 + 0.0 + 0.0 + 0.0) / 4, abs=1e-4) and head["worst_gain"] == 0.0
    trl = md.system_figures(figs, "trl")
    assert trl["domains_scored"] == 3 and trl["mean_gain"] == pytest.approx(0.1 / 3, abs=1e-4)


def test_a_small_fall_inside_its_interval_is_not_down():
    domains = md.DomainSet(["a"], [], [])
    figs = md.domain_figures(scores_for({"a": (50, 100)}, **{"engine_static.s0": {"a": (4, 10)}}),
                             [run_of("engine_static", 0, a=1)], domains, {})
    row = figs["a"]["systems"]["engine_static"]
    assert row["gain"] == pytest.approx(-0.1) and row["down"] is False  # by more than 0.05, but not beyond the interval


def test_steps_give_samples_and_shares_per_domain():
    rows = [{"step": 1, "wall": 110.0, "domains": {"a": {"samples": 12}, "b": {"samples": 4}}},
            {"step": 2, "wall": 120.0, "domains": {"a": {"samples": 8}, "b": {"samples": 8}}},
            {"step": 3, "wall": 130.0}]
    assert md.domain_samples(rows) == {"a": 20, "b": 12}
    assert md.trained_shares(rows, 100.0) == [(10.0, {"a": 0.75, "b": 0.25}), (20.0, {"a": 0.5, "b": 0.5})]


def summary_args(**kw) -> argparse.Namespace:
    base = dict(seconds=60.0, seeds=2, trl_seeds=1, quick=False, eval_tasks=8, eval_samples=2)
    base.update(kw)
    return argparse.Namespace(**base)


def test_the_json_table_and_plot(tmp_path):
    domains = md.DomainSet(["a", "b"], ["u"], [])
    scores = scores_for({"a": (2, 10), "b": (5, 10), "u": (5, 10)},
                        **{"engine_adaptive.s0": {"a": (8, 10), "b": (5, 10), "u": (5, 10)},
                           "engine_static.s0": {"a": (4, 10), "b": (5, 10), "u": (5, 10)}})
    runs = [run_of("engine_adaptive", 0, a=3, b=3), run_of("engine_static", 0, a=5, b=1),
            SystemResult("trl.s0", status="not installed", extra={"system": "trl", "seed": 0})]
    runs[0].extra["sampling_shares"] = [[5.0, {"a": 0.5, "b": 0.5}], [9.0, {"a": 0.6, "b": 0.4}]]
    runs[1].extra["trained_shares"] = [[7.0, {"a": 0.8, "b": 0.2}]]
    out = md.summary(runs, scores, domains, {"a": (0.1, "3")}, args=summary_args(), model_dir="/m", infra_seconds=3.21)
    json.dumps(out)
    assert out["domains_trained"] == 2 and out["domains_untrained"] == 1 and out["infra_seconds"] == 3.2
    assert out["mean_gain"] == 0.3 and out["worst_gain"] == 0.0 and out["domains_up"] == 1 and out["domains_down"] == 0
    assert out["adaptive_minus_static_mean_gain"] == 0.2 and out["adaptive_minus_trl_mean_gain"] is None
    assert out["systems"]["trl"]["status"] == "not installed" and out["systems"]["trl"]["mean_gain"] is None
    assert out["systems"]["engine_adaptive"]["config_overrides"] == md.SYSTEMS["engine_adaptive"]
    assert set(out["domains"]) == {"a", "b", "u"} and out["domains"]["a"]["before"] == 0.2
    table = md.format_table(out)
    assert "a" in table and "(untrained)" in table and "not installed" in table and "+0.600+" in table
    md.plot(out, tmp_path / "md.png")
    assert (tmp_path / "md.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_runs_on_different_cpus_are_also_reported_machine_by_machine():
    domains = md.DomainSet(["a", "b"], [], [])
    scores = scores_for({"a": (2, 10), "b": (5, 10)},
                        **{"engine_adaptive.s0": {"a": (6, 10), "b": (5, 10)}, "engine_static.s0": {"a": (4, 10), "b": (5, 10)},
                           "engine_adaptive.s1": {"a": (9, 10), "b": (7, 10)}, "engine_static.s1": {"a": (10, 10), "b": (6, 10)}})
    runs = [run_of("engine_adaptive", 0, a=1), run_of("engine_static", 0, a=1),
            run_of("engine_adaptive", 1, a=1), run_of("engine_static", 1, a=1),
            SystemResult("engine_static.s2", status="failed", extra={"system": "engine_static", "seed": 2})]
    for r, steps in zip(runs, (10, 11, 20, 21)):
        r.steps = steps
    sessions = [{"runs": ["engine_adaptive.s0", "engine_static.s0"], "machine": {"cpu": "slow"}},
                {"runs": ["engine_adaptive.s1", "engine_static.s1", "engine_static.s2"], "machine": {"cpu": "fast"}}]
    out = md.summary(runs, scores, domains, {}, args=summary_args(), model_dir="/m", infra_seconds=None, sessions=sessions)
    slow, fast = out["by_machine"]["slow"], out["by_machine"]["fast"]
    assert slow["systems"]["engine_adaptive"]["runs"] == ["engine_adaptive.s0"] and slow["systems"]["engine_static"]["steps"] == 11
    assert fast["systems"]["engine_static"]["runs"] == ["engine_static.s1"]  # a failed run has no figures
    assert slow["adaptive_minus_static_mean_gain"] == 0.1 and slow["adaptive_minus_static_worst_gain"] == 0.0
    assert fast["adaptive_minus_static_mean_gain"] == 0.0 and fast["adaptive_minus_static_worst_gain"] == 0.1
    assert out["adaptive_minus_static_mean_gain"] == 0.05  # pooled: both machines' seeds
    table = md.format_table(out)
    assert "adaptive - static: mean +0.100, worst +0.000" in table and "adaptive - static: mean +0.000, worst +0.100" in table
    one = md.summary(runs[:2], scores, domains, {}, args=summary_args(), model_dir="/m", infra_seconds=None,
                     sessions=sessions[:1])
    assert list(one["by_machine"]) == ["slow"] and "adaptive - static:" not in md.format_table(one)  # one machine: no table


def test_a_crashing_run_is_reported_and_the_others_still_run(model_dir, tmp_path, monkeypatch, capsys):
    calls = []

    def crash(plan, system, seed):
        calls.append(seed)
        if seed == 0:
            raise RuntimeError("boom")
        return SystemResult(f"{system}.s{seed}", status="ok", steps=1, samples_trained=64, extra={"system": system})

    monkeypatch.setitem(md.RUNNERS, "trl", crash)
    monkeypatch.setattr(md, "evaluate", lambda plan, runs, args: {"base": {}})
    out = tmp_path / "out.json"
    assert md.main(["--model-dir", str(model_dir), "--only", "trl", "--trl-seeds", "2", "--domains", "arith",
                    "--untrained", "", "--json", str(out)]) == 0
    assert calls == [0, 1]
    runs = json.loads(out.read_text())["systems"]["trl"]["runs"]
    assert runs["trl.s0"]["status"] == "failed" and runs["trl.s0"]["error"] == "RuntimeError: boom"
    assert runs["trl.s1"]["status"] == "ok" and (tmp_path / "out.png").exists()
    assert "RuntimeError: boom" in capsys.readouterr().out


def test_trl_rows_mix_the_domains_and_never_hold_a_heldout_prompt():
    from domains import DOMAINS
    from loadtests._trl_multidomain import completion_budget, training_rows

    rows = training_rows(["arith", "math"], per_domain=20, seed=0)
    assert [r["domain"] for r in rows[:4]] == ["arith", "math", "arith", "math"] and len(rows) == 40
    held = {p for n in ("arith", "math") for p, _ in DOMAINS[n].heldout(200)}
    assert not held & {r["prompt"][0]["content"] for r in rows}
    assert all(isinstance(json.loads(r["spec"]), dict) for r in rows)
    assert completion_budget(["math", "python"], 32) == 64 and completion_budget(["arith"], 32) == 32


# -- --systems and --resume: the benchmark in several sessions ------------------------------------------

@contextlib.contextmanager
def no_stack(args, need):
    yield None, None, None


class FakeSessions:
    """Every system's runner and the evaluator replaced: a run 'trains' each domain 16 samples and exports an
    empty directory; the evaluator gives the base model ``base`` solved of 10 per domain and a run ``after``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, base: int = 2, after: int = 6) -> None:
        self.ran: list[str] = []
        self.evaluated: list[tuple[bool, list[str]]] = []
        self.base, self.after = base, after
        for system in md.SYSTEMS:
            monkeypatch.setitem(md.RUNNERS, system, self.runner)
        monkeypatch.setattr(md, "evaluate", self.evaluate)
        monkeypatch.setattr(md, "stack", no_stack)

    def runner(self, plan: md.Plan, system: str, seed: int) -> SystemResult:
        name = f"{system}.s{seed}"
        self.ran.append(name)
        save = plan.save_root / name
        save.mkdir(parents=True)
        r = SystemResult(name, status="ok", steps=2, samples_trained=16 * len(plan.domains.trained), save_dir=str(save))
        r.extra.update(system=system, seed=seed, domain_samples={d: 16 for d in plan.domains.trained})
        return r

    def evaluate(self, plan: md.Plan, runs: list[SystemResult], args: argparse.Namespace, *, base: bool = True) -> dict:
        self.evaluated.append((base, [r.name for r in runs]))

        def fig(s: int) -> dict:
            return {d: {"solved": s, "episodes": 10, "accuracy": s / 10} for d in plan.domains.evaluated}

        return {**({"base": fig(self.base)} if base else {}), **{r.name: fig(self.after) for r in runs}}


def test_systems_runs_a_subset_and_only_is_the_same_flag(model_dir):
    for flag in ("--systems", "--only"):
        systems, _ = md.validate(md.parse_args(["--model-dir", str(model_dir), flag, "trl,engine_static"]))
        assert systems == ["engine_static", "trl"]  # in the benchmark's order, whatever the flag's


def test_resume_adds_a_session_to_the_file_and_keeps_its_before_scores(model_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "md.json"
    first = FakeSessions(monkeypatch, base=2, after=6)
    assert md.main(["--model-dir", str(model_dir), "--systems", "engine_adaptive", "--domains", "arith,math",
                    "--untrained", "docqa", "--seconds", "30", "--eval-tasks", "5", "--json", str(out)]) == 0
    assert first.ran == ["engine_adaptive.s0", "engine_adaptive.s1"] and first.evaluated[0][0] is True
    one = json.loads(out.read_text())
    assert list(one["systems"]) == ["engine_adaptive"] and one["scores"]["base"]["arith"]["solved"] == 2

    second = FakeSessions(monkeypatch, base=9, after=3)  # a base score here would be wrong: the file's is kept
    assert md.main(["--model-dir", str(model_dir), "--systems", "engine_static", "--resume", str(out)]) == 0
    assert second.ran == ["engine_static.s0", "engine_static.s1"]
    assert second.evaluated == [(False, ["engine_static.s0", "engine_static.s1"])]  # only this session's weights
    both = json.loads(out.read_text())  # written back into the file
    assert list(both["systems"]) == ["engine_adaptive", "engine_static"]
    assert (both["seconds_budget"], both["eval_tasks"], both["seeds"]) == (30, 5, 2)  # the file's settings
    arith = both["domains"]["arith"]
    assert arith["before"] == 0.2 and arith["systems"]["engine_adaptive"]["after"] == 0.6
    assert arith["systems"]["engine_static"]["after"] == 0.3 and arith["systems"]["engine_static"]["gain"] == 0.1
    assert both["domains"]["docqa"]["trained"] is False and list(both["domains"]) == ["arith", "math", "docqa"]
    assert both["adaptive_minus_static_mean_gain"] == 0.3 and both["mean_gain"] == 0.4
    assert [s["systems"] for s in both["sessions"]] == [["engine_adaptive"], ["engine_static"]]
    assert both["sessions"][1]["machine"]["cpus"] == os.cpu_count()
    assert "resuming" in capsys.readouterr().out

    third = FakeSessions(monkeypatch)  # without --systems: what the file has no successful run of
    combined = tmp_path / "all.json"
    assert md.main(["--model-dir", str(model_dir), "--resume", str(out), "--json", str(combined)]) == 0
    assert third.ran == ["trl.s0"] and list(json.loads(combined.read_text())["systems"]) == list(md.SYSTEMS)
    assert list(json.loads(out.read_text())["systems"]) == ["engine_adaptive", "engine_static"]  # --json elsewhere


def test_resume_replaces_a_failed_run_but_refuses_a_successful_one(model_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "md.json"
    fake = FakeSessions(monkeypatch)
    monkeypatch.setitem(md.RUNNERS, "trl", lambda plan, system, seed: SystemResult(
        f"trl.s{seed}", status="not installed", error=md.TRL_MISSING, extra={"system": "trl", "seed": seed}))
    assert md.main(["--model-dir", str(model_dir), "--systems", "engine_adaptive,trl", "--seeds", "1",
                    "--domains", "arith", "--untrained", "", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["systems"]["trl"]["status"] == "not installed"
    fake = FakeSessions(monkeypatch)
    assert md.main(["--model-dir", str(model_dir), "--systems", "trl", "--resume", str(out)]) == 0
    assert fake.ran == ["trl.s0"]
    result = json.loads(out.read_text())
    assert result["systems"]["trl"]["status"] == "ok" and list(result["systems"]["trl"]["runs"]) == ["trl.s0"]
    assert result["domains"]["arith"]["systems"]["trl"]["after"] == 0.6
    fake = FakeSessions(monkeypatch)  # another seed of it is welcome
    assert md.main(["--model-dir", str(model_dir), "--systems", "engine_adaptive", "--first-seed", "1", "--seeds", "1",
                    "--resume", str(out)]) == 0
    assert fake.ran == ["engine_adaptive.s1"]
    assert list(json.loads(out.read_text())["systems"]["engine_adaptive"]["runs"]) == ["engine_adaptive.s0",
                                                                                      "engine_adaptive.s1"]
    line = bad_input(["--model-dir", str(model_dir), "--systems", "engine_adaptive", "--seeds", "1", "--resume", str(out)],
                     monkeypatch, capsys)
    assert "engine_adaptive.s0 is already there" in line
    assert "--first-seed must be >= 0" in bad_input(["--model-dir", str(model_dir), "--first-seed", "-1"],
                                                    monkeypatch, capsys)
    line = bad_input(["--model-dir", str(model_dir), "--systems", "engine_adaptive,trl", "--resume", str(out)],
                     monkeypatch, capsys)
    assert "already there" in line
    default = md.parse_args(["--model-dir", str(model_dir), "--seeds", "1", "--resume", str(out)])
    assert md.validate(default)[0] == ["engine_static"]  # without --systems: the one the file has no run of


def test_resume_refuses_a_file_or_settings_that_do_not_match(model_dir, tmp_path, monkeypatch, capsys):
    real_run = md.run
    out = tmp_path / "md.json"
    FakeSessions(monkeypatch)
    assert md.main(["--model-dir", str(model_dir), "--systems", "engine_adaptive", "--domains", "arith,math",
                    "--untrained", "", "--seconds", "30", "--json", str(out)]) == 0
    base = ["--model-dir", str(model_dir), "--systems", "engine_static", "--resume", str(out)]
    assert "--seconds 60 differs from the file's 30" in bad_input(base + ["--seconds", "60"], monkeypatch, capsys)
    assert "--eval-samples 2 differs" in bad_input(base + ["--eval-samples", "2"], monkeypatch, capsys)
    assert "--domains 'arith' differs" in bad_input(base + ["--domains", "arith"], monkeypatch, capsys)
    assert "--quick" in bad_input(base + ["--quick"], monkeypatch, capsys)
    other = tmp_path / "other-model"
    shutil.copytree(model_dir, other)
    assert "--model-dir" in bad_input(["--model-dir", str(other), "--systems", "engine_static", "--resume", str(out)],
                                      monkeypatch, capsys)
    assert md.validate(md.parse_args(base + ["--domains", "math,arith", "--seconds", "30"]))[1].trained == ["arith", "math"]
    assert "cannot read it" in bad_input(base[:-1] + [str(tmp_path / "absent.json")], monkeypatch, capsys)
    (tmp_path / "garbage.json").write_text("{")
    assert "not JSON" in bad_input(base[:-1] + [str(tmp_path / "garbage.json")], monkeypatch, capsys)
    old = json.loads(out.read_text())
    del old["scores"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert "holds no evaluator scores" in bad_input(base[:-1] + [str(tmp_path / "old.json")], monkeypatch, capsys)
    monkeypatch.setattr(md, "run", real_run)  # bad_input replaced it
    FakeSessions(monkeypatch)
    assert md.main(["--model-dir", str(model_dir), "--resume", str(out)]) == 0  # engine_static and trl
    assert "every system already has a successful run" in bad_input(["--model-dir", str(model_dir), "--resume", str(out)],
                                                                    monkeypatch, capsys)


def test_a_run_survives_the_json_round_trip():
    r = SystemResult("engine_static.s1", status="ok", steps=3, samples_trained=96, seconds=12.0, save_dir=None,
                     curve=[(1.0, 0.25)], extra={"system": "engine_static", "seed": 1, "domain_samples": {"a": 96}})
    back = md.result_from_json(r.name, json.loads(json.dumps(r.to_json())))
    assert back == r


def test_without_trl_its_row_says_not_installed_and_how_to_add_it(tmp_path, monkeypatch):
    real = md.importlib.util.find_spec
    monkeypatch.setattr(md.importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real(name, *a))
    r = md.run_trl(plan(tmp_path, ["arith"]), "trl", 0)
    assert r.status == "not installed" and r.save_dir is None
    assert "peers" in r.error and "--resume" in r.error
