"""docs/architecture.md's module map matches the code, and the code keeps the house rules, with no exceptions:

- **layering**: a module imports only its own package and the packages below it (``LAYERS``; imports made
  inside functions count), and engine/ imports no infrastructure;
- **no circles**: no import cycle between project modules (function-level imports included);
- **actors/ holds the roles and their runtime** (``ACTOR_MODULES``).

Each rule is also run against a synthetic tree that breaks it, so a rule that cannot fail would show.
"""

from __future__ import annotations

from pathlib import Path

from ops import modmap

# Infrastructure the engine package must not depend on (docs/architecture.md, "Layout").
INFRASTRUCTURE = {"kafka", "nats", "docker", "torch", "sglang", "opentelemetry"}
# Package -> its floor (docs/architecture.md, "Layering"): a package may import packages of a lower floor,
# never one of its own floor or above (streams and sandboxes know nothing of each other).
LAYERS = {"engine": 0, "streams": 1, "sandboxes": 1, "modelserver": 2, "domains": 2, "learning": 2,
          "actors": 3, "ops": 4, "loadtests": 5}
# What may live in actors/: the roles and what they run on (docs/architecture.md, "actors/").
ACTOR_MODULES = {
    "actors", "actors.runtime", "actors.tracing",  # the roles' shared runtime
    "actors.scheduler", "actors.reward", "actors.export",
    "actors.learner", "actors.learner_checkpoint", "actors.learner_sim",
    "actors.eval_role", "actors.evaluate",
    "actors.inference", "actors.inference.actor", "actors.inference.resume",
    "actors.sandbox", "actors.sandbox.episode", "actors.sandbox.resources", "actors.sandbox.settings",
    "actors.sandbox.verify",
}


def layering_violations(modules: list[modmap.Module]) -> dict[str, list[str]]:
    """Module -> the imports that go sideways or up (``LAYERS``)."""
    found: dict[str, list[str]] = {}
    for m in modules:
        bad = sorted(d for d in m.project
                     if d.split(".", 1)[0] != m.package and LAYERS[d.split(".", 1)[0]] >= LAYERS[m.package])
        if bad:
            found[m.name] = bad
    return found


def misplaced_actor_modules(modules: list[modmap.Module]) -> list[str]:
    """Modules in actors/ that are not roles or their runtime."""
    return sorted(m.name for m in modules if m.package == "actors" and m.name not in ACTOR_MODULES)


def test_every_package_has_a_floor() -> None:
    assert set(LAYERS) == set(modmap.PACKAGES)


def test_generated_module_map_is_current() -> None:
    doc = modmap.DOC.read_text(encoding="utf-8")
    assert modmap.BEGIN in doc and modmap.END in doc, "docs/architecture.md lost its modmap markers"
    assert modmap.splice(doc, modmap.render(modmap.collect())) == doc, (
        "docs/architecture.md module map is stale; run: python -m ops.modmap --write")


def test_check_mode_reports_a_stale_map(tmp_path: Path, monkeypatch) -> None:
    stale = tmp_path / "architecture.md"
    stale.write_text(f"# Architecture\n\nhand-written\n\n{modmap.BEGIN}\nSTALE-CONTENT\n{modmap.END}\n", encoding="utf-8")
    monkeypatch.setattr(modmap, "DOC", stale)
    monkeypatch.setattr(modmap, "ROOT", tmp_path)
    assert modmap.main(["--check"]) == 1
    assert modmap.main(["--write"]) == 0
    rewritten = stale.read_text(encoding="utf-8")
    assert rewritten.startswith("# Architecture\n\nhand-written\n\n") and "STALE-CONTENT" not in rewritten
    assert modmap.main(["--check"]) == 0


def test_engine_imports_no_infrastructure() -> None:
    engine = [m for m in modmap.collect() if m.package == "engine"]
    assert engine, "no engine modules found"
    offending = {m.name: sorted(m.external & INFRASTRUCTURE) for m in engine if m.external & INFRASTRUCTURE}
    assert not offending, f"engine/ must not import infrastructure: {offending}"
    upward = {m.name: sorted(m.project) for m in engine if any(d.split(".")[0] != "engine" for d in m.project)}
    assert not upward, f"engine/ must not import other project packages: {upward}"


def test_imports_go_only_down_the_layers() -> None:
    violations = layering_violations(modmap.collect())
    assert not violations, f"imports sideways or up the layers (docs/architecture.md, Layering): {violations}"


def test_no_import_cycles() -> None:
    cycles = modmap.import_cycles(modmap.import_graph(modmap.collect()))
    assert not cycles, f"import cycles between project modules: {cycles}"


def test_actors_holds_roles_and_their_runtime_only() -> None:
    modules = modmap.collect()
    assert not misplaced_actor_modules(modules), (
        f"not a role or its runtime, move it below actors/ (or add it to ACTOR_MODULES if it is a role): "
        f"{misplaced_actor_modules(modules)}")
    below = {m.name: sorted(d for d in m.project if d.startswith("actors")) for m in modules
             if m.package in ("modelserver", "domains", "learning", "engine", "streams", "sandboxes")}
    assert not {k: v for k, v in below.items() if v}, f"packages below actors/ import it: {below}"


def test_imports_are_resolved_including_relative_and_nested(tmp_path: Path) -> None:
    pkg = tmp_path / "engine"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("", encoding="utf-8")
    src = pkg / "thing.py"
    src.write_text('"""Does a thing.\n\nMore."""\nfrom . import topics\n'
                   'def f():\n    import torch\n    from streams.kafka import Producer\n', encoding="utf-8")
    mod = modmap.read_module(src, tmp_path)
    assert mod.name == "engine.thing" and mod.purpose == "Does a thing."
    assert mod.project == {"engine", "streams.kafka"} and mod.external == {"torch"}


# --- each rule can fail: a synthetic tree that breaks it --------------------------------------------

def _tree(root: Path, files: dict[str, str]) -> list[modmap.Module]:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(root).parents:
            if parent != Path(".") and not (root / parent / "__init__.py").exists():
                (root / parent / "__init__.py").write_text("", encoding="utf-8")
        path.write_text(f'"""{rel}."""\n{text}', encoding="utf-8")
    return modmap.collect(root)


def test_the_layering_rule_fails_on_an_arrow_up_or_sideways(tmp_path: Path) -> None:
    modules = _tree(tmp_path, {
        "engine/config.py": "def f():\n    from modelserver.backends import BACKENDS\n",  # up, in a function
        "actors/role.py": "import ops.infra.config\n",  # up
        "streams/log.py": "from sandboxes import pool\n",  # sideways, same floor
        "modelserver/backends.py": "from engine.config import X\nfrom streams import log\n",  # down: fine
    })
    assert layering_violations(modules) == {"engine.config": ["modelserver.backends"],
                                            "actors.role": ["ops.infra.config"], "streams.log": ["sandboxes"]}


def test_the_cycle_rule_fails_on_a_circle_through_a_function_level_import(tmp_path: Path) -> None:
    modules = _tree(tmp_path, {
        "sandboxes/bwrap.py": "def reap():\n    from sandboxes.reaper import reap\n",
        "sandboxes/reaper.py": "from sandboxes import bwrap\n",
        "sandboxes/pool.py": "from sandboxes.bwrap import reap\nfrom sandboxes import *\n",
        "engine/a.py": "from . import b\n", "engine/b.py": "from .c import X\n", "engine/c.py": "import engine.a\n",
    })
    graph = modmap.import_graph(modules)
    assert graph["sandboxes.reaper"] == {"sandboxes.bwrap"} and graph["sandboxes.pool"] == {"sandboxes.bwrap",
                                                                                             "sandboxes"}
    assert modmap.import_cycles(graph) == [["engine.a", "engine.b", "engine.c"], ["sandboxes.bwrap", "sandboxes.reaper"]]
    assert modmap.import_cycles({"a": {"b"}, "b": set()}) == []


def test_the_actors_rule_fails_on_a_module_that_is_not_a_role(tmp_path: Path) -> None:
    modules = _tree(tmp_path, {"actors/scheduler.py": "", "actors/inference/sim_server.py": "",
                               "domains/thing.py": "from actors.scheduler import X\n"})
    assert misplaced_actor_modules(modules) == ["actors.inference.sim_server"]
    assert layering_violations(modules) == {"domains.thing": ["actors.scheduler"]}
