"""Hosts that fail: the pipeline on three network-namespace hosts, one of them killed whole mid-run.

Three hosts are Linux network namespaces (``loadtests/_netns.py``). Host 0 runs the Kafka broker and
nats-server on its service address, plus the scheduler and the learner (one each: they are singletons).
Hosts 1 and 2 each run one inference, one sandbox and one reward daemon (``rollout run --config F --role
R``), so every scaled-out role has two replicas in its Kafka consumer group, on topics of 4 partitions.
Mid-run, every process of host 2 is SIGKILLed (by pid, from the namespace's pid list) and its link is cut;
after ``--host-down`` seconds the link comes back and its daemons restart. The run then finishes and the
exactly-once ledger (``ops/ledger.py``) is built from the topics and the learner's audit log: 0 samples
lost and 0 trained twice are the targets.

    python -m loadtests.hosts --quick --json runs/hosts.json

Needs root (``ip netns``). Namespaces and links carry a random tag and are removed on exit, failure
included. The pipeline pieces (role daemons, config, waiting for the end) are loadtests/chaos.py's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from loadtests import _netns
from loadtests._cluster import RoleProc, pipeline_config, start_services, stop_services, write_toml
from loadtests.chaos import Chaos, Plan
from ops.infra import InfraConfig, KafkaBroker, NatsServer, free_port
from ops.infra.process import PidRecord
from ops.infra.service import Service

PARTITIONS = 4
HOST_ROLES = {0: ("scheduler", "learner"), 1: ("inference", "sandbox", "reward"),
              2: ("inference", "sandbox", "reward")}
FAILED_HOST = 2


# -- services and daemons inside a namespace ---------------------------------------------------------

class _InNetns(Service):
    """A service started through ``ip netns exec``: its pid file is rewritten with the exec'd argv.

    ``ip netns exec`` execs the server in place (same pid), so the argv /proc shows is the server's own,
    not the one spawned; the pid file must describe that, or the service looks dead (and is never stopped).
    """

    def __init__(self, config: InfraConfig, topo: _netns.Topology) -> None:
        super().__init__(config)
        self.topo = topo

    def start(self) -> int:
        pid = super().start()
        inner = self.argv()[len(self.topo.prefix(0)):]
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            record = PidRecord.of_process(pid)
            if record is None or record.argv == inner:
                break
            time.sleep(0.02)
        if record is not None:
            record.write(self.pid_file)
        return pid


class NetnsKafka(_InNetns, KafkaBroker):
    """The private broker, run on a host namespace and listening on the hub's service address."""

    @property
    def bootstrap_servers(self) -> str:
        return f"{self.topo.service_ip}:{self.config.kafka_port}"

    @property
    def address(self) -> str:
        return self.bootstrap_servers

    def extra_properties(self) -> dict[str, str]:
        ip, port, cport = self.topo.service_ip, self.config.kafka_port, self.config.kafka_controller_port
        return {"controller.quorum.voters": f"1@{ip}:{cport}",
                "listeners": f"PLAINTEXT://{ip}:{port},CONTROLLER://{ip}:{cport}",
                "advertised.listeners": f"PLAINTEXT://{ip}:{port}"}

    def argv(self) -> list[str]:
        return [*self.topo.prefix(0), *super().argv()]


class NetnsNats(_InNetns, NatsServer):
    """The private nats-server, run on the hub namespace on its service address."""

    @property
    def url(self) -> str:
        return f"nats://{self.topo.service_ip}:{self.config.nats_port}"

    @property
    def address(self) -> str:
        return self.url

    def argv(self) -> list[str]:
        argv = super().argv()
        argv[argv.index("-a") + 1] = self.topo.service_ip
        return [*self.topo.prefix(0), *argv]


class HostStack:
    """Broker and nats-server on the hub host; ``infra`` gives the addresses the harness reads."""

    def __init__(self, work: Path, topo: _netns.Topology) -> None:
        config = InfraConfig.from_env(state_dir=work / "infra", kafka_port=free_port(),
                                      kafka_controller_port=free_port(), nats_port=free_port())
        self.kafka = NetnsKafka(config, topo)
        self.nats = NetnsNats(config, topo)
        self.infra = argparse.Namespace(kafka_bootstrap=self.kafka.bootstrap_servers, nats_url=self.nats.url)

    def start(self) -> None:
        start_services((self.kafka, self.nats))

    def stop(self) -> None:
        stop_services((self.nats, self.kafka))


class HostProc(RoleProc):
    """A role daemon on one host namespace; its HTTP status is read from inside that namespace."""

    def __init__(self, name: str, role: str, config: Path, work: Path, topo: _netns.Topology, host: int) -> None:
        super().__init__(name, role, config, work)
        self.topo = topo
        self.host = host

    def command_prefix(self) -> list[str]:
        return self.topo.prefix(self.host)

    def status(self, timeout_s: float = 5.0) -> dict[str, Any]:
        if not self.http or not self.alive():
            return {}
        res = subprocess.run([*self.topo.prefix(self.host), "curl", "-s", "-m", str(timeout_s), f"{self.http}/status"],
                             capture_output=True, text=True)
        try:
            return json.loads(res.stdout) if res.returncode == 0 else {}
        except ValueError:
            return {}


# -- the run -------------------------------------------------------------------------------------

class Hosts(Chaos):
    """Chaos's pipeline and end-of-run checks, on three hosts, with one fault: a whole host fails."""

    def __init__(self, plan: Plan, work: Path, topo: _netns.Topology, *, log: Any = print) -> None:
        super().__init__(plan, work, log=log)
        self.topo = topo
        self.stack = HostStack(work, topo)  # type: ignore[assignment]
        self.host_kills: list[dict[str, Any]] = []

    def setup(self) -> None:
        from modelserver.llm import write_tiny_model_dir
        from engine.config import EngineConfig

        self.stack.start()
        model_dir = write_tiny_model_dir(self.work / "model", seed=self.plan.seed)
        namespace = f"hosts-{uuid.uuid4().hex[:8]}"
        base = pipeline_config(namespace, self.stack.infra.kafka_bootstrap, self.stack.infra.nats_url, self.work,
                               model_dir, max_tasks=self.plan.tasks, domains=self.plan.domains,
                               kafka={"default_partitions": PARTITIONS})
        self.cfg = EngineConfig.model_validate(base)
        for host, roles in HOST_ROLES.items():
            for role in roles:
                name = role if host == 0 else f"{role}-h{host}"  # chaos's end checks name "learner"
                data = json.loads(json.dumps(base))
                if role == "inference":  # each inference instance reads its own sandbox-results partition
                    data["inference"]["reply_partition"] = host - 1
                path = write_toml(data, self.work / f"{name}.toml")
                self.procs[name] = HostProc(name, role, path, self.work, self.topo, host)
        for p in self.procs.values():
            p.start()
        for p in self.procs.values():
            p.wait_ready()
        self.note("pipeline ready", namespace=namespace, hosts=self.topo.hosts, service_ip=self.topo.service_ip)
        threading.Thread(target=self._watchdog, daemon=True).start()

    def fail_whole_host(self, host: int) -> None:
        with self._lock:
            procs = [p for p in self.procs.values() if isinstance(p, HostProc) and p.host == host]
            for p in procs:
                p.held_down = True
            self.topo.set_link(host, up=False)
            pids = [p.pid for p in procs]
            for p in procs:  # each daemon's process group (sandboxes live in network namespaces of their own)
                p.kill()
            pids += self.topo.kill_host(host)  # then anything else left on the host
        self.host_kills.append({"host": self.topo.hosts[host], "pids": len(pids)})
        self.note("host down (every process SIGKILLed, link cut)", host=self.topo.hosts[host], pids=pids)

    def recover_whole_host(self, host: int) -> None:
        with self._lock:
            self.topo.set_link(host, up=True)
            for p in self.procs.values():
                if isinstance(p, HostProc) and p.host == host:
                    p.held_down = False
                    p.start()
        self.note("host back", host=self.topo.hosts[host])

    def schedule(self) -> list[tuple[float, Any, str]]:
        d = self.plan.duration_s
        return [(d * 0.25, lambda: self.fail_whole_host(FAILED_HOST), "host down"),
                (d * 0.25 + self.plan.host_down_s, lambda: self.recover_whole_host(FAILED_HOST), "host back")]


def quick_plan(seed: int = 0) -> Plan:
    """The smoke run: 12 tasks, host 2 down for 10 s (about 70 s on 2 cores)."""
    return Plan(tasks=12, kills=0, duration_s=40.0, host_down_s=10.0, broker_restarts=0, nats_restarts=0,
                seed=seed, finish_timeout_s=180.0)


def run(plan: Plan, work: Path, *, log: Any = print) -> dict[str, Any]:
    """The whole run; returns the ledger summary (headline keys first), the ledger table and the events."""
    from ops.ledger import build_ledger

    topo = _netns.Topology(len(HOST_ROLES))
    hosts: Hosts | None = None
    try:
        topo.create()
        hosts = Hosts(plan, work, topo, log=log)
        hosts.setup()
        hosts.run_faults()
        finish = hosts.wait_finished()
        rcs = hosts.shutdown()
        report = build_ledger(hosts.cfg)
    finally:
        if hosts is not None:
            hosts._stop_watch.set()
            for p in hosts.procs.values():
                if p.alive():
                    p.kill()
            hosts.stack.stop()
        topo.destroy()
    summary = report.summary()
    return {
        "samples_lost": summary["samples_lost"],
        "samples_trained_twice": summary["samples_trained_twice"],
        "tasks_admitted": summary["tasks_admitted"],
        "samples_expected": summary["samples_expected"],
        "checkpoint_agrees": summary["checkpoint_agrees"],
        "hosts": len(topo.hosts),
        "host_kills": hosts.host_kills,
        "host_down_s": plan.host_down_s,
        "replicas": {role: sum(role in r for r in HOST_ROLES.values()) for role in ("inference", "sandbox", "reward")},
        "partitions": PARTITIONS,
        "starts": {p.name: p.starts for p in hosts.procs.values()},
        "unexpected_exits": hosts.unexpected_exits,
        "drain_exit_codes": rcs,
        "finish": finish,
        "netns_left": topo.leftovers(),
        "seconds": round(time.monotonic() - hosts.started, 1),
        **{f"ledger_{k}": v for k, v in summary.items() if k != "fates"},
        "fates": summary["fates"],
        "events": hosts.events,
        "table": report.table(),
    }


def print_results(results: dict[str, Any]) -> None:
    print()
    print(results["table"])
    print()
    for key in ("hosts", "host_kills", "host_down_s", "replicas", "partitions", "tasks_admitted",
                "samples_expected", "samples_lost", "samples_trained_twice", "checkpoint_agrees", "netns_left",
                "seconds"):
        print(f"{key:<24}{results[key]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 12 tasks, host down 10 s")
    parser.add_argument("--json", help="write the results here (without the event log and the table)")
    parser.add_argument("--tasks", type=int, default=None, help="scheduler.max_tasks (default 40; quick 12)")
    parser.add_argument("--host-down", type=float, default=None, help="seconds the failed host stays down")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, checkpoints)")
    args = parser.parse_args(argv)
    plan = dataclasses.replace(quick_plan(args.seed), tasks=40, duration_s=90.0, host_down_s=25.0,
                               finish_timeout_s=300.0)
    if args.quick:
        plan = quick_plan(args.seed)
    if args.tasks is not None:
        plan.tasks = args.tasks
    if args.host_down is not None:
        plan.host_down_s = args.host_down
    work = Path(tempfile.mkdtemp(prefix="rollout-hosts-"))
    print(f"work dir {work}", flush=True)
    try:
        results = run(plan, work, log=lambda s: print(s, flush=True))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print_results(results)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        out = {k: v for k, v in results.items() if k not in ("events", "table")}
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    ok = results["samples_lost"] == 0 and results["samples_trained_twice"] == 0 and not results["netns_left"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
