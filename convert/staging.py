"""Where a conversion is written until it is complete, and how it takes OUT's place.

A conversion writes into `.OUT.tmp-HOST-PID-RANDOM` beside OUT and renames it to OUT when done, so an
interrupted one never leaves an OUT that loads. Replacing an older conversion (`--overwrite`) exchanges the
two directories in one step where the kernel can (Linux's renameat2 RENAME_EXCHANGE): at no moment is OUT
missing. Elsewhere the old OUT is moved aside into `.OUT.old-HOST-PID-RANDOM` first; a run killed between the
two renames leaves no OUT, and the next run of the same OUT puts the old conversion back (`sweep_stale`)
rather than orphaning it, a model-sized directory nobody would find."""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import re
import secrets
import shutil
import socket

logger = logging.getLogger("lmjax")

_OUR_TMP = re.compile(r"(?P<host>[^-]*)-(?P<pid>[0-9]+)-[0-9a-f]{8}")
_OLD_TMP = re.compile(r"[a-z0-9_]{8}")  # tempfile.mkdtemp's suffix: an older lmjax's, owner unknown
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())  # no "-": it separates the name's fields


def _prefix(out: str, kind: str) -> str:
    return f".{os.path.basename(out)}.{kind}-"


def make_tmp(out: str, kind: str = "tmp") -> str:
    """A new `.OUT.<kind>-HOST-PID-RANDOM` beside OUT (owner and pid: `sweep_stale` deals with it once that
    process is gone). `os.mkdir`, not `tempfile.mkdtemp`: OUT gets the mode (process umask) of any
    directory, not mkdtemp's 0700."""
    while True:
        path = os.path.join(os.path.dirname(out), f"{_prefix(out, kind)}{_host()}-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue


def sweep_stale(out: str) -> None:
    """Deal with what dead conversions of OUT on this host left behind (a SIGKILL runs no cleanup): an old
    conversion moved aside goes back to OUT if OUT is missing (else it is removed), a `.OUT.tmp-*` is
    removed. One whose process still runs is in use; one of another host (a shared filesystem) cannot be
    checked: both stay."""
    for kind in ("old", "tmp"):  # old ones first: one may be what OUT should be again
        for path in _dead(out, kind):
            aside = os.path.join(path, "x")
            if kind == "old" and not os.path.exists(out) and os.path.isdir(aside):
                logger.warning("%s is missing: putting back the conversion an interrupted --overwrite moved "
                               "aside to %s", out, path)
                os.rename(aside, out)
            else:
                logger.warning("removing %s, left by an interrupted conversion", path)
            shutil.rmtree(path, ignore_errors=True)


def _dead(out: str, kind: str) -> list[str]:
    """The `.OUT.<kind>-*` directories of dead processes of this host."""
    parent, prefix, found = os.path.dirname(out), _prefix(out, kind), []
    for name in sorted(os.listdir(parent)):
        if not name.startswith(prefix):
            continue
        path, match = os.path.join(parent, name), _OUR_TMP.fullmatch(name[len(prefix):])
        if match is None:
            if _OLD_TMP.fullmatch(name[len(prefix):]):
                logger.warning("%s may be left by an interrupted conversion (its name gives no owner): remove "
                               "it if no conversion of %s runs", path, out)
        elif match["host"] == _host() and not _alive(int(match["pid"])):
            found.append(path)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only whether it exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def commit(tmp: str, out: str) -> None:
    """Put the finished conversion `tmp` at OUT; an older OUT goes only once the new one is in place."""
    if not os.path.exists(out):
        os.rename(tmp, out)
    elif exchange(tmp, out):
        shutil.rmtree(tmp, ignore_errors=True)  # (now the old conversion; a kill here leaves a dead .tmp-)
    else:
        old = make_tmp(out, "old")
        os.rename(out, os.path.join(old, "x"))
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)


def exchange(a: str, b: str) -> bool:
    """Swap two paths atomically (Linux renameat2); False where the kernel, C library or filesystem cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"cannot exchange {a} and {b}: {os.strerror(err)}")
