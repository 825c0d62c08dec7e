"""`rollout eval`: the per-domain summary of episode records, the report formats, and the error paths
(one line on stderr, exit code 2 for bad input and 1 for an unreachable policy, never a traceback)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from actors.evaluate import EpisodeRecord, summarise
from engine.eval_stats import mean_interval, pass_at_k, wilson_interval
from ops.cli import main
from ops.cli_eval import format_markdown, format_table


def _rec(task: str, sample: int, correctness: float, domain: str = "math", turns: int = 1,
         tokens: int = 10) -> EpisodeRecord:
    return EpisodeRecord(task, domain, sample, correctness, turns, tokens)


def test_summarise_counts_solved_episodes_and_pass_at_k_per_task() -> None:
    # task a: 2 of 3 solved, task b: 0 of 3 (one partial), task c: 3 of 3; a second domain alongside
    records = ([_rec("a", j, c) for j, c in enumerate((1.0, 0.0, 1.0))]
               + [_rec("b", j, c, turns=3, tokens=40) for j, c in enumerate((0.0, 0.5, 0.0))]
               + [_rec("c", j, 1.0) for j in range(3)]
               + [_rec("t", j, c, domain="terminal", turns=2) for j, c in enumerate((0.0, 1.0, 0.25))])
    reports = summarise(records, samples=3)
    math_ = reports["math"]
    assert (math_.tasks, math_.episodes, math_.solved) == (3, 9, 5)
    assert math_.completion_rate == pytest.approx(5 / 9)
    assert math_.completion_ci95 == wilson_interval(5, 9)
    assert math_.mean_correctness == pytest.approx(5.5 / 9)
    assert math_.pass_at_1 == pytest.approx((2 / 3 + 0 + 1) / 3)
    assert math_.pass_at_k == pytest.approx((pass_at_k(3, 2, 3) + 0.0 + 1.0) / 3) == pytest.approx(2 / 3)
    assert math_.pass_at_1_ci95 == pytest.approx(mean_interval([2 / 3, 0.0, 1.0]))
    assert math_.pass_at_k_ci95 == pytest.approx(mean_interval([1.0, 0.0, 1.0]))
    assert math_.mean_turns == pytest.approx((3 + 9 + 3) / 9)
    assert math_.mean_tokens == pytest.approx((30 + 120 + 30) / 9)
    term = reports["terminal"]
    assert (term.tasks, term.solved, term.pass_at_k, term.mean_turns) == (1, 1, 1.0, 2.0)


def test_report_formats_show_pass_at_k_only_for_several_samples() -> None:
    one = summarise([_rec("a", 0, 1.0), _rec("b", 0, 0.0)], samples=1)
    table = format_table(one)
    assert table.splitlines()[0].split() == ["domain", "tasks", "samples", "completion", "95%", "CI", "correctness",
                                             "pass@1", "(95%", "CI)", "turns", "tokens"]
    assert table.splitlines()[1].split()[:4] == ["math", "2", "1", "0.500"]
    lo, hi = wilson_interval(1, 2)  # one sample per task: pass@1's interval is the tasks' Wilson interval
    assert f"0.500 [{lo:.3f}, {hi:.3f}]" in table.splitlines()[1]
    several = summarise([_rec("a", j, float(j == 0)) for j in range(4)], samples=4)
    md = format_markdown(several, "policy-x")
    assert "| pass@1 (95% CI) | pass@4 (95% CI) |" in md and "`policy-x`" in md
    (l1, h1), (l4, h4) = mean_interval([0.25]), mean_interval([1.0])  # one task: pass@1 0.25, pass@4 1
    assert f"| 0.250 [{l1:.3f}, {h1:.3f}] | 1.000 [{l4:.3f}, {h4:.3f}] |" in md
    assert md.splitlines()[-1].startswith("| math | 1 | 4 | 0.250 |")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("argv, code, message", [
    (["--domain", "nope=2"], 2, "unknown domain 'nope'"),
    (["--domain", "math"], 2, "--domain wants NAME=N"),
    (["--domain", "math=0"], 2, "--domain wants NAME=N"),
    ([], 2, "nothing to evaluate"),
    (["--tasks", "/no/such/tasks.jsonl"], 2, "/no/such/tasks.jsonl: no such file"),
    (["--domain", "math=1", "--samples", "0"], 2, "--samples must be at least 1"),
    (["--domain", "math=1", "--samples", "2", "--temperature", "0"], 2, "needs --temperature > 0"),
    (["--domain", "math=1", "--map", "prompt=q"], 2, "--map, --tasks-domain and --limit go with --tasks"),
    (["--domain", "mbpp=2"], 2, "domain 'mbpp' reads its tasks from a file"),
    (["--tasks", "x.jsonl", "--limit", "0"], 2, "--limit must be at least 1"),
])
def test_bad_input_is_one_line_and_exit_2(argv: list[str], code: int, message: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "--url", "http://127.0.0.1:1", *argv]) == code
    err = capsys.readouterr().err
    assert message in err and err.startswith("rollout eval: ") and err.count("\n") == 1
    assert "Traceback" not in err


def test_bad_task_file_names_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "t.jsonl"
    bad.write_text(json.dumps({"id": "a", "domain": "math", "prompt": "1+1?", "answer": "2"}) + "\n"
                   + json.dumps({"id": "b", "domain": "math", "prompt": "2+2?"}) + "\n")
    assert main(["eval", "--url", "http://127.0.0.1:1", "--tasks", str(bad)]) == 2
    assert f"{bad}:2: field 'answer' is missing" in capsys.readouterr().err


def test_missing_model_dir_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "--model-dir", str(tmp_path / "absent"), "--domain", "math=1"]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert main(["eval", "--model-dir", str(tmp_path), "--domain", "math=1"]) == 2
    assert "config.json" in capsys.readouterr().err


def test_unreachable_url_is_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    assert main(["eval", "--url", url, "--domain", "math=1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"rollout eval: cannot reach {url}") and err.count("\n") == 1


def test_policy_is_required() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["eval", "--domain", "math=1"])
    assert exc.value.code == 2


def test_checkpoint_without_checkpoints_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "--checkpoint", str(tmp_path), "--domain", "math=1"]) == 2
    assert "neither a checkpoint (no model/) nor a directory of checkpoints" in capsys.readouterr().err


def test_checkpoint_directory_serves_its_newest(tmp_path: Path) -> None:
    import argparse

    import anyio

    from ops.cli_eval import policy_dir

    for name in ("step-00000002-v000002", "step-00000010-v000010", "step-00000009-v000011", ".tmp-x"):
        (tmp_path / name / "model").mkdir(parents=True)
    args = argparse.Namespace(checkpoint=str(tmp_path), weights=None, model_dir=None)
    assert anyio.run(policy_dir, args, tmp_path) == tmp_path / "step-00000010-v000010" / "model"
    args.checkpoint = str(tmp_path / "step-00000002-v000002")
    assert anyio.run(policy_dir, args, tmp_path) == tmp_path / "step-00000002-v000002" / "model"


def test_weights_need_the_configs_model_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('namespace = "x"\n')
    assert main(["eval", "--weights", str(cfg), "--domain", "math=1"]) == 2
    assert "inference.model_dir is not set" in capsys.readouterr().err
    assert main(["eval", "--weights", str(tmp_path / "absent.toml"), "--domain", "math=1"]) == 2
    assert "--weights" in capsys.readouterr().err


def test_a_policy_that_stops_answering_is_one_line_and_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import http.server
    import threading

    release = threading.Event()

    class Hanging(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # /health_generate answers
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_POST(self) -> None:  # /generate never does (until the test ends)
            release.wait(10)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hanging)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert main(["eval", "--url", url, "--domain", "math=2", "--request-timeout", "0.5"]) == 1
    finally:
        release.set()
        server.shutdown()
        server.server_close()
    err = capsys.readouterr().err
    assert err.startswith("rollout eval: the policy stopped answering: ") and err.count("\n") == 1
    assert "--request-timeout 0.5 s" in err and "Traceback" not in err
