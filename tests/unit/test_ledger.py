"""The ledger's lineage reconstruction and accounting, from hand-written audit logs (nothing running)."""

from __future__ import annotations

import collections
import json

from ops.ledger import Lineage, LedgerReport, Stage, read_lineage


def step_lines(life: str, step: int, version: int, **verdicts: list[str]) -> list[str]:
    rows = [{"life": life, "step": step, "version": version, "sample_id": sid, "verdict": v}
            for v, ids in verdicts.items() for sid in ids]
    rows.append({"event": "step", "life": life, "step": step, "version": version, "samples": len(rows)})
    return [json.dumps(r) for r in rows]


def start(life: str, step: int) -> str:
    return json.dumps({"event": "start", "life": life, "step": step, "version": step})


def test_a_single_life_keeps_every_step():
    lines = [start("a", 0), *step_lines("a", 1, 0, train=["t/0", "t/1"]),
             *step_lines("a", 2, 1, train=["t/2"], filtered=["t/3"])]
    lin = read_lineage(lines)
    assert [r.sample_id for r in lin.rows] == ["t/0", "t/1", "t/2", "t/3"]
    assert lin.lives == 1 and lin.last_step == 2 and lin.superseded_rows == 0


def test_steps_after_the_last_checkpoint_of_a_killed_life_are_superseded_by_the_next_life():
    # life a checkpointed at step 2, made steps 3 and 4, was killed; life b resumed at 2 and redid them
    lines = [start("a", 0), *step_lines("a", 1, 0, train=["x/0"]), *step_lines("a", 2, 1, train=["x/1"]),
             *step_lines("a", 3, 2, train=["x/2", "x/3"]), *step_lines("a", 4, 3, train=["y/0"]),
             start("b", 2), *step_lines("b", 3, 2, train=["x/2", "x/3"]), *step_lines("b", 4, 3, dropped_stale=["y/0"])]
    lin = read_lineage(lines)
    assert [(r.step, r.sample_id, r.verdict, r.life) for r in lin.rows] == [
        (1, "x/0", "train", "a"), (2, "x/1", "train", "a"), (3, "x/2", "train", "b"), (3, "x/3", "train", "b"),
        (4, "y/0", "dropped_stale", "b")]
    assert lin.superseded_rows == 3 and lin.lives == 2


def test_a_step_torn_by_a_kill_does_not_count():
    lines = [start("a", 0), *step_lines("a", 1, 0, train=["x/0"]),
             json.dumps({"life": "a", "step": 2, "version": 1, "sample_id": "x/1", "verdict": "train"}),
             '{"life": "a", "step": 2, "vers',  # SIGKILL mid-write
             start("b", 1), *step_lines("b", 2, 1, train=["x/1"])]
    lin = read_lineage(lines)
    assert [(r.step, r.sample_id, r.life) for r in lin.rows] == [(1, "x/0", "a"), (2, "x/1", "b")]
    assert lin.torn_rows == 1


def report(tasks: dict[str, int], *, experience: list[str], lineage_lines: list[str], pending=(), lost=(),
           state=None) -> LedgerReport:
    lin = read_lineage(lineage_lines)
    verdicts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in lin.rows:
        verdicts[r.sample_id][r.verdict] += 1
    stage = Stage()
    for sid in experience:
        stage.add(sid)
    return LedgerReport(namespace="ns", tasks=Stage(), group_sizes=tasks, completions=stage, outcomes=stage,
                        experience=stage, dlq={}, filter_reasons={"t/3": "zero_variance"}, sandbox_errors=0,
                        lineage=lin, checkpoint=None, checkpoint_state=state or {}, pending_at_learner=set(pending),
                        lost_at_learner=set(lost), verdicts=dict(verdicts))


def test_accounting_counts_duplicates_once_and_finds_the_lost_and_the_twice_trained():
    lines = [start("a", 0), *step_lines("a", 1, 0, train=["t/0", "t/1"], filtered=["t/3"]),
             *step_lines("a", 2, 1, train=["t/1"])]  # t/1 trained twice: a bug the ledger must show
    rep = report({"t": 4, "u": 1}, experience=["t/0", "t/1", "t/1", "t/2", "t/3"], lineage_lines=lines,
                 pending=["t/2"], state={"step": 2, "ledger": {"trained": 3, "filtered": 1}})
    s = rep.summary()
    assert s["samples_expected"] == 5 and s["experience_distinct"] == 4 and s["experience_duplicates"] == 1
    assert s["missing_experience"] == 1 and s["samples_lost"] == 1  # u/0 never reached the experience topic
    assert s["samples_trained_twice"] == 1 and rep.trained_twice == {"t/1"}
    assert s["pending_at_learner"] == 1
    assert s["fates"] == {"filtered:zero_variance": 1, "missing:no_completion": 1, "pending_at_learner": 1,
                          "trained": 2}
    assert s["checkpoint_agrees"] is True
    assert "trained twice" in rep.table()


def test_the_checkpoint_must_agree_with_the_lineage():
    lines = [start("a", 0), *step_lines("a", 1, 0, train=["t/0"])]
    rep = report({"t": 1}, experience=["t/0"], lineage_lines=lines, state={"step": 2, "ledger": {"trained": 1}})
    assert not rep.checkpoint_agrees()
    assert isinstance(rep.lineage, Lineage)
