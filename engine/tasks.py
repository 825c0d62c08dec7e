"""Users' own task files: reading, field mapping, validation, weighted mixing and sharding.

Pure logic (no Kafka/NATS): the scheduler wraps a :class:`TaskFile` as a task source and the
``rollout tasks`` CLI validates and previews with it, so both read a file the same way and a bad row
gets the same error (file, line, field) in both places.

Formats: JSONL (``.jsonl``/``.json``, gzipped as ``.gz``), Parquet (``.parquet``) and a Hugging Face
``datasets`` directory written by ``Dataset.save_to_disk`` (a directory). Rows are numbered from 1 in file
order; for JSONL the row number is the line number.

Layouts: a row is either canonical (:data:`TASK_FIELDS`) or in a registered :class:`Layout`, a benchmark's
own fields (HumanEval's ``task_id, prompt, canonical_solution, test, entry_point``, ...), which its domain's
module declares with :func:`register_layout` and which converts each row to canonical fields. The layout
is recognised from the first row's fields (after the field mapping); every row must then fit it.

Field mapping (``--map``, ``scheduler.task_fields``): canonical field -> a column (``prompt=question``), a
constant (``domain=const:gsm8k`` or ``domain="gsm8k"``) or a template of columns
(``prompt={question}\n\nHint: {hint}``); see :func:`parse_mapping`.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import random
import string
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from engine.tools import is_function_tool

TASK_FIELDS = ("id", "domain", "prompt", "messages", "answer", "tests", "files", "metadata", "max_turns", "tools",
               "spec")
"""The canonical fields of a task row; a field mapping renames a file's columns onto these."""


class TaskFileError(ValueError):
    """A task file that cannot be used; the message names the file, the row (line) and the field."""


@dataclasses.dataclass(frozen=True, slots=True)
class UserTask:
    """One validated task row. ``spec`` is what the domain's verifier reads (answer, tests, files)."""

    id: str
    domain: str
    prompt: str
    spec: dict[str, Any]
    messages: tuple[dict[str, str], ...] = ()
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    max_turns: int | None = None
    tools: tuple[dict[str, Any], ...] | None = None
    """Function schemas declared to the model for this task, in place of its domain's (None: the domain's)."""
    row: int = 0


def read_rows(path: str | Path) -> Iterator[tuple[int, Any]]:
    """Yield ``(row_number, raw_row)`` from a JSONL file, a Parquet file or a saved HF dataset directory."""
    p = Path(path)
    if not p.exists():
        raise TaskFileError(f"{p}: no such file or directory")
    if p.is_dir():
        yield from _read_hf_dir(p)
    elif p.suffix == ".parquet":
        yield from _read_parquet(p)
    else:
        yield from _read_jsonl(p)


def _read_jsonl(p: Path) -> Iterator[tuple[int, Any]]:
    try:
        with (gzip.open(p, "rt", encoding="utf-8") if p.suffix == ".gz" else p.open(encoding="utf-8")) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as exc:
                    raise TaskFileError(f"{p}:{lineno}: malformed JSON: {exc.msg} (column {exc.colno})") from None
    except (gzip.BadGzipFile, EOFError, UnicodeDecodeError) as exc:
        raise TaskFileError(f"{p}: not readable as {'gzipped ' if p.suffix == '.gz' else ''}JSONL: {exc}") from None


def _read_parquet(p: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(p)
    except Exception as exc:  # pyarrow raises several types for a bad file
        raise TaskFileError(f"{p}: not a readable Parquet file: {exc}") from None
    for i, row in enumerate(table.to_pylist(), 1):
        yield i, row


def _read_hf_dir(p: Path) -> Iterator[tuple[int, Any]]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as exc:
        raise TaskFileError(f"{p}: not a saved Hugging Face dataset directory: {exc}") from None
    if isinstance(ds, datasets.DatasetDict):
        if len(ds) != 1:
            raise TaskFileError(f"{p}: a DatasetDict with splits {sorted(ds)}; save one split")
        ds = next(iter(ds.values()))
    for i, row in enumerate(ds, 1):
        yield i, row


CONST_PREFIX = "const:"


def _unescape(text: str) -> str:
    """``\\n``, ``\\t`` and ``\\\\`` in a mapping's constant or template (a shell passes them literally)."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in "nt\\":
            out.append({"n": "\n", "t": "\t", "\\": "\\"}[text[i + 1]])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


@dataclasses.dataclass(frozen=True, slots=True)
class FieldSource:
    """Where one canonical field comes from: a column, a constant, or a template over columns."""

    kind: str
    """``column``, ``const`` or ``template``."""
    value: Any
    """The column name, the constant, or the template's parts: ``(literal, column or None)`` pairs."""
    text: str
    """The mapping as written (``FIELD=...``), for error messages."""

    @property
    def columns(self) -> tuple[str, ...]:
        if self.kind == "column":
            return (self.value,)
        if self.kind == "template":
            return tuple(c for _, c in self.value if c is not None)
        return ()

    def build(self, row: Mapping[str, Any], where: str) -> Any:
        """The field's value for ``row``; a template's missing column is a TaskFileError naming ``where``."""
        if self.kind == "const":
            return self.value
        if self.kind == "column":
            return row.get(self.value)
        missing = [c for c in self.columns if row.get(c) is None]
        if missing:
            raise TaskFileError(f"{where}: --map {self.text}: column {missing[0]!r} is missing "
                                f"(columns: {sorted(row)})")
        return "".join(lit + ("" if col is None else str(row[col])) for lit, col in self.value)


def field_source(field: str, spec: str) -> FieldSource:
    """One mapping value -> a :class:`FieldSource`; ValueError naming the mapping when it is malformed.

    ``const:VALUE`` is a constant (VALUE as JSON when it parses, e.g. ``const:3``, else the text); a JSON
    string in double quotes (``"gsm8k"``) is a constant too; text with ``{COLUMN}`` placeholders is a
    template (``{{``/``}}`` for literal braces, ``\\n`` for a newline); anything else is a column name.
    """
    text = f"{field}={spec}"
    if spec.startswith(CONST_PREFIX):
        body = spec[len(CONST_PREFIX):]
        try:
            return FieldSource("const", json.loads(body), text)
        except json.JSONDecodeError:
            return FieldSource("const", _unescape(body), text)
    if len(spec) >= 2 and spec[0] == spec[-1] == '"':
        try:
            value = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--map {text}: a quoted constant must be a JSON string ({exc.msg})") from None
        return FieldSource("const", value, text)
    if "{" in spec or "}" in spec:
        try:
            parsed = list(string.Formatter().parse(_unescape(spec)))
        except ValueError as exc:
            raise ValueError(f"--map {text}: malformed template ({exc}; write {{{{ and }}}} for literal braces)") from None
        parts: list[tuple[str, str | None]] = []
        for literal, column, fmt, conversion in parsed:
            if column is not None and (not column.strip() or fmt or conversion):
                raise ValueError(f"--map {text}: template placeholders are plain column names like {{question}}, "
                                 f"got {{{column}{'!' + conversion if conversion else ''}{':' + fmt if fmt else ''}}}")
            parts.append((literal, column))
        if not any(c is not None for _, c in parts):
            return FieldSource("const", "".join(lit for lit, _ in parts), text)
        return FieldSource("template", tuple(parts), text)
    return FieldSource("column", spec, text)


def parse_mapping(pairs: Iterable[str]) -> dict[str, str]:
    """``FIELD=COLUMN``, ``FIELD=const:VALUE`` and ``FIELD=TEMPLATE`` strings (the CLIs' ``--map``) -> a field
    mapping (field -> its spec, as :func:`apply_mapping` reads it); ValueError naming a malformed one."""
    out: dict[str, str] = {}
    for pair in pairs:
        field, sep, column = pair.partition("=")
        if not sep or not field or not column:
            raise ValueError(f"--map wants FIELD=COLUMN, FIELD=const:VALUE or FIELD=TEMPLATE, got {pair!r}")
        if field in out:
            raise ValueError(f"--map {pair}: field {field!r} is mapped twice")
        field_source(field, column)
        out[field] = column
    return out


def apply_mapping(row: Mapping[str, Any], mapping: Mapping[str, str], where: str = "") -> dict[str, Any]:
    """``row`` with the mapped fields built (``mapping``: canonical field -> column, constant or template) and the
    columns they read removed; unmapped columns keep their names. A column a rename names but the row lacks
    leaves the field absent (a required field's own error names it); a template's missing column is an error."""
    if not mapping:
        return dict(row)
    sources = [field_source(field, spec) for field, spec in mapping.items()]
    used = {c for src in sources for c in src.columns}
    out = {k: v for k, v in row.items() if k not in used}
    for field, src in zip(mapping, sources):
        if src.kind == "column" and src.value not in row:
            out.pop(field, None)
            continue
        out[field] = src.build(row, where or "row")
    return out


# -- layouts ---------------------------------------------------------------------------------------

LayoutConvert = Callable[[Mapping[str, Any], str], dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class Layout:
    """A benchmark's own row layout: its fields and how one row becomes canonical task fields.

    A row fits when it has every ``required`` field and nothing outside ``required | optional``.
    ``convert(row, where)`` returns canonical fields (:data:`TASK_FIELDS`), ``domain`` included, or raises
    :class:`TaskFileError` naming ``where`` and the bad field.
    """

    name: str
    required: frozenset[str]
    convert: LayoutConvert
    optional: frozenset[str] = frozenset()
    description: str = ""

    def fits(self, fields: Iterable[str]) -> bool:
        keys = set(fields)
        return self.required <= keys <= self.required | self.optional

    def describe(self) -> str:
        extra = f" (optional {', '.join(sorted(self.optional))})" if self.optional else ""
        return f"{self.name} {{{', '.join(sorted(self.required))}}}{extra}"


LAYOUTS: dict[str, Layout] = {}
"""Registered layouts by name (a domain's module registers its benchmark's layout on import)."""


def register_layout(layout: Layout, *, replace: bool = False) -> Layout:
    """Make files in ``layout`` readable as task files."""
    if layout.name in LAYOUTS and not replace:
        raise ValueError(f"task file layout {layout.name!r} is already registered")
    clash = [other.name for other in LAYOUTS.values() if other.name != layout.name and
             (layout.fits(other.required) or other.fits(layout.required))]
    if clash:
        raise ValueError(f"task file layout {layout.name!r}: its fields fit layout {clash[0]!r} too")
    LAYOUTS[layout.name] = layout
    return layout


def detect_layout(fields: Iterable[str], layouts: Iterable[Layout] | None = None) -> Layout | None:
    """The layout whose fields ``fields`` fit, or None (canonical rows, or nothing known)."""
    keys = set(fields)
    if keys <= set(TASK_FIELDS):
        return None
    return next((lay for lay in (LAYOUTS.values() if layouts is None else layouts) if lay.fits(keys)), None)


def _layout_row(raw: Any, where: str, layout: Layout) -> dict[str, Any]:
    if not isinstance(raw, Mapping):
        raise TaskFileError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    keys = {k for k, v in raw.items() if v is not None}
    missing = sorted(layout.required - keys)
    if missing:
        raise TaskFileError(f"{where}: field {missing[0]!r} is missing (the file is in the {layout.describe()} "
                            "layout, recognised from its first row)")
    unknown = sorted(keys - layout.required - layout.optional)
    if unknown:
        raise TaskFileError(f"{where}: field {unknown[0]!r} is not in the {layout.describe()} layout "
                            "(recognised from the file's first row)")
    return layout.convert({k: v for k, v in raw.items() if v is not None}, where)


def _no_layout(where: str, fields: Iterable[str], layouts: Iterable[Layout]) -> TaskFileError:
    known = ["canonical {domain, prompt or messages, answer or tests or spec, id, ...}"]
    known += [lay.describe() for lay in layouts]
    return TaskFileError(f"{where}: fields {sorted(fields)} fit no known layout; known layouts: {'; '.join(known)} "
                         "(or name the domain and map columns with --map FIELD=COLUMN)")


def _absent(raw: Mapping[str, Any], mapping: Mapping[str, str] | None, field: str) -> str:
    """A missing field's hint when the mapping renames a column this row lacks onto it."""
    spec = (mapping or {}).get(field)
    if spec is None or field_source(field, spec).kind != "column" or raw.get(spec) is not None:
        return ""
    return f"; --map {field}={spec}: this row has no column {spec!r} (columns: {sorted(raw)})"


def parse_row(raw: Any, where: str, *, known_domains: Iterable[str], default_domain: str | None = None,
              mapping: Mapping[str, str] | None = None) -> UserTask:
    """One raw row -> a :class:`UserTask`, or a :class:`TaskFileError` naming ``where`` and the field."""
    if not isinstance(raw, Mapping):
        raise TaskFileError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    row = {k: v for k, v in apply_mapping(raw, mapping or {}, where).items() if v is not None}
    unknown = sorted(set(row) - set(TASK_FIELDS))
    if unknown:
        raise TaskFileError(f"{where}: unknown field(s) {unknown}; known: {list(TASK_FIELDS)} "
                            "(map other columns with a field mapping)")
    domain = row.get("domain", default_domain)
    if not domain:
        raise TaskFileError(f"{where}: field 'domain' is missing (and the source names no default domain)"
                            + _absent(raw, mapping, "domain"))
    known = set(known_domains)
    if domain not in known:
        raise TaskFileError(f"{where}: field 'domain': unknown domain {domain!r}; known: {sorted(known)}")
    messages = row.get("messages") or []
    if not isinstance(messages, list) or not all(isinstance(m, Mapping) and "content" in m for m in messages):
        raise TaskFileError(f"{where}: field 'messages': expected a list of {{role, content}} objects")
    prompt = row.get("prompt")
    if prompt is None and messages:
        users = [m["content"] for m in messages if m.get("role", "user") == "user"]
        prompt = users[-1] if users else None
    if not isinstance(prompt, str) or not prompt.strip():
        raise TaskFileError(f"{where}: field 'prompt' (or 'messages' with a user turn) is missing or empty"
                            + _absent(raw, mapping, "prompt"))
    spec = dict(row.get("spec") or {})
    if "answer" in row:
        spec["answer"] = str(row["answer"])
    if "tests" in row:
        if not isinstance(row["tests"], list):
            raise TaskFileError(f"{where}: field 'tests': expected a list")
        spec["tests"] = row["tests"]
    if "files" in row:
        if not isinstance(row["files"], Mapping):
            raise TaskFileError(f"{where}: field 'files': expected an object of path -> content")
        spec["files"] = dict(row["files"])
    if not any(k in spec for k in ("answer", "tests", "checks", "goals")):
        raise TaskFileError(f"{where}: field 'answer' is missing (a task needs an answer, tests or a spec to verify)"
                            + _absent(raw, mapping, "answer"))
    metadata = row.get("metadata") or {}
    if not isinstance(metadata, Mapping):
        raise TaskFileError(f"{where}: field 'metadata': expected an object")
    max_turns = row.get("max_turns")
    if max_turns is not None and (not isinstance(max_turns, int) or max_turns < 1):
        raise TaskFileError(f"{where}: field 'max_turns': expected a positive integer")
    tools = row.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(is_function_tool(t) for t in tools)):
        raise TaskFileError(f'{where}: field \'tools\': expected a list of {{"type": "function", "function": '
                            f'{{"name", ...}}}} objects')
    return UserTask(id=str(row.get("id", "")), domain=domain, prompt=prompt, spec=spec,
                    messages=tuple(dict(m) for m in messages), metadata=dict(metadata), max_turns=max_turns,
                    tools=tuple(dict(t) for t in tools) if tools is not None else None)


class TaskFile:
    """A validated task file: rows in order, ids unique (a row without an id gets ``<file>:<row>``)."""

    def __init__(self, path: str | Path, *, known_domains: Iterable[str], default_domain: str | None = None,
                 mapping: Mapping[str, str] | None = None, layouts: Iterable[Layout] | None = None) -> None:
        self.path = Path(path)
        self.tasks: list[UserTask] = []
        self.layout: Layout | None = None
        """The benchmark layout recognised from the first row (None: canonical rows)."""
        seen: dict[str, int] = {}
        known = list(known_domains)  # first: looking the domains up registers their modules' layouts
        candidates = list(LAYOUTS.values() if layouts is None else layouts)
        first = True
        for n, raw in read_rows(self.path):
            where = f"{self.path}:{n}"
            if first:
                self.layout = self._recognise(raw, where, candidates, default_domain, mapping)
                first = False
            if self.layout is not None:
                raw = _layout_row(apply_mapping(raw, mapping or {}, where), where, self.layout)
                task = parse_row(raw, where, known_domains=known)
            else:
                task = parse_row(raw, where, known_domains=known, default_domain=default_domain, mapping=mapping)
            task_id = task.id or f"{self.path.name}:{n}"
            if task_id in seen:
                raise TaskFileError(f"{where}: field 'id': duplicate id {task_id!r} (first on row {seen[task_id]})")
            seen[task_id] = n
            self.tasks.append(dataclasses.replace(task, id=task_id, row=n))
        if not self.tasks:
            raise TaskFileError(f"{self.path}: no tasks")

    @staticmethod
    def _recognise(raw: Any, where: str, layouts: list[Layout], default_domain: str | None,
                   mapping: Mapping[str, str] | None) -> Layout | None:
        """The first row's layout; canonical (None) when it names a domain, has a default or a mapping."""
        if not isinstance(raw, Mapping):
            return None  # parse_row names the problem
        fields = {k for k, v in apply_mapping(raw, mapping or {}, where).items() if v is not None}
        layout = detect_layout(fields, layouts)
        if layout is not None or fields <= set(TASK_FIELDS) or "domain" in fields or default_domain or mapping:
            return layout
        raise _no_layout(where, fields, layouts)


def shard(tasks: Sequence[UserTask], replica: int, replicas: int) -> list[UserTask]:
    """Replica ``replica`` of ``replicas`` takes every ``replicas``-th task: disjoint shares covering all."""
    if replicas < 1 or not 0 <= replica < replicas:
        raise ValueError(f"replica {replica} of {replicas}: need 0 <= replica < replicas")
    return list(tasks[replica::replicas])


class WeightedMix:
    """Draw from several finite task lists by weight, in a seeded and therefore resumable order.

    The position is one integer per source (how many tasks each has issued), so a restart that restores
    :attr:`positions` continues exactly: no task issued twice, none skipped. An exhausted source drops
    out of the draw; :meth:`next` returns None when all are exhausted.
    """

    def __init__(self, sources: Mapping[str, Sequence[UserTask]], weights: Mapping[str, float], *, seed: int = 0,
                 positions: Mapping[str, int] | None = None) -> None:
        bad = {k: w for k, w in weights.items() if w <= 0}
        if bad:
            raise ValueError(f"source weights must be positive: {bad}")
        self._sources = {k: list(v) for k, v in sources.items()}
        self._weights = {k: float(weights.get(k, 1.0)) for k in self._sources}
        self._seed = seed
        self.positions: dict[str, int] = {k: int((positions or {}).get(k, 0)) for k in self._sources}

    def next(self) -> tuple[str, UserTask] | None:
        live = [k for k in sorted(self._sources) if self.positions[k] < len(self._sources[k])]
        if not live:
            return None
        # The draw depends only on the seed and the positions, so it replays identically after a restart.
        rng = random.Random(f"{self._seed}:" + ",".join(f"{k}={self.positions[k]}" for k in sorted(self.positions)))
        name = rng.choices(live, weights=[self._weights[k] for k in live])[0]
        task = self._sources[name][self.positions[name]]
        self.positions[name] += 1
        return name, task
