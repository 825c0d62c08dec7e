"""domains/reasoning_gym.py: reasoning-gym's datasets as the domain family ``rg:NAME``.

Runs against the installed reasoning-gym (the ``domains`` extra, installed by ops/bootstrap.sh); the test of
an engine without it makes the package unimportable in a child process."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
import msgpack
import pytest

from domains import DOMAINS, is_heldout
from domains import reasoning_gym as rg
from engine.schemas import Task
from streams.codec import decode, encode

REPO = Path(__file__).resolve().parents[2]


def _verify(name: str, text: str, spec: dict) -> dict:
    return anyio.run(DOMAINS[name].verify, text, spec, None)


def _child(code: str, *, hash_seed: str = "0") -> str:
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


# -- listing and exclusions ----------------------------------------------------------------------------

def test_the_family_lists_the_usable_datasets_and_the_excluded_ones_with_why() -> None:
    names = [n for n in DOMAINS.names() if n.startswith("rg:")]
    assert len(names) >= 90
    assert "rg:chain_sum" in names and "rg:leg_counting" in names
    assert not {f"rg:{n}" for n in rg.EXCLUDED} & set(names)
    assert sorted(n[3:] for n in names) == sorted(rg.KNOWN_DATASETS)  # the 0.1.25 list kept for the no-package case
    unavailable = DOMAINS.unavailable_names()
    for name, why in rg.EXCLUDED.items():
        assert unavailable[f"rg:{name}"] == why
    with pytest.raises(KeyError, match="any non-empty string"):
        DOMAINS["rg:game_of_life_halting"]
    with pytest.raises(KeyError, match="PYTHONHASHSEED"):
        DOMAINS["rg:ransom_note"]
    with pytest.raises(KeyError, match="has no dataset 'no_such_dataset'"):
        DOMAINS["rg:no_such_dataset"]


def test_the_exclusion_claims_hold_for_the_installed_package() -> None:
    # game_of_life_halting: any non-empty string scores 1.0.
    entry = rg.entry_at("game_of_life_halting", 0, 3)
    assert rg.scorer("game_of_life_halting")("banana", entry) == 1.0
    # no oracle answer.
    for name in ("boxnet", "graph_color", "rush_hour"):
        assert rg.dataset(name, 0)[0]["answer"] is None
    # rearc (arc_agi alike; its data loader leaks a file handle, a warning here): its own answer scores 1.0
    # before the round trip and not after.
    raw = rg.dataset("rearc", 0)[5]
    assert rg.scorer("rearc")(raw["answer"], raw) == 1.0
    tripped = msgpack.unpackb(msgpack.packb(rg.wire_safe(raw)), strict_map_key=True)
    assert rg.scorer("rearc")(tripped["answer"], tripped) < 1.0


def test_every_usable_dataset_scores_its_own_answer_after_a_kafka_round_trip() -> None:
    failures = []
    for name in rg.KNOWN_DATASETS:
        entry = rg.entry_at(name, 0, 11)
        spec = {"dataset": name, "entry": entry, "level": 0}
        wire = Task(task_id="t", domain=f"rg:{name}", prompt="p", spec=spec)
        back = decode(encode(wire, producer="test")[0]).message
        assert isinstance(back, Task)
        answer = rg.oracle(back.spec["entry"])
        score = rg.scorer(name)(answer, back.spec["entry"])
        if score != 1.0:
            failures.append((name, answer, score))
    assert not failures


# -- tasks ---------------------------------------------------------------------------------------------

def test_a_resolved_domain_is_in_process_and_its_splits_are_disjoint() -> None:
    d = DOMAINS["rg:leg_counting"]
    assert d.name == "rg:leg_counting" and d.source.startswith("reasoning-gym 0.1.")
    assert not d.needs_sandbox and d.stop == () and d.tags == {"chat", "reasoning-gym"}
    assert d.max_new_tokens is not None and rg.MIN_NEW_TOKENS <= d.max_new_tokens <= rg.MAX_NEW_TOKENS
    held = [p for p, _ in d.heldout(30, seed=1)]
    assert len(held) == 30 and all(is_heldout(p) for p in held)
    rng = random.Random(2)
    train = [d.generate(rng)[0] for _ in range(200)]
    assert not any(is_heldout(p) for p in train)
    assert not set(held) & set(train)
    prompt, spec = d.generate(random.Random(3))
    assert prompt.endswith(rg.NUMBER_INSTRUCTION) and spec["dataset"] == "leg_counting" and spec["level"] == 0
    assert spec["entry"]["question"] in prompt and isinstance(spec["max_new_tokens"], int)


def test_higher_difficulty_means_a_higher_curriculum_level() -> None:
    d = DOMAINS["rg:chain_sum"]
    top = rg.levels("chain_sum") - 1
    assert top >= 5
    got = [rg.level_for("chain_sum", x / 20) for x in range(21)]
    assert got == sorted(got) and got[0] == 0 and got[-1] == top
    rng = random.Random(4)
    easy = [d.make(rng, 0.0) for _ in range(40)]
    hard = [d.make(rng, 1.0) for _ in range(40)]
    assert {t.spec["level"] for t in easy} == {0} and {t.spec["level"] for t in hard} == {top}
    assert max(len(t.ideal) for t in easy) < max(len(t.ideal) for t in hard)
    # A capped dataset stays at its cap, whatever the difficulty.
    assert rg.levels("caesar_cipher") == rg.LEVEL_CAPS["caesar_cipher"][0] + 1
    assert DOMAINS["rg:caesar_cipher"].make(random.Random(1), 1.0).spec["level"] == rg.LEVEL_CAPS["caesar_cipher"][0]


def test_held_out_tasks_are_the_same_in_processes_with_different_hash_seeds() -> None:
    code = ("import json; from domains import DOMAINS; from domains.reasoning_gym import dataset; "
            "print(json.dumps({n: DOMAINS[n].heldout(6, seed=3, difficulty=0.5) "
            "for n in ('rg:chain_sum', 'rg:family_relationships', 'rg:word_sorting')})); "
            "print(json.dumps([dataset('ransom_note', 0)[i]['question'] for i in range(20)]))")
    one, two = (_child(code, hash_seed=s).splitlines() for s in ("1", "2"))
    assert one[0] == two[0]
    tasks = json.loads(one[0])
    assert all(len(v) == 6 for v in tasks.values())
    assert one[1] != two[1]  # why ransom_note is excluded: its items follow the hash seed


# -- verifying -----------------------------------------------------------------------------------------

def test_the_ideal_answer_earns_reward_1_and_a_wrong_one_0() -> None:
    d = DOMAINS["rg:chain_sum"]
    task = d.make(random.Random(5), 0.3)
    facts = _verify("rg:chain_sum", task.ideal, task.spec)
    assert facts == {"extracted": task.ideal, "score": 1.0, "correct": True}
    assert d.reward(facts, task.ideal) == 1.0
    wrong = str(int(task.ideal) + 1)
    facts = _verify("rg:chain_sum", wrong, task.spec)
    assert facts["correct"] is False and d.reward(facts, wrong) == 0.0


def test_extraction_is_lenient_about_layout_but_never_credits_an_answer_among_other_words() -> None:
    task = DOMAINS["rg:chain_sum"].make(random.Random(6), 0.0)
    a = task.ideal
    for text in (f"<answer>{a}</answer>", f"Let me add.\n<answer> {a} </answer>", f"Let me add.\n\n{a}\n", f"  {a}  "):
        assert _verify("rg:chain_sum", text, task.spec)["correct"], text
    for said in (f"The answer is {a}.", f"The final answer to the problem is **{a}**.", f"Answer: {a}"):
        facts = _verify("rg:chain_sum", said, task.spec)  # a chat model's phrasing: the answer it states
        assert facts["correct"] and facts["extracted"] == a, said
    facts = _verify("rg:chain_sum", f"I think it is {a} or so", task.spec)  # an integer item: its last integer
    assert facts["correct"] and facts["extracted"] == a
    assert not _verify("rg:chain_sum", f"It is {a}, no, {int(a) + 1}, or so", task.spec)["correct"]
    # a number is read whole: a decimal ending in the answer's digits is not the answer
    assert not _verify("rg:chain_sum", f"It is about 1.{a.lstrip('-')} or so", task.spec)["correct"]
    assert _verify("rg:chain_sum", f"So the sum is {int(a):,} in all", task.spec)["correct"]  # thousands commas
    words = next(t for t in (DOMAINS["rg:family_relationships"].make(random.Random(i), 0.0) for i in range(50))
                 if not t.ideal.strip().lstrip("-").isdigit())
    facts = _verify("rg:family_relationships", f"I think it is {words.ideal} or so", words.spec)
    assert not facts["correct"]  # a word answer is never picked out of a sentence
    assert not _verify("rg:chain_sum", f"The answer is {a} or {int(a) + 1}.", task.spec)["correct"]
    assert not _verify("rg:chain_sum", f"{a}\nor maybe {int(a) + 2}", task.spec)["correct"]
    assert not _verify("rg:chain_sum", "", task.spec)["correct"]
    bad = _verify("rg:chain_sum", a, {"entry": "x"})
    assert not bad["correct"] and "spec" in bad["error"]


def test_a_scorer_that_raises_is_a_failed_answer_with_the_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(answer: str | None, entry: dict) -> float:
        raise ValueError("cannot parse")

    monkeypatch.setattr(rg, "scorer", lambda name: broken)
    task = DOMAINS["rg:chain_sum"].make(random.Random(7), 0.0)
    before = rg.SCORER_FAILURES["error"]
    facts = _verify("rg:chain_sum", task.ideal, task.spec)
    assert facts["correct"] is False and facts["score"] == 0.0
    assert "ValueError: cannot parse" in facts["error"]
    assert rg.SCORER_FAILURES["error"] == before + 1


def test_a_scorer_that_hangs_times_out_without_hanging_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()

    def hanging(answer: str | None, entry: dict) -> float:
        release.wait(30)
        return 1.0

    monkeypatch.setattr(rg, "scorer", lambda name: hanging)
    monkeypatch.setattr(rg, "SCORE_TIMEOUT_S", 0.3)
    task = DOMAINS["rg:chain_sum"].make(random.Random(8), 0.0)
    before = rg.SCORER_FAILURES["timeout"]
    started = time.monotonic()
    try:
        facts = _verify("rg:chain_sum", task.ideal, task.spec)
        assert time.monotonic() - started < 5
        assert facts["correct"] is False and "took over 0.3 s" in facts["error"]
        assert rg.SCORER_FAILURES["timeout"] == before + 1 and rg.hung_scorers() == 1
    finally:
        release.set()
    deadline = time.monotonic() + 10
    while rg.hung_scorers() and time.monotonic() < deadline:  # the released thread accounts for itself
        time.sleep(0.01)
    assert rg.hung_scorers() == 0


# -- without the package -------------------------------------------------------------------------------

def test_the_engine_works_without_reasoning_gym_and_lists_rg_names_with_the_install_hint() -> None:
    code = """
import json, random, sys
sys.modules['reasoning_gym'] = None
from domains import DOMAINS
names = DOMAINS.names()
prompt, spec = DOMAINS['math'].generate(random.Random(1))
try:
    DOMAINS['rg:chain_sum']
    err = None
except KeyError as exc:
    err = str(exc)
print(json.dumps({'rg': [n for n in names if n.startswith('rg:')], 'math': 'math' in names, 'prompt': bool(prompt),
                  'why': DOMAINS.unavailable_names().get('rg:chain_sum'), 'err': err,
                  'loaded': 'reasoning_gym' in sys.modules and sys.modules['reasoning_gym'] is not None}))
"""
    out = json.loads(_child(code))
    assert out["rg"] == [] and out["math"] and out["prompt"] and not out["loaded"]
    assert out["why"] == rg.INSTALL_HINT
    assert rg.INSTALL_HINT in out["err"]


def test_the_engine_does_not_import_reasoning_gym_until_an_rg_name_is_used() -> None:
    code = """
import json, random, sys
from domains import DOMAINS
DOMAINS['math'].generate(random.Random(1))
before = 'reasoning_gym' in sys.modules
DOMAINS['rg:chain_sum']
print(json.dumps([before, 'reasoning_gym' in sys.modules]))
"""
    assert json.loads(_child(code)) == [False, True]
