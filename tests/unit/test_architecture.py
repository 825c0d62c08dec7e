"""docs/architecture.md's module map matches the code, and engine/ keeps to its layering rule."""

from __future__ import annotations

from pathlib import Path

from ops import modmap

# Infrastructure the engine package must not depend on (docs/architecture.md, "Layout").
INFRASTRUCTURE = {"kafka", "nats", "docker", "torch", "sglang", "opentelemetry"}
# The one upward dependency allowed: engine/config.py validates `inference.backend` and `sandbox.backend`
# against the backend registries, imported inside the validators (function-level), so that a name
# registered by a plugin module is accepted. The registries themselves import no infrastructure at
# import time (their built-in backends load on first lookup).
REGISTRY_LOOKUPS = {"engine.config": {"modelserver.backends", "sandboxes.registry"}}


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
    upward = {m.name: sorted(m.project - REGISTRY_LOOKUPS.get(m.name, set())) for m in engine
              if any(not d.startswith("engine") for d in m.project - REGISTRY_LOOKUPS.get(m.name, set()))}
    assert not upward, f"engine/ must not import other project packages: {upward}"


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
