"""`rollout status` aggregation and rendering, without NATS."""

from __future__ import annotations

import json

from ops.cli import build_parser
from ops.cli_status import Board, Sample, format_duration, format_number, merge_rewards, rates, render


def _inference(n: int) -> dict:
    return {"role": "inference", "name": "inference", "uptime_s": 3725.0, "alive": True, "restarts": 0,
            "samples_done": 10 * n, "tokens_out": 500 * n, "handled": 2 * n, "in_flight": 3, "lag": 12,
            "weight_version": 4, "resumed": 1, "assigned": 2}


def _reward(count: int, mean: float) -> dict:
    return {"role": "reward", "name": "reward", "uptime_s": 10.0, "alive": True, "restarts": 2, "handled": 5,
            "domains": {"arith": {"count": count, "mean": mean, "success": mean, "groups": 4,
                                  "zero_variance_groups": 1}}}


def test_rates_from_successive_counters() -> None:
    a = Sample(stats={"handled": 10, "tokens_out": 100, "step": 5}, sent_at=100.0, received_at=0.0)
    b = Sample(stats={"handled": 30, "tokens_out": 400, "step": 4}, sent_at=102.0, received_at=2.0)
    assert rates(a, b) == {"handled": 10.0, "tokens_out": 150.0}  # step went down: a restart, no rate
    assert rates(None, b) == {} and rates(b, b) == {}


def test_merge_rewards_weights_means_by_count() -> None:
    merged = merge_rewards([_reward(30, 0.2)["domains"], _reward(10, 0.6)["domains"]])
    assert merged["arith"]["count"] == 40
    assert abs(merged["arith"]["mean"] - 0.3) < 1e-9
    assert merged["arith"]["zero_variance_rate"] == 2 / 8


def test_board_snapshot_tracks_instances_rates_and_staleness() -> None:
    board = Board(interval_s=2.0)
    board.observe("inference", "host-1", _inference(1), sent_at=1000.0, received_at=50.0)
    board.observe("inference", "host-1", _inference(3), sent_at=1002.0, received_at=52.0)
    board.observe("inference", "host-1", _inference(2), sent_at=1001.0, received_at=52.1)  # late: ignored
    board.observe("reward", "host-2", _reward(8, 0.5), sent_at=1002.0, received_at=45.0)
    snap = board.snapshot(now=53.0)
    json.dumps(snap)
    assert [(i["role"], i["instance"]) for i in snap["instances"]] == [("inference", "host-1"), ("reward", "host-2")]
    inf, rew = snap["instances"]
    assert inf["rates"] == {"samples_done": 10.0, "tokens_out": 500.0, "handled": 2.0}
    assert (inf["version"], inf["lag"], inf["in_flight"], inf["stale"]) == (4, 12, 3, False)
    assert rew["stale"] is True and rew["restarts"] == 2  # 8 s since heard > 3 intervals
    assert snap["rewards"]["arith"]["mean"] == 0.5
    assert snap["heartbeats"] == 4


def test_render_shows_rows_rewards_and_details() -> None:
    board = Board(interval_s=2.0)
    board.observe("inference", "host-1", _inference(1), sent_at=1000.0, received_at=50.0)
    board.observe("inference", "host-1", _inference(3), sent_at=1002.0, received_at=52.0)
    board.observe("reward", "host-2", _reward(8, 0.5), sent_at=1002.0, received_at=52.0)
    text = render(board.snapshot(now=52.5), width=140, title="namespace 'demo'")
    lines = text.splitlines()
    assert "instances: 2" in lines[0] and "namespace 'demo'" in lines[0]
    row = next(line for line in lines if line.startswith("inference"))
    assert "host-1/inference" in row and "1h02m" in row and "10 samples/s" in row and "500 tok/s" in row
    assert "ok r2" in next(line for line in lines if line.startswith("reward "))
    assert any(line.startswith("arith") and "0.500" in line and "25.0%" in line for line in lines)
    assert any("resumed=1" in line and "assigned=2" in line for line in lines)
    assert "\x1b[" not in text
    assert all(len(line) <= 140 for line in lines)
    assert "\x1b[31m" in render(Board(2.0).snapshot(0.0) | {"instances": [
        {**board.snapshot(52.5)["instances"][0], "alive": False}]}, color=True)


def test_formatting() -> None:
    assert [format_duration(s) for s in (None, 42, 185, 7620, 273600)] == ["-", "42s", "3m05s", "2h07m", "3d04h"]
    assert [format_number(v) for v in (None, 3, 0.12345, 12345, 2.5e6, 250.0)] == ["-", "3", "0.123", "12.3k",
                                                                                  "2.5M", "250"]


def test_cli_registers_status_flags() -> None:
    args = build_parser("status").parse_args(["status", "--config", "x.toml", "--once", "--json"])
    assert (args.config, args.once, args.json, args.window) == ("x.toml", True, True, None)
    assert args.func.__name__ == "cmd_status"


def test_render_on_a_narrow_terminal_keeps_the_throughput() -> None:
    board = Board(interval_s=2.0)
    board.observe("inference", "host-1", _inference(1), sent_at=1000.0, received_at=50.0)
    board.observe("inference", "host-1", _inference(3), sent_at=1002.0, received_at=52.0)
    lines = render(board.snapshot(now=52.5), width=80).splitlines()
    assert all(len(line) <= 80 for line in lines)
    assert any("throughput: 10 samples/s 500 tok/s" in line for line in lines)


def test_render_shows_sampling_shares_and_the_learners_domains() -> None:
    board = Board(interval_s=2.0)
    scheduler = {"role": "scheduler", "name": "scheduler", "uptime_s": 5.0, "alive": True, "restarts": 0,
                 "balance_policy": "signal", "weights": {"math": 0.8, "python": 0.2},
                 "balance": {"math": {"share": 0.8, "factor": 1.2, "window_groups": 64, "varied": 0.9, "solve": 0.45,
                                      "progress": 0.2, "groups_seen": 300, "verifier_errors": 0, "paused": False,
                                      "pauses": 0},
                             "python": {"share": 0.0, "factor": 1.0, "window_groups": 0, "varied": 0.0, "solve": 0.0,
                                        "progress": 0.0, "groups_seen": 0, "verifier_errors": 48, "paused": True,
                                        "pauses": 1}}}
    learner = {"role": "learner", "name": "learner", "uptime_s": 5.0, "alive": True, "restarts": 0, "step": 3,
               "step_domains": {"math": {"samples": 12, "tokens": 300, "reward": 0.5, "adv_abs": 0.8,
                                         "loss_weight": 0.75, "grad_share": 0.7}}}
    board.observe("scheduler", "host-1", scheduler, sent_at=1000.0, received_at=50.0)
    board.observe("learner", "host-1", learner, sent_at=1000.0, received_at=50.0)
    snap = board.snapshot(now=50.5)
    json.dumps(snap)
    assert snap["balance"]["python"]["paused"] and snap["learner_domains"]["math"]["tokens"] == 300
    lines = render(snap, width=120).splitlines()
    assert any("SAMPLING BY DOMAIN" in line and "policy signal" in line for line in lines)
    math_row = next(line for line in lines if line.startswith("math ") and "80.0%" in line)
    assert "90.0%" in math_row and "45.0%" in math_row
    python_row = next(line for line in lines if line.startswith("python"))
    assert "paused (1x)" in python_row and "48" in python_row and "0.0%" in python_row
    assert any(line.startswith("math ") and "75.0%" in line and "70.0%" in line for line in lines)
    assert not any("balance." in line or "step_domains." in line for line in lines)  # not repeated in details
    assert all(len(line) <= 120 for line in lines)
