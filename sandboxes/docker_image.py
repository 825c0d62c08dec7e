"""Builds the docker backend's image locally (no registry is reachable): ``rollout-sandbox:<hash>``.

The root filesystem is assembled from the host: the static busybox (``apt-get install busybox-static``)
for /bin and its applets, the host's python3.11 with the shared libraries ``ldd`` names, and the
standard library without its tests. The tarball is imported with ``docker import``. The tag is a hash
of every input (paths, sizes, mtimes) and of this recipe, so building again is a no-op.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

RECIPE_VERSION = "4"
REPOSITORY = "rollout-sandbox"
PYTHON = Path("/usr/bin/python3.11")
STDLIB = Path("/usr/lib/python3.11")
STDLIB_SKIP = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data", "__pycache__"}
PASSWD = "root:x:0:0:root:/root:/bin/sh\nsandbox:x:65534:65534:sandbox:/work:/bin/sh\n"
GROUP = "root:x:0:\nsandbox:x:65534:\n"


def _busybox() -> Path:
    found = shutil.which("busybox")
    if not found:
        raise RuntimeError("busybox is needed for the sandbox image: apt-get install busybox-static")
    return Path(found)


def _shared_libs(binary: Path) -> list[Path]:
    out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=False).stdout
    libs = [Path(m) for m in re.findall(r"(/\S+)\s+\(0x", out)]
    return [lib for lib in libs if lib.exists()]


def _inputs() -> list[tuple[str, Path]]:
    """(path in the image, host file) for every file copied in."""
    items: list[tuple[str, Path]] = [("bin/busybox", _busybox()), ("usr/bin/python3.11", PYTHON)]
    dynload = STDLIB / "lib-dynload"
    for lib in {*_shared_libs(PYTHON), *(x for so in dynload.glob("*.so") for x in _shared_libs(so))}:
        inner = str(lib).lstrip("/")
        if inner.startswith(("lib/", "lib64/")):  # merged /usr: /lib and /lib64 are links into usr/
            inner = "usr/" + inner
        items.append((inner, lib.resolve()))
    for dirpath, dirnames, filenames in os.walk(STDLIB):
        dirnames[:] = sorted(d for d in dirnames if d not in STDLIB_SKIP and d != "site-packages" and d != "dist-packages")
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if path.is_file():
                items.append((str(path).lstrip("/"), path))
    return sorted(set(items))


def image_tag() -> str:
    """``rollout-sandbox:<hash of the inputs>``."""
    digest = hashlib.sha256(RECIPE_VERSION.encode())
    for inner, host in _inputs():
        st = host.stat()
        digest.update(f"{inner}\0{st.st_size}\0{int(st.st_mtime)}\n".encode())
    return f"{REPOSITORY}:{digest.hexdigest()[:16]}"


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    tar.addfile(info, io.BytesIO(data))


def _add_dir(tar: tarfile.TarFile, name: str, mode: int = 0o755, owner: int = 0) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.uid, info.gid = tarfile.DIRTYPE, mode, owner, owner
    tar.addfile(info)


def _add_link(tar: tarfile.TarFile, name: str, target: str) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    tar.addfile(info)


def write_rootfs(path: Path) -> None:
    """Write the image's root filesystem as a tarball at ``path``."""
    applets = subprocess.run([str(_busybox()), "--list"], capture_output=True, text=True, check=True).stdout.split()
    with tarfile.open(path, "w") as tar:
        for d in ("bin", "usr", "usr/bin", "usr/lib", "usr/lib64", "etc", "verify", "proc", "dev", "sys"):
            _add_dir(tar, d)
        _add_dir(tar, "root", 0o700)
        # the engine copies the image's directory under a tmpfs mount onto it: /work starts as this
        _add_dir(tar, "work", 0o700, owner=65534)
        _add_dir(tar, "tmp", 0o1777)
        for inner, host in _inputs():
            tar.add(host, arcname=inner, recursive=False)
        for applet in applets:
            if applet != "busybox":
                _add_link(tar, f"bin/{applet}", "busybox")
        _add_link(tar, "usr/bin/python3", "python3.11")
        _add_link(tar, "usr/bin/python", "python3.11")
        _add_link(tar, "lib64", "usr/lib64")
        _add_link(tar, "lib", "usr/lib")
        _add_bytes(tar, "etc/passwd", PASSWD.encode())
        _add_bytes(tar, "etc/group", GROUP.encode())
        _add_bytes(tar, "etc/hosts", b"127.0.0.1 localhost\n")


def ensure_image(client: Any = None) -> str:
    """The tag of the sandbox image, building and importing it first if the engine lacks it."""
    import docker

    client = client or docker.from_env()
    tag = image_tag()
    try:
        client.images.get(tag)
        return tag
    except docker.errors.ImageNotFound:
        pass
    repository, version = tag.split(":")
    with tempfile.TemporaryDirectory(prefix="rollout-sandbox-image-") as tmp:
        rootfs = Path(tmp) / "rootfs.tar"
        write_rootfs(rootfs)
        client.api.import_image_from_file(
            str(rootfs), repository=repository, tag=version, changes=["WORKDIR /work", "ENV PATH=/usr/bin:/bin"]
        )
    return tag


if __name__ == "__main__":
    print(ensure_image())
    sys.exit(0)
