"""The context-length curriculum's policy (pure logic) and its scheduler hook."""

from __future__ import annotations

import pytest

from domains.longdoc import difficulty_for_tokens
from actors.scheduler import Curriculum, length_curriculum
from engine.config import LengthCurriculumConfig, SchedulerConfig
from engine.curriculum import LengthCurriculum


def _lc(**kw: object) -> LengthCurriculum:
    args: dict = {"threshold": 0.6, "window": 10, "to_difficulty": difficulty_for_tokens}
    args.update(kw)
    return LengthCurriculum(["longdoc"], [1000, 2000, 4000], **args)


def test_starts_at_the_shortest_length() -> None:
    lc = _lc()
    assert lc.length("longdoc") == 1000 and lc.difficulty("longdoc") == 0.0
    assert lc.steers("longdoc") and not lc.steers("arith") and not lc.steers(None)


def test_moves_up_only_after_a_window_of_successes_at_the_length() -> None:
    lc = _lc()
    lc.observe("longdoc", 0, 1.0)               # marks where this length's samples start
    lc.observe("longdoc", 9, 1.0)               # 9 < window samples: too few to judge
    assert lc.length("longdoc") == 1000
    lc.observe("longdoc", 10, 0.59)             # enough samples, success under the threshold
    assert lc.length("longdoc") == 1000
    d = lc.observe("longdoc", 12, 0.6)          # threshold reached
    assert lc.length("longdoc") == 2000 and d == pytest.approx(difficulty_for_tokens(2000))
    lc.observe("longdoc", 21, 0.9)              # the window restarts at the new length
    assert lc.length("longdoc") == 2000
    lc.observe("longdoc", 22, 0.9)
    assert lc.length("longdoc") == 4000
    lc.observe("longdoc", 100, 1.0)             # the last length is the ceiling
    assert lc.length("longdoc") == 4000


def test_never_moves_back_on_failures() -> None:
    lc = _lc(window=1)
    lc.observe("longdoc", 0, 1.0)
    lc.observe("longdoc", 1, 1.0)
    assert lc.length("longdoc") == 2000
    lc.observe("longdoc", 50, 0.0)
    assert lc.length("longdoc") == 2000


def test_state_reports_each_domain_for_metrics() -> None:
    lc = _lc()
    lc.observe("longdoc", 0, 0.3)
    lc.observe("longdoc", 4, 0.5)
    assert lc.state() == {"longdoc": {"length": 1000, "level": 0, "levels": 3, "samples_at_length": 4,
                                      "success": 0.5}}


@pytest.mark.parametrize("kw, match", [
    ({"lengths": []}, "increasing"), ({"lengths": [2000, 1000]}, "increasing"),
    ({"lengths": [1000, 1000]}, "increasing"), ({"threshold": 0.0}, "threshold"),
    ({"threshold": 1.5}, "threshold"), ({"window": 0}, "window"), ({"lengths": [500, 1000]}, "500"),
])
def test_bad_settings_are_named(kw: dict, match: str) -> None:
    args: dict = {"domains": ["longdoc"], "lengths": [1000, 2000], "threshold": 0.6, "window": 4,
                  "to_difficulty": difficulty_for_tokens}
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        LengthCurriculum(args.pop("domains"), args.pop("lengths"), **args)


def test_unknown_domain_is_refused() -> None:
    with pytest.raises(KeyError, match="arith"):
        _lc().observe("arith", 10, 1.0)


def test_scheduler_hook_builds_it_from_config_and_has_the_difficulty_curriculum_shape() -> None:
    assert length_curriculum(SchedulerConfig()) is None
    lc = length_curriculum(SchedulerConfig(length_curriculum=LengthCurriculumConfig(lengths=[1000, 8000],
                                                                                  window=2)))
    assert lc is not None and lc.lengths == [1000, 8000] and lc.window == 2
    for name in ("difficulty", "observe"):   # the scheduler consults either curriculum the same way
        assert callable(getattr(lc, name)) and callable(getattr(Curriculum(), name))
    with pytest.raises(ValueError, match="arith"):
        length_curriculum(SchedulerConfig(length_curriculum=LengthCurriculumConfig(domains=["arith"])))
