"""engine/registry.py: the one registry mechanism (built-in modules, entry points, module:attr, families)."""

from __future__ import annotations

import dataclasses
import sys
import textwrap
from pathlib import Path

import pytest

from engine.registry import PluginError, Registry, UnknownName, import_object


@dataclasses.dataclass(frozen=True)
class Item:
    name: str
    value: int = 0


class Evens:
    """A family: ``ev:N`` for even N below 10; odd ones are known but unavailable."""

    prefix = "ev"

    def __init__(self) -> None:
        self.resolved: list[str] = []

    def names(self) -> list[str]:
        return [str(n) for n in range(0, 10, 2)]

    def resolve(self, name: str) -> Item:
        self.resolved.append(name)
        if not name.isdigit() or int(name) % 2 or int(name) >= 10:
            raise KeyError(f"no such number {name!r}")
        return Item(f"ev:{name}", int(name))

    def unavailable(self) -> dict[str, str]:
        return {"1": "odd numbers are excluded: not even"}


def test_register_lookup_and_clear_errors() -> None:
    reg: Registry[Item] = Registry("thing")
    reg.register("a", Item("a", 1))
    assert reg["a"].value == 1 and "a" in reg and "b" not in reg and list(reg) == ["a"] and len(reg) == 1
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a", Item("a", 2))
    reg.register("a", Item("a", 2), replace=True)
    assert reg["a"].value == 2
    with pytest.raises(UnknownName, match=r"unknown thing 'zz'; known: a"):
        reg["zz"]
    with pytest.raises(ValueError, match="without spaces"):
        reg.register("a b", Item("a b"))
    assert reg.unregister("a") is not None and "a" not in reg


def test_family_resolves_lazily_and_lists_unavailable_with_why() -> None:
    reg: Registry[Item] = Registry("thing")
    fam = Evens()
    reg.add_family("ev", fam)
    assert fam.resolved == []  # nothing built until asked
    assert reg.names() == ["ev:0", "ev:2", "ev:4", "ev:6", "ev:8"] and list(reg) == []
    assert reg["ev:4"].value == 4 and fam.resolved == ["4"]
    assert reg["ev:4"] is reg["ev:4"] and fam.resolved == ["4"]  # resolved once, then registered
    with pytest.raises(UnknownName, match="'ev:1' is unavailable here: odd numbers are excluded"):
        reg["ev:1"]
    with pytest.raises(UnknownName, match="unknown thing 'ev:12': no such number"):
        reg["ev:12"]
    assert reg.unavailable_names() == {"ev:1": "odd numbers are excluded: not even"}
    with pytest.raises(ValueError, match="belongs to a family"):
        reg.register("ev:3", Item("ev:3"))


def test_module_attr_loading_and_bad_specs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "reg_plugin_mod.py").write_text(textwrap.dedent("""
        import dataclasses

        @dataclasses.dataclass(frozen=True)
        class Thing:
            name: str

        ONE = Thing("one")
    """))
    (tmp_path / "reg_broken_mod.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg: Registry[object] = Registry("thing")
    reg.load("reg_plugin_mod:ONE")
    assert reg.origin("one") == "reg_plugin_mod:ONE" and reg["one"].name == "one"  # type: ignore[attr-defined]
    with pytest.raises(PluginError, match="reg_broken_mod:X: cannot import reg_broken_mod: RuntimeError: boom"):
        reg.load("reg_broken_mod:X")
    with pytest.raises(PluginError, match="has no attribute 'NOPE'"):
        reg.load("reg_plugin_mod:NOPE")
    with pytest.raises(PluginError, match="expected 'package.module:attribute'"):
        import_object("reg_plugin_mod:")
    with pytest.raises(PluginError, match="expected a thing with a name, got int"):
        reg.load("sys:maxsize")
    sys.modules.pop("reg_plugin_mod", None)


def _dist(site: Path, name: str, entry_points: str) -> None:
    """A minimal installed distribution (what pip writes): importlib.metadata finds its entry points."""
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(entry_points)


def test_entry_points_load_on_first_lookup_and_a_broken_one_is_listed(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "reg_ep_mod.py").write_text(
        "import dataclasses\n\n@dataclasses.dataclass(frozen=True)\nclass T:\n    name: str\n\nGOOD = T('good')\n")
    _dist(tmp_path, "reg-ep-demo", "[test.reg.group]\ngood = reg_ep_mod:GOOD\nbad = reg_ep_missing_mod:X\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg: Registry[object] = Registry("thing", entry_point_group="test.reg.group")
    assert "good" in reg and reg.origin("good") == "entry point good = reg_ep_mod:GOOD"
    assert "bad" in reg.unavailable and "ModuleNotFoundError" in reg.unavailable["bad"]
    with pytest.raises(UnknownName, match="'bad' is unavailable here: entry point bad = reg_ep_missing_mod:X"):
        reg["bad"]
    sys.modules.pop("reg_ep_mod", None)
