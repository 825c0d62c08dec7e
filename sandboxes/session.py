"""Multi-turn state on top of a sandbox: cwd and exported variables persist from one step to the next.

Each exec is a fresh process tree, so the shell's state is carried in a file: every step runs
``cd $cwd; . env; eval "$cmd"`` and an EXIT trap writes ``$PWD`` and the exported environment back.
Files persist anyway (the workspace lives as long as the sandbox). Background processes do not
outlive a step.
"""

from __future__ import annotations

import shlex

from sandboxes.base import SANDBOX_ENV, WORKDIR, ExecResult, Sandbox

STATE_DIR = "/tmp/.rollout-session"
# Variables the shell maintains itself; restoring them would be wrong.
_SHELL_OWNED = {"PWD", "OLDPWD", "SHLVL", "_"}

_WRAPPER = r"""
__rollout_save() {
  __rc=$?
  mkdir -p {state}
  pwd > {state}/cwd
  env -0 > {state}/env
  exit $__rc
}
trap __rollout_save EXIT
cd {cwd} 2>/dev/null || cd {workdir}
{exports}
eval {cmd}
"""


class SandboxSession:
    """One episode's shell: ``await session.run("cd src && export X=1")`` then ``run("echo $X")``."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox
        self.cwd = WORKDIR
        self.env: dict[str, str] = {}
        self.steps = 0

    async def run(self, command: str, timeout: float | None = None) -> ExecResult:
        exports = "\n".join(f"export {k}={shlex.quote(v)}" for k, v in self.env.items())
        script = (
            _WRAPPER.replace("{state}", STATE_DIR)
            .replace("{cwd}", shlex.quote(self.cwd))
            .replace("{workdir}", WORKDIR)
            .replace("{exports}", exports)
            .replace("{cmd}", shlex.quote(command))
        )
        result = await self.sandbox.exec(["/bin/sh", "-c", script], timeout=timeout)
        self.steps += 1
        await self._load_state()
        return result

    async def _load_state(self) -> None:
        try:
            cwd = (await self.sandbox.read_file(f"{STATE_DIR}/cwd")).decode(errors="replace").strip()
            raw_env = await self.sandbox.read_file(f"{STATE_DIR}/env")
        except (OSError, ValueError):
            return  # killed before the trap ran (timeout, OOM): keep the last known state
        if cwd.startswith("/"):
            self.cwd = cwd
        env: dict[str, str] = {}
        for item in raw_env.split(b"\0"):
            key, sep, value = item.decode(errors="replace").partition("=")
            if sep and key not in _SHELL_OWNED and SANDBOX_ENV.get(key) != value:
                env[key] = value
        self.env = env

