"""A short chaos run: the multi-process pipeline under SIGKILLs and a broker restart loses nothing.

Every role runs as its own ``rollout run --role R`` daemon on a broker and nats-server private to this
test (it restarts the broker, so never the session's shared one). A few role processes are SIGKILLed
and restarted at random moments, the broker is stopped and started on the same data dir, a sandbox host
is down for a while; then the ledger (``ops/ledger.py``) rebuilt from the topics and the learner's
audit log must show every admitted sample accounted for, none trained twice.
The long version: ``loadtests/chaos.py`` (>= 20 kills, a NATS restart during a publication).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtests.chaos import Plan, flatten, in_flight_fates, regenerated_tokens, run, taken_over

pytestmark = [pytest.mark.timeout(420)]


def test_a_pipeline_under_kills_and_a_broker_restart_loses_nothing_and_trains_nothing_twice(tmp_path: Path):
    plan = Plan(tasks=12, kills=4, duration_s=45.0, host_down_s=10.0, broker_restarts=1, nats_restarts=0,
                seed=1, finish_timeout_s=150.0)
    results = run(plan, tmp_path, log=print)
    print(results["table"])
    assert results["kills"] >= 4
    assert results["tasks_admitted"] >= plan.tasks
    assert results["samples_lost"] == 0, results["fates"]
    assert results["samples_trained_twice"] == 0
    assert results["checkpoint_agrees"], results["table"]
    # every admitted sample is accounted for by the learner (in its lineage or, at most, a last partial batch)
    assert results["ledger_pending_at_learner"] < 2 * 8, results["fates"]
    assert results["ledger_learner_steps"] >= 1
    # the in-flight frontier's figures: no prompt skipped or admitted twice; tokens regenerated only by what
    # the takeover does not cover (multi-turn episodes, takeovers outside the look-back), so their shape
    flat = flatten(results)
    assert (flat["prompts_skipped"], flat["prompts_duplicated"]) == (0, 0), results["fates"]
    for key in ("prompts_skipped", "prompts_duplicated", "tokens_regenerated", "tokens_streamed", "samples_lost",
                "trained_twice"):
        assert isinstance(flat[key], int) and flat[key] >= 0, (key, flat[key])
    assert flat["tokens_regenerated"] <= flat["tokens_streamed"]
    roles = {"scheduler", "inference", "sandbox", "reward", "learner"}
    assert set(results["recovery_s"]) == roles
    for role in roles:
        p50, p99 = flat[f"recovery_s.{role}.p50"], flat[f"recovery_s.{role}.p99"]
        assert (p50 is None) == (p99 is None) == (flat[f"recovery_s.{role}.n"] == 0), role
        assert p50 is None or 0 < p50 <= p99, (role, p50, p99)


def test_regenerated_tokens_counts_the_positions_a_later_generation_repeats():
    # (offset, seq, tokens): a generation of 3 chunks (10 tokens), killed; the next one makes 12
    first, second = [(0, 0, 4), (1, 1, 4), (2, 2, 2)], [(5, 0, 4), (6, 1, 4), (7, 2, 4)]
    assert regenerated_tokens(first) == 0
    assert regenerated_tokens(first + second) == 10
    assert regenerated_tokens(second + first) == 10  # the order is the offsets', not the list's
    assert regenerated_tokens(first + second + [(9, 0, 3)]) == 13  # and a third one 3 of the 12 streamed


def test_taken_over_counts_continuations_by_another_process_and_the_tokens_they_kept():
    # (offset, seq, tokens, producer): p1 streams 2 chunks and dies; p2 continues at seq 2 (keeps 8 tokens)
    continued = [(0, 0, 4, "p1"), (1, 1, 4, "p1"), (5, 2, 4, "p2"), (6, 3, 1, "p2")]
    assert taken_over(continued) == (1, 8)
    assert taken_over([(0, 0, 4, "p1"), (1, 1, 4, "p1")]) == (0, 0)  # one life
    assert taken_over([(0, 0, 4, "p1"), (3, 0, 4, "p2"), (4, 1, 4, "p2")]) == (0, 0)  # started again: kept none


def test_in_flight_fates_tell_a_continued_generation_from_one_generated_again_and_one_that_ended_first():
    chunks = {
        "cont": [(0, 0, 4, "p1"), (1, 1, 4, "p1"), (5, 2, 4, "p2")],  # the successor numbered on
        "again": [(2, 0, 4, "p1"), (6, 0, 4, "p2"), (7, 1, 4, "p2")],  # started from seq 0 a second time
        "ended": [(3, 0, 4, "p1"), (4, 1, 2, "p1")],  # finished in the first life: the kill came after it
        "unwatched": [(8, 0, 4, "p1"), (9, 1, 4, "p2")],
    }
    fates = in_flight_fates(chunks, {"cont", "again", "ended"})
    assert fates == {"taken_over": 1, "regenerated": 1, "finished_by_first": 1}
    assert in_flight_fates(chunks, set()) == {"taken_over": 0, "regenerated": 0, "finished_by_first": 0}
