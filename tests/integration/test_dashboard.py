"""The dashboard in a real headless Chromium: the page polls /dashboard/data and draws live SVG charts.

The server is the daemon's own ``HttpServer`` with the dashboard routes, and the recorder samples a
real ``Supervisor`` running a test actor whose statistics change every tick (rewards per domain,
counters, lag), so the page is checked end to end: recorder -> JSON -> browser -> SVG.
"""

from __future__ import annotations

import html.parser
import shutil
import struct
import subprocess
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import anyio
import pytest

from engine.actor import Actor, Supervisor
from ops.dashboard import Recorder, dashboard_routes
from ops.http import HttpServer

pytestmark = pytest.mark.anyio

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class FakeActor(Actor):
    """A role's actor whose statistics move on every read: ``moves(tick)`` gives the role's own figures."""

    role: ClassVar[str] = "fake"
    moves: ClassVar[Callable[[int], dict[str, Any]]]

    def __init__(self) -> None:
        super().__init__()
        self.ticks = 0

    def statistics(self) -> dict[str, Any]:
        self.ticks += 1
        stats = super().statistics()
        stats.update(type(self).moves(self.ticks))
        return stats


def fake(role: str, moves: Callable[[int], dict[str, Any]]) -> type[FakeActor]:
    return type(f"Fake[{role}]", (FakeActor,), {"role": role, "moves": staticmethod(moves)})


FAKES = {
    # two domains' rewards, handled/emitted counters, an in-flight gauge
    "reward": lambda n: dict(handled=10 * n, emitted=8 * n, in_flight=n % 5, lag=100 - n % 50,
                             domains={"arith": {"count": 4 * n, "mean": 0.2 + 0.01 * n},
                                      "code": {"count": 2 * n, "mean": 0.5 - 0.005 * n}}),
    "inference": lambda n: dict(samples_done=4 * n, tokens_out=250 * n, weight_version=n // 4),
    "learner": lambda n: dict(version=n // 2, trained=16 * n, dropped_stale=n // 3),
    "sandbox.episodes": lambda n: dict(episodes=3 + n % 7, in_flight=n % 4, pool={"in_use": 5 + n % 6}),
    # an eval role: held-out accuracy per domain, rising
    "eval": lambda n: dict(eval={"arith": {"tasks": 48, "accuracy": min(1.0, 0.1 + 0.02 * n), "solved": 0.1}}),
}


class _Dom(html.parser.HTMLParser):
    """Collects the attributes of every <path class="line"> and the text of every .latest span."""

    def __init__(self) -> None:
        super().__init__()
        self.paths: list[dict[str, str]] = []
        self.latest: dict[str, str] = {}
        self._latest_series: str | None = None
        self.body: dict[str, str] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "path" and "line" in a.get("class", "").split():
            self.paths.append(a)
        elif tag == "span" and a.get("class") == "latest":
            self._latest_series = a.get("data-series")
        elif tag == "body":
            self.body = a

    def handle_data(self, data: str) -> None:
        if self._latest_series is not None:
            self.latest[self._latest_series] = data
            self._latest_series = None


def _chromium(tmp: Path, url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--disable-dev-shm-usage", f"--user-data-dir={tmp / 'profile'}", "--window-size=1200,900",
            "--virtual-time-budget=5000", *extra, url]
    return subprocess.run(args, capture_output=True, text=True, timeout=90)


def _png_is_not_blank(path: Path) -> bool:
    """True when the PNG's decoded pixels are not all one value (a blank page is uniform)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat = 8, b""
    width = height = 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height = struct.unpack(">II", chunk[:8])
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    raw = zlib.decompress(idat)
    assert width > 0 and height > 0
    stride = len(raw) // height
    # skip the per-row filter byte; distinct pixel bytes beyond the background mean something was drawn
    distinct = {raw[r * stride + 1:(r + 1) * stride] for r in range(0, height, 7)}
    return len(distinct) > 3


@pytest.mark.timeout(180)
async def test_dashboard_renders_live_charts_in_chromium(tmp_path: Path) -> None:
    assert CHROMIUM is not None, "chromium is not installed: ops/bootstrap.sh installs it (apt-get install chromium)"
    supervisor = Supervisor()
    for role, moves in FAKES.items():
        supervisor.add(role, fake(role, moves))
    recorder = Recorder.from_supervisor(supervisor, interval_s=0.2)
    async with anyio.create_task_group() as tg:
        tg.start_soon(supervisor.run)
        with anyio.fail_after(5):
            while len(supervisor.actors) < 5:
                await anyio.sleep(0.01)
        tg.start_soon(recorder.run)
        async with HttpServer("127.0.0.1", 0, supervisor,
                              extra_routes=lambda app: dashboard_routes(app, recorder)) as http:
            await anyio.sleep(1.0)  # a few samples before the first page load
            url = f"{http.url}/dashboard"
            shot = tmp_path / "dashboard.png"
            dump, png = await anyio.to_thread.run_sync(lambda: (
                _chromium(tmp_path, url, "--dump-dom"), _chromium(tmp_path, url, f"--screenshot={shot}")))
            samples_at_end = recorder.samples
        supervisor.drain()
        tg.cancel_scope.cancel()

    assert dump.returncode == 0, dump.stderr[-2000:]
    dom = _Dom()
    dom.feed(dump.stdout)
    series = {p["data-series"]: p for p in dom.paths}
    for name in ("arith", "code", "reward records", "samples generated", "tokens out", "experiences emitted",
                 "version gap", "dropped stale", "samples trained", "episodes", "pool in use", "reward lag",
                 "reward in flight", "eval arith"):
        assert name in series, f"no chart line for {name!r}; lines: {sorted(series)}"
    counts = {p["data-series"]: int(p["data-count"]) for p in dom.paths}
    assert all(n > 1 for n in counts.values()), counts
    assert all(p["d"].startswith("M") and "L" in p["d"] for p in dom.paths)

    # the legend shows the latest values the page fetched: the recorder's values moved past the first sample
    first_arith = 0.2 + 0.01 * 1
    latest_arith = float(dom.latest["arith"])
    assert latest_arith > first_arith and float(series["arith"]["data-latest"]) > first_arith
    assert 0 < int(dom.body.get("data-samples", "0")) <= samples_at_end
    assert dom.latest["tokens out"] not in ("", "–")

    assert png.returncode == 0, png.stderr[-2000:]
    assert shot.exists() and shot.stat().st_size > 10_000
    assert _png_is_not_blank(shot)


def test_recorder_turns_counters_into_rates_in_bounded_buffers() -> None:
    clock = iter(float(t) for t in range(100))
    handled = iter([0, 10, 30, 5, 15] + [15] * 10)  # 5: the actor restarted, no rate for that step
    recorder = Recorder(lambda: {"reward": {"role": "reward", "handled": next(handled), "lag": 4,
                                            "domains": {"arith": {"count": 2, "mean": 0.5}}}},
                        capacity=3, clock=lambda: next(clock))
    for _ in range(5):
        recorder.sample()
    charts = {c["id"]: {s["name"]: s for s in c["series"]} for c in recorder.data()["charts"]}
    assert [v for _, v in charts["throughput"]["reward records"]["points"]] == [10.0, 20.0, 10.0]
    assert len(charts["reward"]["arith"]["points"]) == 3 and charts["reward"]["arith"]["latest"] == 0.5
    assert charts["lag"]["reward lag"]["latest"] == 4
    assert charts["sandbox"] == {}


def test_learner_step_metrics_have_their_own_chart() -> None:
    metrics = {"entropy": 1.5, "kl_ref": 0.01, "clip_frac": 0.0, "grad_norm": 0.7, "loss": -0.2}
    recorder = Recorder(lambda: {"learner": {"role": "learner", "version": 3, "metrics": metrics}}, clock=lambda: 1.0)
    recorder.sample()
    charts = {c["id"]: {s["name"]: s["latest"] for s in c["series"]} for c in recorder.data()["charts"]}
    assert charts["learner"] == {"entropy": 1.5, "KL to reference": 0.01, "clip fraction": 0.0, "grad norm": 0.7}


def test_reward_is_a_moving_window_and_eval_and_pool_are_plotted() -> None:
    """Rewards of 0 for 30 s, then of 1: the window (10 s) shows 1 while the mean since start is ~0.3;
    a restart of the reward actor (counts drop) starts its totals again; the pool's in-use count is
    the largest report of the process's sandbox actors (they share one pool), not their sum."""
    t = 0.0
    state = {"count": 0.0, "sum": 0.0}

    def source() -> dict[str, dict[str, Any]]:
        mean = state["sum"] / state["count"] if state["count"] else 0.0
        return {"reward": {"role": "reward", "domains": {"arith": {"count": state["count"], "mean": mean}}},
                "eval": {"role": "eval", "eval": {"arith": {"accuracy": 0.25, "tasks": 48}}},
                "sandbox.episodes": {"role": "sandbox.episodes", "episodes": 2, "pool": {"in_use": 3, "idle": 1}},
                "sandbox.verify": {"role": "sandbox.verify", "pool": {"in_use": 3, "idle": 1}}}

    recorder = Recorder(source, reward_window_s=10.0, clock=lambda: t)

    def latest(series: str, chart: str = "reward") -> float:
        found = {s["name"]: s for c in recorder.data()["charts"] if c["id"] == chart for s in c["series"]}
        return float(found[series]["latest"])

    for second in range(60):
        t = float(second)
        reward = 0.0 if second < 30 else 1.0
        state["count"] += 2
        state["sum"] += 2 * reward
        recorder.sample()
        if second == 5:  # younger than the window: everything since the start
            assert latest("arith") == 0.0
    since_start = state["sum"] / state["count"]
    assert since_start < 0.6 and latest("arith") == 1.0
    assert latest("eval arith") == 0.25
    assert latest("pool in use", "sandbox") == 3.0

    # the reward actor restarts: its totals begin again, and so does the window
    state.update(count=4.0, sum=1.0)
    t = 60.0
    recorder.sample()
    assert latest("arith") == 0.25
    # no reward arrives for longer than the window: no point is drawn, the last one stays the latest
    for second in range(61, 80):
        t = float(second)
        recorder.sample()
    points = [p for c in recorder.data()["charts"] if c["id"] == "reward" for s in c["series"] if s["name"] == "arith"
              for p in s["points"]]
    assert points[-1][0] <= 70.0
