"""The root .dockerignore (classic builder) and deploy/Dockerfile.dockerignore (BuildKit) keep one rule set."""

from __future__ import annotations

import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def rules(path: Path) -> list[str]:
    return [ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def ignored(rule_list: list[str], path: str) -> bool:
    """Docker's matching, as far as these rules need it: the last matching rule wins."""
    out = False
    for rule in rule_list:
        negate = rule.startswith("!")
        pattern = rule[1:] if negate else rule
        pattern = pattern.rstrip("/")
        hit = (pattern == "**" or fnmatch.fnmatch(path, pattern) or path.startswith(pattern + "/")
               or (pattern.startswith("**/") and any(fnmatch.fnmatch(part, pattern[3:]) for part in path.split("/"))))
        if hit:
            out = not negate
    return out


def test_root_dockerignore_matches_the_dockerfiles() -> None:
    assert rules(ROOT / ".dockerignore") == rules(ROOT / "deploy" / "Dockerfile.dockerignore")


def test_the_context_holds_the_sources_and_not_the_local_state() -> None:
    r = rules(ROOT / ".dockerignore")
    for path in (".venv/lib/python3.11/site-packages/torch/__init__.py", "runs/demo/model/model.safetensors",
                 ".state/infra/kafka/data/meta.properties", ".cache/x", ".pytest_cache/v", "tests/unit/test_cli.py",
                 "ops/__pycache__/cli.cpython-311.pyc"):
        assert ignored(r, path), path
    for path in ("pyproject.toml", "engine/config.py", "ops/cli.py", "deploy/examples/deploy.toml"):
        assert not ignored(r, path), path
