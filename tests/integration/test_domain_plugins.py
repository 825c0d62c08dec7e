"""Domains from outside the project: an installed package's ``rollout_engine.domains`` entry point and a
config's ``[domains] plugins`` are loaded by separate ``rollout`` processes, listed, and evaluated for real.

The plugin package is written here into a temporary directory with the ``.dist-info`` pip would write, and
put on the subprocesses' ``PYTHONPATH``: nothing in the project names it, no code change loads it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
ROLLOUT = [sys.executable, "-m", "ops.cli"]

PLUGIN = '''
"""A third party's domains: one single-turn, one multi-turn shell domain, in one file."""
import random

from domains import Domain, GeneratedTask, answer_reward


def make_upper(rng: random.Random, difficulty: float) -> GeneratedTask:
    word = "".join(rng.choice("abcdefgh") for _ in range(3 + round(3 * difficulty)))
    return GeneratedTask(prompt=f"upper {word}:", spec={"word": word}, ideal=word.upper())


async def verify_upper(text: str, spec: dict, pool: object) -> dict:
    return {"correct": text.strip() == spec["word"].upper()}


def make_touch(rng: random.Random, difficulty: float) -> GeneratedTask:
    name = rng.choice("abcdefgh") + str(rng.randint(0, 99))
    return GeneratedTask(prompt=f"# goal: create {name}\\n$ ", ideal=f"touch {name}\\n",
                         spec={"checks": [{"cmd": f"test -e {name}"}], "max_turns": 2})


UPPER = Domain("acme_upper", verify_upper, make_upper, answer_reward, lambda text: 1.0,
               source="acme", description="upper-case a word")
TOUCH = Domain("acme_touch", "terminal", make_touch,
               lambda facts, text: float(facts.get("checks_passed", 0)), lambda text: 1.0,
               max_turns=2, episode="shell", source="acme")
DOMAINS = [UPPER, TOUCH]
'''


def _plugin_site(root: Path, entry_points: str) -> Path:
    site = root / "site"
    site.mkdir()
    (site / "acme_domains.py").write_text(PLUGIN)
    info = site / "acme_domains-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-domains\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(entry_points)
    return site


def _run(args: list[str], site: Path, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]))
    return subprocess.run(ROLLOUT + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_an_entry_point_plugin_is_listed_by_another_process(tmp_path: Path) -> None:
    site = _plugin_site(tmp_path, "[rollout_engine.domains]\nacme = acme_domains:DOMAINS\n"
                                  "broken = acme_missing_module:DOMAIN\n")
    result = _run(["domains", "list", "--json"], site)
    assert result.returncode == 0, result.stderr
    rows = {r["name"]: r for r in map(json.loads, result.stdout.splitlines())}
    assert rows["acme_upper"]["available"] and rows["acme_upper"]["origin"] == "entry point acme = acme_domains:DOMAINS"
    assert rows["acme_upper"]["sandbox"] is False and rows["acme_upper"]["episode"] == "single"
    assert rows["acme_touch"]["episode"] == "shell" and rows["acme_touch"]["sandbox"] is True
    assert rows["math"]["available"]  # the built-in ones are all still there
    broken = rows["broken"]
    assert not broken["available"] and "acme_missing_module" in broken["why"] and "ModuleNotFoundError" in broken["why"]


def test_config_plugins_load_and_a_bad_one_is_one_line(tmp_path: Path) -> None:
    site = _plugin_site(tmp_path, "")
    good = tmp_path / "good.toml"
    good.write_text('[domains]\nplugins = ["acme_domains:UPPER"]\n')
    result = _run(["domains", "list", "--config", str(good)], site)
    assert result.returncode == 0, result.stderr
    assert any(line.startswith("acme_upper ") for line in result.stdout.splitlines())
    assert "acme_touch" not in result.stdout  # only what the config named
    bad = tmp_path / "bad.toml"
    bad.write_text('[domains]\nplugins = ["acme_domains:NOPE"]\n')
    result = _run(["domains", "list", "--config", str(bad)], site)
    assert result.returncode == 2
    assert result.stderr.strip() == "rollout domains list: acme_domains:NOPE: module acme_domains has no attribute 'NOPE'"


def test_an_entry_point_domain_is_evaluated_end_to_end(tmp_path: Path) -> None:
    """`rollout eval` in its own process: the plugin's tasks on the local server, its verifiers, a real sandbox."""
    from modelserver.llm import write_tiny_model_dir

    model = write_tiny_model_dir(tmp_path / "model", seed=0)
    site = _plugin_site(tmp_path, "[rollout_engine.domains]\nacme = acme_domains:DOMAINS\n")
    out = tmp_path / "eval.json"
    result = _run(["eval", "--model-dir", str(model), "--domain", "acme_upper=3", "--domain", "acme_touch=2",
                   "--max-new-tokens", "8", "--json", str(out)], site, timeout=200)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    text = json.dumps(report)
    assert "acme_upper" in text and "acme_touch" in text
    episodes = [e for e in report["episodes"] if e["domain"] == "acme_touch"]
    assert len(episodes) == 2 and all(e["turns"] >= 1 for e in episodes)
