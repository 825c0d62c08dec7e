"""Users' task files: reading JSONL/Parquet/HF dirs, validation errors, mixing, sharding, resumption."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.tasks import TaskFile, TaskFileError, WeightedMix, shard
from ops.cli import main as cli_main

KNOWN = ["math", "python"]
ROWS = [
    {"id": "a", "domain": "math", "prompt": "What is 2 + 3? Answer with just the number.", "answer": 5},
    {"id": "b", "domain": "python", "messages": [{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "Write f(x) returning x."}],
     "tests": [{"name": "t", "code": "from solution import f\nassert f(1) == 1\n"}]},
    {"domain": "math", "prompt": "What is 1 + 1?", "answer": "2", "metadata": {"src": "user"}},
]


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_jsonl_fields_are_mapped_to_specs(tmp_path: Path) -> None:
    tf = TaskFile(_jsonl(tmp_path / "t.jsonl", ROWS), known_domains=KNOWN)
    a, b, c = tf.tasks
    assert (a.id, a.domain, a.spec) == ("a", "math", {"answer": "5"})
    assert b.prompt == "Write f(x) returning x." and len(b.messages) == 2 and "tests" in b.spec
    assert c.id == "t.jsonl:3" and c.metadata == {"src": "user"} and c.row == 3


@pytest.mark.parametrize("rows, message", [
    ([ROWS[0], "{not json"], r"t.jsonl:2: malformed JSON"),
    ([dict(ROWS[0], colour="red")], r"t.jsonl:1: unknown field\(s\) \['colour'\]"),
    ([{"domain": "math", "prompt": "x?"}], r"t.jsonl:1: field 'answer' is missing"),
    ([ROWS[0], ROWS[0]], r"t.jsonl:2: field 'id': duplicate id 'a' \(first on row 1\)"),
    ([dict(ROWS[0], domain="chess")], r"t.jsonl:1: field 'domain': unknown domain 'chess'"),
    ([{"domain": "math", "answer": "1"}], r"t.jsonl:1: field 'prompt'"),
])
def test_bad_rows_name_line_and_field(tmp_path: Path, rows: list, message: str) -> None:
    with pytest.raises(TaskFileError, match=message):
        TaskFile(_jsonl(tmp_path / "t.jsonl", rows), known_domains=KNOWN)


def test_parquet_with_field_mapping(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"question": ["What is 4 + 4?", "What is 9 - 1?"], "solution": ["8", "8"]}), path)
    tf = TaskFile(path, known_domains=KNOWN, default_domain="math", mapping={"prompt": "question", "answer": "solution"})
    assert [(t.prompt, t.spec["answer"], t.id) for t in tf.tasks] == [
        ("What is 4 + 4?", "8", "t.parquet:1"), ("What is 9 - 1?", "8", "t.parquet:2")]


def test_saved_hf_dataset_directory(tmp_path: Path) -> None:
    import datasets

    datasets.Dataset.from_list([{"id": "q1", "domain": "math", "prompt": "What is 3 * 3?", "answer": "9"}]).save_to_disk(
        str(tmp_path / "ds"))
    (task,) = TaskFile(tmp_path / "ds", known_domains=KNOWN).tasks
    assert (task.id, task.spec) == ("q1", {"answer": "9"})


def test_shards_are_disjoint_and_cover_everything(tmp_path: Path) -> None:
    rows = [{"id": str(i), "domain": "math", "prompt": f"{i}?", "answer": str(i)} for i in range(10)]
    tasks = TaskFile(_jsonl(tmp_path / "t.jsonl", rows), known_domains=KNOWN).tasks
    shares = [[t.id for t in shard(tasks, i, 3)] for i in range(3)]
    assert sorted(sum(shares, [])) == sorted(str(i) for i in range(10))
    assert all(not set(x) & set(y) for i, x in enumerate(shares) for y in shares[i + 1:])
    with pytest.raises(ValueError, match="replica 3 of 3"):
        shard(tasks, 3, 3)


def _tasks(prefix: str, n: int, tmp_path: Path) -> list:
    rows = [{"id": f"{prefix}{i}", "domain": "math", "prompt": f"{i}?", "answer": "1"} for i in range(n)]
    return TaskFile(_jsonl(tmp_path / f"{prefix}.jsonl", rows), known_domains=KNOWN).tasks


def test_weighted_mix_follows_weights_and_resumes_exactly(tmp_path: Path) -> None:
    sources = {"big": _tasks("b", 400, tmp_path), "small": _tasks("s", 400, tmp_path)}
    mix = WeightedMix(sources, {"big": 3.0, "small": 1.0}, seed=7)
    first = [mix.next() for _ in range(200)]
    assert 120 <= sum(name == "big" for name, _ in first) <= 180
    saved = dict(mix.positions)
    rest_original = [mix.next()[1].id for _ in range(100)]
    resumed = WeightedMix(sources, {"big": 3.0, "small": 1.0}, seed=7, positions=saved)
    assert [resumed.next()[1].id for _ in range(100)] == rest_original
    ids = [t.id for _, t in first] + rest_original
    assert len(ids) == len(set(ids))


def test_weighted_mix_drains_every_source_once(tmp_path: Path) -> None:
    sources = {"x": _tasks("x", 5, tmp_path), "y": _tasks("y", 2, tmp_path)}
    mix = WeightedMix(sources, {"x": 1.0, "y": 100.0})
    drawn = []
    while (item := mix.next()) is not None:
        drawn.append(item[1].id)
    assert sorted(drawn) == sorted([f"x{i}" for i in range(5)] + ["y0", "y1"])


def test_cli_validate_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = _jsonl(tmp_path / "good.jsonl", [{"domain": "math", "prompt": "What is 1 + 2?", "answer": "3"}])
    assert cli_main(["tasks", "validate", str(good)]) == 0
    assert "1 tasks OK (math 1)" in capsys.readouterr().out
    bad = _jsonl(tmp_path / "bad.jsonl", [{"domain": "math", "prompt": "x"}])
    assert cli_main(["tasks", "validate", str(bad)]) == 1
    assert "bad.jsonl:1: field 'answer' is missing" in capsys.readouterr().err


def test_cli_publish_refuses_bad_input_before_connecting(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the config names an unreachable broker: each of these must be refused before any connection is tried
    config = tmp_path / "c.toml"
    config.write_text('namespace = "x"\n[kafka]\nbootstrap = "127.0.0.1:1"\n')
    good = _jsonl(tmp_path / "good.jsonl", [{"domain": "math", "prompt": "What is 1 + 2?", "answer": "3"}])
    bad = _jsonl(tmp_path / "bad.jsonl", [{"domain": "math", "prompt": "x"}])
    assert cli_main(["tasks", "publish", str(bad), "--config", str(config)]) == 1
    assert "bad.jsonl:1: field 'answer' is missing" in capsys.readouterr().err
    assert cli_main(["tasks", "publish", str(good), "--config", str(tmp_path / "absent.toml")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("rollout tasks publish: ") and "absent.toml" in err and err.count("\n") == 1
    with pytest.raises(SystemExit):  # --config is required
        cli_main(["tasks", "publish", str(good)])


def test_scheduler_task_file_source_shards_and_resumes(tmp_path: Path) -> None:
    from actors.scheduler import TaskFileSource

    rows = [{"id": f"q{i}", "domain": "math", "prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(6)]
    path = _jsonl(tmp_path / "mine.jsonl", rows)
    src = TaskFileSource(path, replica=1, replicas=2)
    first = src.next(0.0)
    assert first is not None and (first.domain, first.spec["answer"], first.spec["task_file_id"]) == ("math", "2", "q1")
    restarted = TaskFileSource(path, replica=1, replicas=2)
    restarted.position = src.position
    assert [restarted.next(0.0).spec["task_file_id"] for _ in range(2)] == ["q3", "q5"]
    assert restarted.next(0.0) is None


def test_mapping_constants_and_templates(tmp_path: Path) -> None:
    from engine.tasks import field_source, parse_mapping

    rows = [{"q": "What is 2 + 2?", "hint": "add", "sol": 4, "n": 1}, {"q": "What is 3 * 3?", "hint": "multiply", "sol": 9, "n": 2}]
    path = _jsonl(tmp_path / "t.jsonl", rows)
    mapping = parse_mapping(["domain=const:math", "prompt={q}\\n\\nHint: {hint} {{literally}}", "answer=sol",
                             "id=q{n}", "metadata=const:{\"src\": \"x\"}"])
    a, b = TaskFile(path, known_domains=KNOWN, mapping=mapping).tasks
    assert (a.domain, a.prompt, a.spec, a.id, a.metadata) == (
        "math", "What is 2 + 2?\n\nHint: add {literally}", {"answer": "4"}, "q1", {"src": "x"})
    assert b.prompt.endswith("Hint: multiply {literally}") and b.id == "q2"
    consts = {"metadata": 'const:{"note": "a\\nb"}', "max_turns": "const:3", "domain": "const:math\\tx"}
    assert {f: field_source(f, v).value for f, v in consts.items()} == {
        "metadata": {"note": "a\nb"}, "max_turns": 3, "domain": "math\tx"}
    # the quoted-JSON constant is the same as const:
    quoted = TaskFile(path, known_domains=KNOWN, mapping=parse_mapping(['domain="math"', "prompt={q} ({hint})",
                                                                        "answer=sol", "id=n"])).tasks
    assert [(t.domain, t.prompt, t.id) for t in quoted] == [("math", "What is 2 + 2? (add)", "1"),
                                                            ("math", "What is 3 * 3? (multiply)", "2")]


@pytest.mark.parametrize("pairs, message", [
    (["prompt"], r"--map wants FIELD=COLUMN, FIELD=const:VALUE or FIELD=TEMPLATE, got 'prompt'"),
    (["prompt={q"], r"--map prompt=\{q: malformed template"),
    (["prompt={q!r}"], r"--map prompt=\{q!r\}: template placeholders are plain column names"),
    (["prompt={}"], r"--map prompt=\{\}: template placeholders are plain column names"),
    (['domain="math'], None),  # not a quoted constant (no closing quote): a column name
    (['domain="ma\\qh"'], r'--map domain="ma\\qh": a quoted constant must be a JSON string'),
    (["prompt=q", "prompt=x"], r"--map prompt=x: field 'prompt' is mapped twice"),
])
def test_bad_mappings_name_the_mapping(pairs: list[str], message: str | None) -> None:
    from engine.tasks import parse_mapping

    if message is None:
        assert parse_mapping(pairs) == {"domain": '"math'}
        return
    with pytest.raises(ValueError, match=message):
        parse_mapping(pairs)


def test_a_template_column_missing_names_the_mapping_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _jsonl(tmp_path / "t.jsonl", [{"q": "1 + 1?", "hint": "add", "sol": "2"}, {"q": "2 + 2?", "sol": "4"}])
    with pytest.raises(TaskFileError, match=r"t\.jsonl:2: --map prompt=\{q\} \(\{hint\}\): column 'hint' is missing"):
        TaskFile(path, known_domains=KNOWN, default_domain="math",
                 mapping={"prompt": "{q} ({hint})", "answer": "sol"})
    assert cli_main(["tasks", "validate", str(path), "--domain", "math", "--map", "prompt={q} ({hint})",
                     "--map", "answer=sol"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("rollout tasks validate: ") and "t.jsonl:2: --map prompt={q} ({hint}): column 'hint'" in err
    assert err.count("\n") == 1
    with pytest.raises(SystemExit, match="rollout tasks: --map prompt=\\{q: malformed template"):
        cli_main(["tasks", "validate", str(path), "--map", "prompt={q"])


def test_a_renamed_column_missing_from_a_row_is_named(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "t.jsonl", [{"q": "1 + 1?", "sol": "2"}, {"sol": "4"}])
    with pytest.raises(TaskFileError, match=r"t\.jsonl:2: field 'prompt' .* is missing or empty; --map prompt=q: "
                                            r"this row has no column 'q' \(columns: \['sol'\]\)"):
        TaskFile(path, known_domains=KNOWN, default_domain="math", mapping={"prompt": "q", "answer": "sol"})
