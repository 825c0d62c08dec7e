"""`rollout status [--config FILE] [--once] [--json]`: a live view of a running deployment.

Fed by heartbeats over NATS (``<ns>.heartbeat.>``, see ``ops/heartbeat.py``): one row per actor
instance with its uptime, when it was last heard from, its throughput (rates from successive
counters), records in flight, consumer lag and weight version; then rewards per domain (from the
reward actors' ``domains`` statistics) and every other statistic, rendered generically.

The view refreshes in place every second with ANSI escapes (no curses). ``--once`` listens for about
two heartbeat intervals, prints one snapshot and exits: 0 if any instance was heard, 1 if none.
``--json`` prints the snapshot as JSON (with ``--once``: one object; live: one object per line).

The aggregation (:class:`Board`) and rendering (:func:`render`) are pure and tested without NATS.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO, TypeGuard

RATE_KEYS: dict[str, str] = {
    "tasks_admitted": "tasks",
    "samples_done": "samples",
    "tokens_out": "tok",
    "handled": "rec",
    "emitted": "exp",
    "trained": "trained",
    "step": "steps",
}
"""Counters turned into per-second rates, with the unit shown after the rate."""

VERSION_KEYS = ("weight_version", "version", "published_version", "learner_version")
"""Statistics naming a weight version, by preference (inference, learner, scheduler)."""

SHOWN_KEYS = frozenset({"role", "name", "alive", "restarts", "uptime_s", "in_flight", "lag", "domains",
                        "balance", "step_domains",
                        *RATE_KEYS, *VERSION_KEYS})
"""Statistics the table shows in its own columns; the rest go to the details section."""

STALE_AFTER_INTERVALS = 3.0
"""An instance not heard from for this many heartbeat intervals is marked stale."""


@dataclasses.dataclass(frozen=True, slots=True)
class Sample:
    """One heartbeat as received: its statistics and when it was sent (the sender's clock)."""

    stats: dict[str, Any]
    sent_at: float
    received_at: float


@dataclasses.dataclass(slots=True)
class _Track:
    role: str
    instance: str
    last: Sample
    previous: Sample | None = None


def rates(previous: Sample | None, last: Sample) -> dict[str, float]:
    """Per-second rates of the counters in :data:`RATE_KEYS` between two heartbeats of one actor.

    A counter that went down (the actor restarted) or a pair of samples with no time between them
    gives no rate.
    """
    if previous is None:
        return {}
    dt = last.sent_at - previous.sent_at
    if dt <= 0:
        return {}
    out = {}
    for key in RATE_KEYS:
        v0, v1 = previous.stats.get(key), last.stats.get(key)
        if _is_number(v0) and _is_number(v1) and v1 >= v0:
            out[key] = (v1 - v0) / dt
    return out


def merge_rewards(domain_stats: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per-domain reward statistics of several reward instances, merged (count-weighted means)."""
    merged: dict[str, dict[str, float]] = {}
    for domains in domain_stats:
        for domain, s in domains.items():
            if not isinstance(s, dict):
                continue
            count = float(s.get("count") or 0)
            m = merged.setdefault(domain, {"count": 0.0, "mean": 0.0, "success": 0.0, "groups": 0.0,
                                           "zero_variance_groups": 0.0})
            total = m["count"] + count
            for key in ("mean", "success"):
                v = s.get(key)
                if _is_number(v) and total > 0:
                    m[key] = (m[key] * m["count"] + float(v) * count) / total
            m["count"] = total
            for key in ("groups", "zero_variance_groups"):
                if _is_number(s.get(key)):
                    m[key] += float(s[key])
    for m in merged.values():
        m["zero_variance_rate"] = m["zero_variance_groups"] / m["groups"] if m["groups"] else 0.0
    return merged


class Board:
    """The latest two heartbeats of every actor instance heard, and the snapshot derived from them."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._tracks: dict[tuple[str, str], _Track] = {}
        self.received = 0
        self.undecodable = 0

    def observe(self, role: str, instance: str, stats: dict[str, Any], *, sent_at: float,
                received_at: float) -> None:
        """Record one heartbeat (``sent_at``: the envelope's created_at; ``received_at``: local time)."""
        self.received += 1
        name = str(stats.get("name", role))
        sample = Sample(stats=stats, sent_at=sent_at, received_at=received_at)
        track = self._tracks.get((instance, name))
        if track is None:
            self._tracks[(instance, name)] = _Track(role=role, instance=instance, last=sample)
        elif sent_at > track.last.sent_at:
            track.role, track.previous, track.last = role, track.last, sample

    def snapshot(self, now: float) -> dict[str, Any]:
        """A JSON-able view: instances (sorted by role, instance, name) and merged rewards per domain."""
        instances = []
        reward_domains = []
        balance: dict[str, Any] = {}
        learner_domains: dict[str, Any] = {}
        for (instance, name), t in sorted(self._tracks.items(), key=lambda kv: (kv[1].role, kv[0])):
            stats = t.last.stats
            seen = max(0.0, now - t.last.received_at)
            version = next((stats[k] for k in VERSION_KEYS if _is_number(stats.get(k))), None)
            instances.append({
                "role": t.role, "instance": instance, "name": name,
                "alive": bool(stats.get("alive", True)), "restarts": stats.get("restarts", 0),
                "uptime_s": stats.get("uptime_s"), "last_seen_s": round(seen, 3),
                "stale": seen > STALE_AFTER_INTERVALS * self.interval_s,
                "rates": {k: round(v, 3) for k, v in rates(t.previous, t.last).items()},
                "in_flight": stats.get("in_flight"), "lag": stats.get("lag"), "version": version,
                "stats": stats,
            })
            if isinstance(stats.get("domains"), dict):
                reward_domains.append(stats["domains"])
            if isinstance(stats.get("balance"), dict) and stats["balance"]:
                # each scheduler replica mixes its own sources: the table shows them all, by source
                balance.update({k: {**v, "policy": stats.get("balance_policy", "")}
                                for k, v in stats["balance"].items() if isinstance(v, dict)})
            if isinstance(stats.get("step_domains"), dict) and stats["step_domains"]:
                learner_domains = stats["step_domains"]
        return {"at": time.time(), "interval_s": self.interval_s, "instances": instances,
                "rewards": merge_rewards(reward_domains), "balance": balance, "learner_domains": learner_domains,
                "heartbeats": self.received, "undecodable": self.undecodable}


# -- rendering ---------------------------------------------------------------------------------------

_RESET, _BOLD, _DIM, _RED, _YELLOW = "\x1b[0m", "\x1b[1m", "\x1b[2m", "\x1b[31m", "\x1b[33m"


def format_duration(seconds: float | None) -> str:
    """``42s``, ``3m05s``, ``2h07m``, ``3d04h``; ``-`` for unknown."""
    if not _is_number(seconds):
        return "-"
    s = int(seconds)  # type: ignore[arg-type]
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def format_number(value: Any) -> str:
    """Compact number: integers as is (k/M above 10^4), floats with 3 significant digits."""
    if isinstance(value, bool) or not _is_number(value):
        return "-" if value is None else str(value)
    v = float(value)
    if abs(v) >= 1e6:
        return f"{v / 1e6:.1f}M"
    if abs(v) >= 1e4:
        return f"{v / 1e3:.1f}k"
    if isinstance(value, int) or v.is_integer() and abs(v) >= 100:
        return str(int(v))
    return f"{v:.3g}"


def format_throughput(instance_rates: dict[str, float]) -> str:
    """``12.0 samples/s 310 tok/s``: the rates of the counters an actor has, in :data:`RATE_KEYS` order."""
    return " ".join(f"{format_number(instance_rates[k])} {unit}/s"
                    for k, unit in RATE_KEYS.items() if k in instance_rates) or "-"


def flatten(stats: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested statistics as ``a.b=value`` pairs of scalars (lists shown by length)."""
    out: dict[str, Any] = {}
    for key, value in stats.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, path + "."))
        elif isinstance(value, list):
            out[path + ".len"] = len(value)
        else:
            out[path] = value
    return out


def render(snapshot: dict[str, Any], *, width: int = 120, color: bool = False, title: str = "") -> str:
    """The status view as text lines no wider than ``width`` (ANSI colours when ``color``)."""

    def paint(text: str, code: str) -> str:
        return f"{code}{text}{_RESET}" if color else text

    instances = snapshot["instances"]
    stale = sum(1 for i in instances if i["stale"])
    when = time.strftime("%H:%M:%S", time.localtime(snapshot["at"]))
    lines = [paint(f"rollout status  {title}  {when}  instances: {len(instances)}"
                   f"{f' ({stale} stale)' if stale else ''}  heartbeats: {snapshot['heartbeats']}", _BOLD), ""]
    header = f"{'ROLE':<16} {'INSTANCE/ACTOR':<30} {'UP':>7} {'SEEN':>6} {'STATE':<9} {'IN-FLIGHT':>9} " \
             f"{'LAG':>7} {'VERSION':>7}  THROUGHPUT"
    lines.append(paint(header[:width], _BOLD))
    for i in instances:
        if not i["alive"]:
            state, code = "dead", _RED
        elif i["stale"]:
            state, code = "stale", _DIM
        elif i["restarts"]:
            state, code = f"ok r{i['restarts']}", _YELLOW
        else:
            state, code = "ok", ""
        who = f"{i['instance']}/{i['name']}"
        row = (f"{i['role'][:16]:<16} {who[-30:]:<30} {format_duration(i['uptime_s']):>7} "
               f"{i['last_seen_s']:>5.1f}s {state:<9} {format_number(i['in_flight']):>9} "
               f"{format_number(i['lag']):>7} {format_number(i['version']):>7}")
        throughput = format_throughput(i["rates"])
        if len(row) + 2 + len(throughput) <= width:
            rows = [f"{row}  {throughput}"]
        else:  # a narrow terminal: the throughput goes on its own line under the row
            rows = [row[:width], f"{'':4}throughput: {throughput}"[:width]]
        lines += [paint(r, code) if code else r for r in rows]

    if snapshot["rewards"]:
        lines += ["", paint(f"{'REWARD BY DOMAIN':<20} {'COUNT':>8} {'MEAN':>8} {'SUCCESS':>8} {'ZERO-VAR':>9}", _BOLD)]
        for domain, r in sorted(snapshot["rewards"].items()):
            lines.append(f"{domain[:20]:<20} {format_number(r['count']):>8} {r['mean']:>8.3f} "
                         f"{r['success']:>8.1%} {r['zero_variance_rate']:>9.1%}"[:width])

    balance = snapshot.get("balance") or {}
    if balance:
        policies = sorted({str(b.get("policy", "")) for b in balance.values()} - {""})
        header = (f"{'SAMPLING BY DOMAIN':<20} {'SHARE':>7} {'FACTOR':>7} {'VARIED':>7} {'SOLVE':>7} "
                  f"{'PROGRESS':>8} {'GROUPS':>7} {'ERRORS':>7}  STATE  (policy {', '.join(policies)})")
        lines += ["", paint(header[:width], _BOLD)]
        for domain, b in sorted(balance.items()):
            state = f"paused ({b.get('pauses', 0)}x)" if b.get("paused") else (
                f"ok ({b.get('pauses')} pauses)" if b.get("pauses") else "ok")
            row = (f"{domain[:20]:<20} {_pct(b.get('share')):>7} {format_number(b.get('factor')):>7} "
                   f"{_pct(b.get('varied')):>7} {_pct(b.get('solve')):>7} {format_number(b.get('progress')):>8} "
                   f"{format_number(b.get('window_groups')):>7} {format_number(b.get('verifier_errors')):>7}  {state}")
            lines.append(paint(row[:width], _YELLOW) if b.get("paused") else row[:width])
    learner_domains = snapshot.get("learner_domains") or {}
    if learner_domains:
        lines += ["", paint(f"{'LAST STEP BY DOMAIN':<20} {'SAMPLES':>8} {'TOKENS':>8} {'REWARD':>8} {'|ADV|':>8} "
                            f"{'LOSS-W':>8} {'GRAD':>8}", _BOLD)]
        for domain, d in sorted(learner_domains.items()):
            if isinstance(d, dict):
                lines.append(f"{domain[:20]:<20} {format_number(d.get('samples')):>8} "
                             f"{format_number(d.get('tokens')):>8} {format_number(d.get('reward')):>8} "
                             f"{format_number(d.get('adv_abs')):>8} {_pct(d.get('loss_weight')):>8} "
                             f"{_pct(d.get('grad_share')):>8}"[:width])

    details = []
    for i in instances:
        rest = {k: v for k, v in flatten({k: v for k, v in i["stats"].items() if k not in SHOWN_KEYS}).items()
                if v is not None}
        if rest:
            pairs = " ".join(f"{k}={format_number(v)}" for k, v in sorted(rest.items()))
            details.append(f"{i['instance']}/{i['name']}: {pairs}")
    if details:
        lines += ["", paint("DETAILS", _BOLD)]
        lines += [d if len(d) <= width else d[:width - 1] + "…" for d in details]
    return "\n".join(lines)


def _pct(value: Any) -> str:
    return f"{float(value):.1%}" if _is_number(value) else "-"


def _is_number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# -- the command -------------------------------------------------------------------------------------

def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML config of the deployment (its namespace and NATS settings)")
    parser.add_argument("--once", action="store_true",
                        help="listen for about two heartbeat intervals, print one snapshot and exit "
                             "(exit 1 if no instance was heard)")
    parser.add_argument("--json", action="store_true", help="print snapshots as JSON instead of a table")
    parser.add_argument("--window", type=float, default=None,
                        help="seconds --once listens (default: 2 x telemetry.heartbeat_s + 0.5)")
    parser.set_defaults(func=cmd_status)


def cmd_status(args: argparse.Namespace) -> int:
    import anyio

    from engine.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, files=True)
    except ConfigError as exc:
        print(f"rollout status: {exc}", file=sys.stderr)
        return 2
    interval = cfg.telemetry.heartbeat_s
    window = args.window if args.window is not None else 2 * interval + 0.5
    try:
        return anyio.run(watch, cfg, args.once, args.json, window)
    except KeyboardInterrupt:
        return 0


async def watch(cfg: Any, once: bool, as_json: bool, window_s: float, out: TextIO = sys.stdout) -> int:
    """Subscribe to the deployment's heartbeats and print snapshots (one with ``once``, else every second)."""
    import anyio

    from engine.schemas import Heartbeat
    from engine.topics import Names
    from streams.codec import DecodeError, decode
    from streams.nats import Nats, NatsError

    subject = Names(cfg.namespace).subject("heartbeat", ">")
    where = f"namespace {cfg.namespace!r} at {cfg.nats.url} (subject {subject})"
    board = Board(cfg.telemetry.heartbeat_s)

    async def on_message(msg: Any) -> None:
        try:
            env = decode(msg.data, expect=("heartbeat",))
        except DecodeError:
            board.undecodable += 1
            return
        hb = env.message
        assert isinstance(hb, Heartbeat)  # decode(expect=("heartbeat",)) let nothing else through
        board.observe(hb.role, hb.instance, hb.stats, sent_at=env.created_at, received_at=time.monotonic())

    try:
        nats = await Nats(cfg.nats).connect()
    except NatsError as exc:
        print(f"rollout status: {exc}", file=sys.stderr)
        return 1
    try:
        assert nats.nc is not None
        await nats.nc.subscribe(subject, cb=on_message)
        if once:
            await anyio.sleep(window_s)
            snap = board.snapshot(time.monotonic())
            if not snap["instances"]:
                print(f"rollout status: no heartbeats within {window_s:.1f}s on {where}; is a deployment "
                      f"running with this namespace and NATS URL?", file=sys.stderr)
                return 1
            _emit(snap, out, as_json=as_json, live=False, title=where)
            return 0
        live = not as_json and out.isatty()
        if live:
            out.write("\x1b[?25l\x1b[2J")
        try:
            while True:
                _emit(board.snapshot(time.monotonic()), out, as_json=as_json, live=live, title=where)
                await anyio.sleep(1.0)
        finally:
            if live:
                out.write("\x1b[?25h\n")
                out.flush()
    finally:
        with anyio.CancelScope(shield=True):
            await nats.close()


def _emit(snap: dict[str, Any], out: TextIO, *, as_json: bool, live: bool, title: str,
          size: Callable[[], Any] = shutil.get_terminal_size) -> None:
    if as_json:
        out.write(json.dumps(snap, default=str) + "\n")
    elif live:
        text = render(snap, width=size().columns, color=True, title=title)
        # home, each line cleared to its end, then everything below the last line cleared
        out.write("\x1b[H" + "\n".join(line + "\x1b[K" for line in text.split("\n")) + "\n\x1b[J")
    else:
        out.write(render(snap, width=max(120, size().columns), title=title) + "\n")
    out.flush()
