"""The longdoc domain: lengths, checkable answers, strict format, held-out split, the accuracy helper."""

from __future__ import annotations

import random
from pathlib import Path

import anyio
import pytest
from tokenizers import Tokenizer

from domains.longdoc import (LONGDOC, MAX_TOKENS, MIN_TOKENS, difficulty_for_tokens, longdoc_accuracy,
                                   longdoc_format, longdoc_tasks, make_longdoc_tokens, tokens_for_difficulty)
from domains import DOMAINS, is_heldout, score
from sandboxes.verifiers import verify_answer

MODEL_TOKENIZER = Path.home() / ".cache/rollout-engine/models/smollm2-135m-instruct/tokenizer.json"


def test_registered_with_a_generation_budget() -> None:
    assert DOMAINS["longdoc"] is LONGDOC and LONGDOC.verifier == "answer" and LONGDOC.max_new_tokens


def test_difficulty_selects_length_and_back() -> None:
    assert tokens_for_difficulty(0.0) == MIN_TOKENS and tokens_for_difficulty(1.0) == MAX_TOKENS
    assert tokens_for_difficulty(2.0) == MAX_TOKENS
    for n in (1000, 2500, 8000):
        assert tokens_for_difficulty(difficulty_for_tokens(n)) == n
    with pytest.raises(ValueError, match="9000"):
        difficulty_for_tokens(9000)


def test_documents_have_about_the_requested_length_in_real_tokens() -> None:
    tok = Tokenizer.from_file(str(MODEL_TOKENIZER))
    kinds = set()
    for tokens in (1000, 4000, 8000):
        for seed in range(6):
            task = make_longdoc_tokens(random.Random(seed), tokens)
            kinds.add(task.spec["kind"])
            n = len(tok.encode(task.prompt).ids)
            assert 0.65 * tokens <= n <= 1.35 * tokens, (tokens, task.spec["kind"], n)
    assert kinds == {"report", "contract", "log"}


def _check_answer(prompt: str, answer: str) -> None:
    """Recompute the answer of a generated task from its document text alone."""
    doc = prompt.split("<document>\n", 1)[1].split("\n</document>", 1)[0]
    question = prompt.split("Question: ", 1)[1].split("\n", 1)[0]
    lines = doc.splitlines()
    words = question.rstrip("?").split()
    if question.startswith("How many table rows have status"):
        assert answer == str(sum(1 for ln in lines if ln.startswith("| ") and ln.endswith(f"| {words[-1]} |")))
    elif question.startswith("How many ERROR lines does"):
        host = words[5]
        assert answer == str(sum(1 for ln in lines if f" {host} ERROR " in ln))
    elif question.startswith("On which line number does request id"):
        (hit,) = [ln for ln in lines if ln.endswith(f"req={words[-2]}")]
        assert hit.split()[0] == answer
    elif question.startswith("How many units of"):
        product, region = words[4], words[-2]
        (hit,) = [ln for ln in lines if f"| {product} | {region} |" in ln]
        assert hit.split("|")[4].strip() == answer
    elif question.startswith("Which clause number sets the"):
        term = " ".join(words[5:])
        (hit,) = [ln for ln in lines if f"The {term} is" in ln]
        assert hit.split()[1].rstrip(".") == answer
    elif question.startswith("How many days is the"):
        term = " ".join(words[5:])
        (hit,) = [ln for ln in lines if f"The {term} is" in ln]
        assert hit.split(f"The {term} is ")[1].split()[0] == answer
    else:  # compare: the named candidate with more units
        units = {tuple(c.strip() for c in ln.split("|")[2:4]): int(ln.split("|")[4]) for ln in lines
                 if ln.startswith("| ") and ln.split("|")[1].strip().isdigit()}
        if question.startswith("Which product shipped more units:"):
            a, b = question.split(": ", 1)[1].split("?")[0].split(" region or ")
            (pa, ra), (pb, rb) = a.split(" in the "), b.removesuffix(" region").split(" in the ")
            assert answer == (pa if units[(pa, ra)] > units[(pb, rb)] else pb)
        else:
            assert question.startswith("Which region shipped more units of "), question
            head = question.split("?")[0].split()
            product, ra, rb = head[6].rstrip(":"), head[7], head[9]
            assert answer == (ra if units[(product, ra)] > units[(product, rb)] else rb)


def test_answers_follow_from_the_document() -> None:
    rng = random.Random(7)
    for _ in range(120):
        task = LONGDOC.make(rng, 0.0)
        _check_answer(task.prompt, task.spec["answer"])


def test_strict_format_and_accuracy_reward() -> None:
    prompt, spec = LONGDOC.generate(random.Random(3), 0.0)
    right = f"Answer: {spec['answer']}"
    for text, correct, fmt in ((right, 1.0, 1.0), (f"The answer is {spec['answer']}", 0.0, 0.0),
                               ("Answer: 99999999", 0.0, 1.0), (right + "\nbecause", 0.0, 0.0)):
        facts = anyio.run(verify_answer, text, spec)
        breakdown = score("longdoc", facts, text)
        assert breakdown.correctness == correct, text
        assert longdoc_format(text) == fmt, text


def test_heldout_disjoint_from_training_and_seeded() -> None:
    held = longdoc_tasks(8, 1000, seed=1)
    assert held == longdoc_tasks(8, 1000, seed=1) and len(held) == 8
    assert all(is_heldout(p) for p, _ in held)
    rng = random.Random(0)
    train = [LONGDOC.generate(rng, 0.0)[0] for _ in range(20)]
    assert not any(is_heldout(p) for p in train) and not set(train) & {p for p, _ in held}


def test_accuracy_of_a_generate_callable() -> None:
    tasks = dict(longdoc_tasks(6, 2000, seed=2))
    seen: list[list[dict]] = []

    def oracle(messages: list[dict]) -> str:
        seen.append(messages)
        return f"Answer: {tasks[messages[0]['content']]}"

    assert longdoc_accuracy(oracle, 6, 2000, seed=2) == 1.0
    assert len(seen) == 6 and all(m[0]["role"] == "user" for m in seen)
    half = iter(range(100))
    assert longdoc_accuracy(lambda m: oracle(m) if next(half) % 2 else "Answer: nothing", 6, 2000, seed=2) == 0.5
    with pytest.raises(ValueError, match="n must be"):
        longdoc_accuracy(oracle, 0, 2000)
