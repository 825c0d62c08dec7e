"""The init of a bwrap or docker sandbox: pid 1 of its namespaces, it runs each exec request in a fresh child.

Runs inside the sandbox (stdlib only, no imports of this project) as

- ``python3 -I -S sandbox_init.py CONTROL_FD`` (bwrap: a socket it inherits), or
- ``python3 -I -S sandbox_init.py --connect PATH [--seccomp HEX]`` (docker: it connects to the host's
  listening socket at PATH, a bind-mounted host directory, and loads the classic-BPF filter HEX into
  every command it starts, on top of the engine's own profile).

Protocol over the SOCK_SEQPACKET control socket, one JSON object per message:

- host -> init: ``{"seq", "argv", "env", "cwd", "stdin", "rlimits", "user"?}`` with file descriptors
  attached (SCM_RIGHTS): ``[stdin?, stdout, stderr]``, the write ends of the host's pipes. ``user``
  ``[uid, gid]``: the command drops to it (docker, where the init runs as root).
- host -> init: ``{"seq", "op": "reset", "wipe": [[path, uid, gid, mode | null], ...], "ipc": uid?}``:
  kill every other process, empty each directory as its owner (``mode``: restore the directory's own
  mode), remove the System V IPC objects of ``ipc``; replies ``{"seq", "exit_code": 0}`` or
  ``{"seq", "exit_code": 1, "error"}``.
- init -> host: ``{"ready": true}`` once, then ``{"seq", "exit_code"}`` per request, sent only after
  every other process of the sandbox is dead and reaped, so the host's pipes reach EOF at once; with
  ``--connect`` also ``"ipc"``: whether any System V IPC object exists now.

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
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
IPC_RMID = 0
RLIMITS = {"nofile": resource.RLIMIT_NOFILE, "fsize": resource.RLIMIT_FSIZE, "core": resource.RLIMIT_CORE,
           "nproc": resource.RLIMIT_NPROC}


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def seccomp_loader(program):
    """A function that installs the classic-BPF ``program`` (bytes of struct sock_filter[]) on the
    calling process; everything it needs is prepared here, once, not in each child."""
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(program, len(program))
    prog = _SockFprog(len(program) // 8, ctypes.cast(buf, ctypes.c_void_p))

    def load():
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or libc.prctl(
                PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "cannot load the seccomp filter")
    load.keep = (buf, prog)  # alive as long as the function
    return load


def drop_to(user):
    uid, gid = user
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)


def run_child(req, fds, seccomp=None):
    """In the forked child: wire stdio, drop to the user and limits, exec. Never returns."""
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
        if req.get("user"):
            drop_to(req["user"])
        os.chdir(req["cwd"])
        if seccomp is not None:
            seccomp()
        execvpe(req["argv"], req["env"])
    except BaseException as exc:  # noqa: BLE001 - report anything, then exit like a shell would
        try:
            os.write(2, f"sandbox: cannot run {req['argv'][0]!r}: {exc}\n".encode())
        finally:
            os._exit(127 if isinstance(exc, FileNotFoundError) else 126)
    os._exit(126)


def execvpe(argv, env):
    """``os.execvpe`` by hand: the stdlib's costs ~30 ms more per exec in a container (its search
    goes through ``os.fsencode`` and exception chaining); this is a plain walk of PATH."""
    if "/" in argv[0]:
        os.execve(argv[0], argv, env)
    error = FileNotFoundError(2, "not found in PATH", argv[0])
    for directory in env.get("PATH", "/usr/bin:/bin").split(":"):
        try:
            os.execve(f"{directory or '.'}/{argv[0]}", argv, env)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except PermissionError as exc:  # as execvp: remember it, try the rest
            error = exc
    raise error


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


def _empty(path, top_mode):
    """Remove everything inside the directory ``path`` (ours) without following links; the code may
    have made directories unreadable, so each is made ours to list before it is entered."""
    if top_mode is not None:
        os.chmod(path, top_mode)
    with os.scandir(path) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                os.chmod(entry.path, 0o700)
                _empty(entry.path, None)
                os.rmdir(entry.path)
            else:
                os.unlink(entry.path)


def _remove_ipc(uid):
    """Remove the System V shared memory, semaphores and message queues ``uid`` owns."""
    libc = ctypes.CDLL(None, use_errno=True)
    for kind, ctl in (("shm", libc.shmctl), ("sem", libc.semctl), ("msg", libc.msgctl)):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                header, *rows = f.read().splitlines()
        except OSError:
            continue
        cols = header.split()
        for row in rows:
            fields = dict(zip(cols, row.split()))
            if int(fields.get("uid", -1)) == uid:
                ident = int(fields["shmid" if kind == "shm" else "semid" if kind == "sem" else "msqid"])
                ctl(ident, 0, IPC_RMID) if kind == "sem" else ctl(ident, IPC_RMID, None)


def _as(user, action):
    """Run ``action()`` in a child that dropped to ``user``; the error text, or None."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            if user[0] != os.getuid():
                drop_to(user)
            action()
            os._exit(0)
        except BaseException as exc:  # noqa: BLE001 - reported to the host, which rebuilds the sandbox
            os.write(w, repr(exc).encode()[:2000])
            os._exit(1)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        error = f.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    if not error and status != 0:
        error = f"wiping as {user} ended with status {status}"
    return error or None


def reset(req):
    """Kill everything but the init, empty the workspace directories, drop IPC objects: the reply.

    What another user owns is emptied by one child that drops to that user (the init has no
    DAC_OVERRIDE), what the init's own user owns by the init itself."""
    kill_the_rest()
    by_user = {}
    for path, uid, gid, mode in req["wipe"]:
        by_user.setdefault((uid, gid), []).append((path, mode))
    ipc = req.get("ipc")
    if ipc is not None:
        by_user.setdefault((ipc, ipc), [])

    def wipe(user):
        for path, mode in by_user[user]:
            if os.path.isdir(path):
                _empty(path, mode)
        if ipc is not None and user == (ipc, ipc):
            _remove_ipc(ipc)

    errors = []
    for user in by_user:
        if user[0] == os.getuid():
            try:
                wipe(user)
            except OSError as exc:
                errors.append(repr(exc))
        else:
            errors.append(_as(user, lambda u=user: wipe(u)))
    errors = [e for e in errors if e]
    if errors:
        return {"seq": req["seq"], "exit_code": 1, "error": "; ".join(errors)}
    return {"seq": req["seq"], "exit_code": 0}


def ipc_present():
    """Whether any System V IPC object exists in this IPC namespace (each file has a header line)."""
    for kind in ("shm", "sem", "msg"):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                if len(f.read().splitlines()) > 1:
                    return True
        except OSError:
            pass
    return False


def main():
    seccomp = None
    docker = sys.argv[1] == "--connect"
    if docker:
        ctl = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ctl.connect(sys.argv[2])
        if len(sys.argv) > 4 and sys.argv[3] == "--seccomp":
            seccomp = seccomp_loader(bytes.fromhex(sys.argv[4]))
    else:
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
        if req.get("op") == "reset":
            for fd in fds:
                os.close(fd)
            ctl.send(json.dumps(reset(req)).encode())
            continue
        pid = os.fork()
        if pid == 0:
            run_child(req, fds, seccomp)
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
        answer = {"seq": req["seq"], "exit_code": 128 - code if code < 0 else code}
        if docker:  # the host wipes files itself at reset; IPC objects it cannot see, so it asks us
            answer["ipc"] = ipc_present()
        ctl.send(json.dumps(answer).encode())


if __name__ == "__main__":
    main()
