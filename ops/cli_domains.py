"""`rollout domains list`: every domain this process can use, where it comes from, how it is judged.

Domains are the built-in ones, those of installed packages' ``rollout_engine.domains`` entry points, those a
config's ``[domains] plugins`` names (``--config``) and ``--plugin module:attr`` ones; families such as
reasoning-gym's (``rg:NAME``) are expanded. A domain that cannot be used here (its package is not installed,
its scorer cannot be trusted, its plugin fails to import) is listed as unavailable with why.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="domains_command", metavar="SUBCOMMAND")
    sub.required = True
    p = sub.add_parser("list", help="list the domains: name, source, verifier, episode kind, sandbox",
                       description="list the domains: name, source, verifier, episode kind, sandbox")
    p.add_argument("--config", help="a deployment's TOML config: load its [domains] plugins too")
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE:ATTR",
                   help="load a domain plugin (a Domain, a list, a family or a module; repeatable)")
    p.add_argument("--json", action="store_true", help="one JSON object per domain instead of the table")
    p.add_argument("--available", action="store_true", help="only the domains usable here")
    p.set_defaults(func=cmd_list)


def rows(*, available_only: bool = False) -> list[dict[str, Any]]:
    """One row per domain (every family expanded), sorted by name; unavailable ones with ``why``."""
    from domains import DOMAINS

    out: list[dict[str, Any]] = []
    for name in DOMAINS.names():
        try:
            d = DOMAINS[name]
        except KeyError as exc:
            if not available_only:
                out.append({"name": name, "available": False, "why": str(exc)})
            continue
        out.append({"name": name, "available": True, "source": d.source, "verifier": d.verifier_name,
                    "episode": d.episode_kind, "sandbox": d.needs_sandbox, "trainable": d.trainable,
                    "tools": len(d.tools), "description": d.description, "origin": DOMAINS.origin(name)})
    if not available_only:
        names = {r["name"] for r in out}
        out += [{"name": n, "available": False, "why": why} for n, why in sorted(DOMAINS.unavailable_names().items())
                if n not in names]
    return sorted(out, key=lambda r: (not r["available"], r["name"]))


def cmd_list(args: argparse.Namespace) -> int:
    from domains import load_domain_plugins
    from engine.registry import PluginError

    specs = list(args.plugin)
    if args.config:
        from engine.config import ConfigError, load_config
        try:
            specs = load_config(args.config).domains.plugins + specs
        except ConfigError as exc:
            print(f"rollout domains list: {exc}", file=sys.stderr)
            return 2
    try:
        load_domain_plugins(specs)
    except PluginError as exc:
        print(f"rollout domains list: {exc}", file=sys.stderr)
        return 2
    listing = rows(available_only=args.available)
    if args.json:
        for row in listing:
            print(json.dumps(row))
        return 0
    usable = [r for r in listing if r["available"]]
    header = ("name", "source", "verifier", "episode", "sandbox", "trainable")
    table = [header] + [(r["name"], r["source"], r["verifier"], r["episode"] + (f" ({r['tools']} tools)" if r["tools"] else ""),
                         "yes" if r["sandbox"] else "no", "yes" if r["trainable"] else "eval only") for r in usable]
    widths = [max(len(str(row[i])) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
    missing = [r for r in listing if not r["available"]]
    if missing:
        print(f"\nunavailable here ({len(missing)}):")
        for r in missing:
            print(f"  {r['name']}: {r['why']}")
    print(f"\n{len(usable)} domains available ({sum(r['trainable'] for r in usable)} trainable)"
          + (f", {len(missing)} unavailable" if missing else ""))
    return 0
