"""A process's own view of the filesystem, as a container's: the node's files plus volumes
mounted at the pod's mount paths, without touching the node's own tree.

``wrap(command, mounts, root)`` returns a command line that runs ``command`` in a new
mount namespace (``unshare --mount``: its mounts vanish with the process and never reach
the node) whose root is a tmpfs on ``root`` holding a bind mount of every top-level entry
of ``/`` (top-level symlinks copied) plus each ``Mount``'s directory at its path,
read-only when the pod says so; the process then runs chrooted there, in the caller's
working directory. So a path the operator writes into a pod (``/adapter-claims/sql/sql``)
resolves inside that process, both on its command line and when a client sends it over
HTTP, exactly as in the pod.

A mount path must start with a top-level name the node does not have (``/adapter-claims``,
``/models``): under a bound directory its mount point would be created in the node's tree.
Needs mount namespaces (root, or unprivileged user namespaces): ``supported()`` says.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

_SCRIPT = r"""
set -eu
root=$1; shift
mount -t tmpfs -o mode=755 pod-root "$root"
for entry in /* /.[!.]*; do
  [ -e "$entry" ] || [ -L "$entry" ] || continue
  if [ -L "$entry" ]; then ln -s "$(readlink "$entry")" "$root$entry"
  elif [ -d "$entry" ]; then mkdir "$root$entry"; mount --rbind "$entry" "$root$entry"
  else : > "$root$entry"; mount --bind "$entry" "$root$entry"; fi
done
while [ "$1" != "--" ]; do
  mkdir -p "$root$1"; mount --bind "$2" "$root$1"
  if [ "$3" = ro ]; then mount -o remount,bind,ro "$root$1"; fi
  shift 3
done
shift
exec chroot "$root" /bin/sh -c 'cd "$1"; shift; exec "$@"' sh "$PWD" "$@"
"""


@dataclass(frozen=True, slots=True)
class Mount:
    """``source`` (a directory of this machine) at ``path`` in the process's root."""

    path: str
    source: Path
    read_only: bool = True


def _unshare() -> list[str]:
    flags = ["--mount"] if os.geteuid() == 0 else ["--user", "--map-root-user", "--mount"]
    return [shutil.which("unshare") or "unshare", *flags]


def wrap(command: Sequence[str], mounts: Sequence[Mount], root: Path) -> list[str]:
    """``command`` run with ``mounts`` in its own root, built on the empty directory ``root``."""
    args: list[str] = []
    for m in sorted(mounts, key=lambda m: m.path):
        top = "/" + posixpath.normpath(m.path).lstrip("/").split("/")[0]
        if not posixpath.isabs(m.path) or top == "/" or os.path.lexists(top):
            raise ValueError(f"mount path {m.path!r}: {top!r} exists on this machine (see the module docstring)")
        args += [posixpath.normpath(m.path), str(m.source.resolve()), "ro" if m.read_only else "rw"]
    root.mkdir(parents=True, exist_ok=True)
    return [*_unshare(), "sh", "-c", _SCRIPT, "pod-root", str(root), *args, "--", *command]


def supported(scratch: Path) -> bool:
    """Whether this machine can run ``wrap``'s command lines (tried, with one mount)."""
    if shutil.which("unshare") is None or shutil.which("chroot") is None:
        return False
    source = scratch / "probe-source"
    source.mkdir(parents=True, exist_ok=True)
    (source / "probe").write_text("ok")
    probe = wrap(["cat", "/pod-root-probe/probe"], [Mount("/pod-root-probe", source)], scratch / "probe-root")
    run = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    return run.returncode == 0 and run.stdout == "ok"
