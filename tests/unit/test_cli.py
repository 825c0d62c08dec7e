"""The `rollout` command lists only what is built."""

from __future__ import annotations

import importlib.util

import pytest

from ops.cli import COMMANDS, build_parser


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_listed_command_has_its_module(name: str) -> None:
    module_name, _ = COMMANDS[name]
    assert importlib.util.find_spec(module_name) is not None, f"`rollout {name}` names a missing {module_name}"


def test_an_unbuilt_command_is_not_listed() -> None:
    with pytest.raises(SystemExit):
        build_parser("infra").parse_args(["no-such-command"])
