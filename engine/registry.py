"""Named extension points: one registry class for domains, sandbox backends, inference backends and models.

A :class:`Registry` maps names to items of one kind. Items arrive three ways, and everything that looks a
name up sees all three the same:

- **built-in modules** (``builtin_modules``): imported on the first lookup; each registers its items with
  :meth:`Registry.register` when imported, so importing the registry itself stays cheap;
- **entry points** of the Python packaging group ``entry_point_group`` (``[project.entry-points."GROUP"]``
  in a plugin's ``pyproject.toml``), loaded on the first lookup: every process of a deployment that has
  the plugin installed sees the same items with no code or config change;
- **``module:attr`` names** given to :meth:`Registry.load` (the config's plugin lists call it).

What an entry point or a ``module:attr`` names is handed to the registry's ``adopt`` function, which
registers it (an item, a list of items, a *family*, ...); without one it must be an item.

**Families** are lazily resolved name spaces: ``add_family("rg", family)`` makes every name
``rg:SOMETHING`` resolve through ``family.resolve("SOMETHING")`` on first use, and :meth:`names` list
``family.names()``; a family whose dependency is missing lists its names as unavailable (with why) instead
of failing the process. A plugin that fails to import is recorded in :attr:`Registry.unavailable` with a
one-line reason, and a lookup of a name it would have provided raises :class:`UnknownName` naming it.

Pure Python (``importlib.metadata``), no infrastructure: this is the engine's one registry mechanism.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Generic, Protocol, TypeVar

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

__all__ = ["Family", "PluginError", "Registry", "UnknownName", "import_object"]


class PluginError(ValueError):
    """A plugin (entry point or ``module:attr``) that cannot be loaded; the message names it."""


class UnknownName(KeyError):
    """A name no item is registered under; ``str()`` is the whole sentence (known names, or why unavailable)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown name"


class Family(Protocol[T_co]):
    """A lazily resolved name space of items (e.g. every reasoning-gym dataset as a domain)."""

    def names(self) -> list[str]:
        """The names this family provides, without their prefix."""
        ...

    def resolve(self, name: str) -> T_co:
        """The item ``name`` (no prefix); raises ``KeyError``/``ValueError`` with a reason when it cannot."""
        ...

    def unavailable(self) -> dict[str, str]:
        """Names (no prefix) the family knows but cannot provide here, with why (a missing dependency, ...)."""
        ...


def import_object(spec: str) -> object:
    """The object a ``package.module:attr`` (or ``package.module``) string names; PluginError saying why not."""
    module_name, _, attr = spec.partition(":")
    if not module_name or (":" in spec and not attr):
        raise PluginError(f"{spec!r}: expected 'package.module:attribute'")
    try:
        obj: object = importlib.import_module(module_name)
    except Exception as exc:  # an arbitrary plugin module: any error on import is its own
        raise PluginError(f"{spec}: cannot import {module_name}: {type(exc).__name__}: {exc}") from exc
    for part in attr.split(".") if attr else ():
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise PluginError(f"{spec}: module {module_name} has no attribute {attr!r}") from None
    return obj


class Registry(Mapping[str, T], Generic[T]):
    """Items of one kind by name (a read-only ``Mapping``; see the module docstring)."""

    def __init__(self, kind: str, *, entry_point_group: str | None = None, builtin_modules: Iterable[str] = (),
                 adopt: Callable[[Registry[T], object, str], None] | None = None,
                 check: Callable[[str, T], None] | None = None) -> None:
        self.kind = kind
        self.entry_point_group = entry_point_group
        self.builtin_modules = tuple(builtin_modules)
        self._adopt = adopt
        self._check = check
        self._items: dict[str, T] = {}
        self._origins: dict[str, str] = {}
        self._families: dict[str, Family[T]] = {}
        self._family_origins: dict[str, str] = {}
        self.unavailable: dict[str, str] = {}
        """Plugins and names that could not be loaded here -> one line saying why."""
        self._loaded = False
        self._loading = False

    # -- registration ----------------------------------------------------------------------------
    def register(self, name: str, item: T, *, replace: bool = False, origin: str = "") -> T:
        """Make ``item`` known as ``name``; ValueError if taken (unless ``replace``) or malformed."""
        if not name or any(c.isspace() for c in name):
            raise ValueError(f"{self.kind} name {name!r}: must be non-empty, without spaces")
        prefix = name.partition(":")[0] if ":" in name else None
        if prefix is not None and prefix in self._families:
            raise ValueError(f"{self.kind} {name!r}: the prefix {prefix!r} belongs to a family")
        return self._store(name, item, replace=replace, origin=origin)

    def _store(self, name: str, item: T, *, replace: bool, origin: str) -> T:
        if name in self._items and not replace:
            raise ValueError(f"{self.kind} {name!r} is already registered (from {self._origins.get(name) or 'code'}; "
                             "pass replace=True)")
        if self._check is not None:
            self._check(name, item)
        self._items[name] = item
        self._origins[name] = origin or self._origins.get(name, "")
        self.unavailable.pop(name, None)
        return item

    def unregister(self, name: str) -> T | None:
        """Forget ``name`` (tests that register their own clean up with this); returns the item, if any."""
        self._origins.pop(name, None)
        return self._items.pop(name, None)

    def add_family(self, prefix: str, family: Family[T], *, origin: str = "", replace: bool = False) -> None:
        """Resolve every ``prefix:NAME`` through ``family`` (lazily: nothing is built until asked for)."""
        if not prefix.isidentifier():
            raise ValueError(f"{self.kind} family prefix {prefix!r}: use letters, digits and '_'")
        if prefix in self._families and not replace:
            raise ValueError(f"{self.kind} family {prefix!r} is already registered")
        self._families[prefix] = family
        self._family_origins[prefix] = origin

    def load(self, spec: str) -> None:
        """Import what ``spec`` (``module:attr`` or ``module``) names and adopt it; PluginError if it cannot."""
        self._ensure_loaded()
        obj = import_object(spec)
        if ":" in spec:  # a bare module registers its items on import
            self._adopt_object(obj, spec)

    def _adopt_object(self, obj: object, origin: str) -> None:
        try:
            if self._adopt is not None:
                self._adopt(self, obj, origin)
            else:
                name = getattr(obj, "name", None)
                if not isinstance(name, str):
                    raise TypeError(f"expected a {self.kind} with a name, got {type(obj).__name__}")
                self.register(name, obj, origin=origin)  # type: ignore[arg-type]  # checked by ``check``
        except (TypeError, ValueError) as exc:
            raise PluginError(f"{origin}: {exc}") from exc

    # -- loading -----------------------------------------------------------------------------------
    def _ensure_loaded(self) -> None:
        if self._loaded or self._loading:
            return
        self._loading = True
        try:
            for module in self.builtin_modules:
                importlib.import_module(module)
            if self.entry_point_group:
                for ep in importlib.metadata.entry_points(group=self.entry_point_group):
                    origin = f"entry point {ep.name} = {ep.value}"
                    try:
                        obj = ep.load()
                    except Exception as exc:  # an installed plugin that fails to import: listed, not fatal
                        self.unavailable[ep.name] = f"{origin}: {type(exc).__name__}: {exc}"
                        continue
                    try:
                        self._adopt_object(obj, origin)
                    except PluginError as exc:
                        self.unavailable[ep.name] = str(exc)
            self._loaded = True
        finally:
            self._loading = False

    # -- lookup ------------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> T:
        self._ensure_loaded()
        item = self._items.get(name)
        if item is not None:
            return item
        prefix, sep, rest = name.partition(":")
        family = self._families.get(prefix) if sep else None
        if family is None:
            raise UnknownName(self._unknown(name))
        why = family.unavailable().get(rest)
        if why:
            raise UnknownName(f"{self.kind} {name!r} is unavailable here: {why}")
        try:
            item = family.resolve(rest)
        except (KeyError, ValueError) as exc:
            reason = exc.args[0] if exc.args else exc
            raise UnknownName(f"unknown {self.kind} {name!r}: {reason}") from None
        return self._store(name, item, replace=False, origin=self._family_origins.get(prefix, prefix))

    def _unknown(self, name: str) -> str:
        why = self.unavailable.get(name)
        if why:
            return f"{self.kind} {name!r} is unavailable here: {why}"
        known = sorted(self._items)
        shown = ", ".join(known[:20]) + (f", ... ({len(known)} in all)" if len(known) > 20 else "")
        families = "".join(f", {p}:NAME" for p in sorted(self._families))
        return f"unknown {self.kind} {name!r}; known: {shown}{families}"

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        try:
            self[name]
        except UnknownName:
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        """The registered names, without expanding families (use :meth:`names` for everything)."""
        self._ensure_loaded()
        return iter(list(self._items))

    def __len__(self) -> int:
        self._ensure_loaded()
        return len(self._items)

    def names(self, *, families: bool = True) -> list[str]:
        """Every name, sorted; with ``families``, each family's names too (listing imports the family)."""
        self._ensure_loaded()
        out = set(self._items)
        if families:
            for prefix, family in self._families.items():
                out.update(f"{prefix}:{n}" for n in family.names())
        return sorted(out)

    def unavailable_names(self) -> dict[str, str]:
        """Plugins and family names that cannot be used here, with why (``rollout domains list`` shows them)."""
        self._ensure_loaded()
        out = dict(self.unavailable)
        for prefix, family in self._families.items():
            out.update({f"{prefix}:{n}": why for n, why in family.unavailable().items()})
        return out

    def origin(self, name: str) -> str:
        """Where ``name`` came from: a module, an entry point, a ``module:attr``, a family prefix ('' if code)."""
        return self._origins.get(name, "")
