"""The init of a bwrap sandbox: pid 1 of its namespaces, it runs each exec request in a fresh child.

Runs inside the sandbox as ``python3 -I -S sandbox_init.py CONTROL_FD`` (stdlib only, no imports of
this project). Protocol over the SOCK_SEQPACKET socket CONTROL_FD, one JSON object per message:

- host -> init: ``{"seq", "argv", "env", "cwd", "stdin", "rlimits"}`` with file descriptors attached
  (SCM_RIGHTS): ``[stdin?, stdout, stderr]``, the write ends of the host's pipes.
- init -> host: ``{"ready": true}`` once, then ``{"seq", "exit_code"}`` per request, sent only after
  every other process of the sandbox is dead and reaped, so the host's pipes reach EOF at once.

As pid 1 of the pid namespace the init cannot be signalled from inside it, and ``kill(-1, SIGKILL)``
from it reaches every other process there. It makes itself non-dumpable, so sandboxed code (same uid)
can neither read nor write its memory through /proc. The host ends it by closing the socket.
"""

import ctypes
import json
import os
import resource
import signal
import socket
import sys

PR_SET_DUMPABLE = 4
RLIMITS = {"nofile": resource.RLIMIT_NOFILE, "fsize": resource.RLIMIT_FSIZE, "core": resource.RLIMIT_CORE,
           "nproc": resource.RLIMIT_NPROC}


def run_child(req, fds):
    """In the forked child: wire stdio, drop to the limits, exec. Never returns."""
    try:
        os.setsid()
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(sig, signal.SIG_DFL)  # Python ignores them; the command must not inherit that
        if req["stdin"]:
            stdin, out, err = fds
        else:
            stdin, (out, err) = os.open("/dev/null", os.O_RDONLY), fds
        os.dup2(stdin, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.closerange(3, 1 << 16)
        try:
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("1000")  # the OOM killer takes the command, never the init
        except OSError:
            pass
        for name, value in req["rlimits"].items():
            resource.setrlimit(RLIMITS[name], (value, value))
        os.chdir(req["cwd"])
        os.execvpe(req["argv"][0], req["argv"], req["env"])
    except BaseException as exc:  # noqa: BLE001 - report anything, then exit like a shell would
        try:
            os.write(2, f"sandbox: cannot run {req['argv'][0]!r}: {exc}\n".encode())
        finally:
            os._exit(127 if isinstance(exc, FileNotFoundError) else 126)
    os._exit(126)


def kill_the_rest():
    """SIGKILL and reap every process of the namespace but this one."""
    while True:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def main():
    ctl = socket.socket(fileno=int(sys.argv[1]))
    os.set_inheritable(ctl.fileno(), False)
    ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    ctl.send(b'{"ready": true}')
    while True:
        msg, fds, _, _ = socket.recv_fds(ctl, 1 << 20, 3)
        if not msg:
            kill_the_rest()
            return
        req = json.loads(msg)
        pid = os.fork()
        if pid == 0:
            run_child(req, fds)
        for fd in fds:
            os.close(fd)
        while True:
            try:
                reaped, status = os.waitpid(-1, 0)
            except ChildProcessError:
                status = 0
                break
            if reaped == pid:
                break
        code = os.waitstatus_to_exitcode(status)
        kill_the_rest()
        ctl.send(json.dumps({"seq": req["seq"], "exit_code": 128 - code if code < 0 else code}).encode())


if __name__ == "__main__":
    main()
