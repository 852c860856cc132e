"""The files of a node device ledger, opened as outside input.

A ledger directory is shared by every engine of this user on the host, so what is in it was
written by other processes: any of them may have been killed half way, and anything that can
write there can plant a file. The rules here keep such a file from hanging or crashing a rank:

- the directory is created 0700 and, when it exists already, must be a real directory (not a
  symlink) of this user that nobody else can write to; otherwise `LedgerError` says which and
  what to do (the operator picks it with OMNI_CORE_DEVICE_LEDGER_DIR);
- a file is opened without following symlinks and without blocking (a FIFO planted under a
  holder's name would block a plain open forever), and used only when it is a regular file;
- what a file says is read up to a cap and shown only as printable text.
"""

from __future__ import annotations

import os
import stat

# The operator's choice of where the node's device ledgers live (a directory per device under it).
ENV_LEDGER_DIR = "OMNI_CORE_DEVICE_LEDGER_DIR"
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class LedgerError(RuntimeError):
    """The ledger's directory or one of its files cannot be trusted; nothing was changed."""


def secure_directory(path: str) -> None:
    """Create `path` (0700) or check the existing one: a directory of this user that no other
    user can write to, so no one else can plant holdings in it or hold its lock."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError as err:
        raise LedgerError(
            f"cannot use the device ledger directory {path!r} ({err.strerror or err}); set "
            f"{ENV_LEDGER_DIR} to a directory of yours, or fix its parent's permissions"
        ) from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise LedgerError(
            f"the device ledger path {path!r} is {'a symlink' if stat.S_ISLNK(st.st_mode) else 'not a directory'}; "
            f"remove it, or set {ENV_LEDGER_DIR} to a directory of yours"
        )
    if st.st_uid != os.geteuid():
        raise LedgerError(
            f"the device ledger directory {path!r} belongs to uid {st.st_uid}, not to this user "
            f"({os.geteuid()}): another user could plant holdings in it; set {ENV_LEDGER_DIR} to a directory of yours"
        )
    if st.st_mode & 0o022:
        raise LedgerError(
            f"the device ledger directory {path!r} is writable by group or others (mode "
            f"{stat.S_IMODE(st.st_mode):o}): anyone could plant holdings or hold its lock; chmod 700 it, or set "
            f"{ENV_LEDGER_DIR} to a directory of yours"
        )


def open_regular(path: str, flags: int, mode: int = 0o600) -> int:
    """A descriptor of `path` if it is a regular file (created `mode` with O_CREAT in `flags`);
    OSError from the open (FileNotFoundError, ELOOP for a symlink), LedgerError when what is
    there is a FIFO, a device, a directory or a socket."""
    fd = os.open(path, flags | _OPEN_FLAGS, mode)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise LedgerError(f"{path!r} is not a regular file; remove it (rm {path}): omni-core makes it again")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_capped(path: str, max_bytes: int) -> bytes | None:
    """Up to `max_bytes + 1` bytes of a regular file (the caller tells an oversized one by its
    length); None when it is gone, a symlink, or not a regular file."""
    try:
        fd = open_regular(path, os.O_RDONLY)
    except (OSError, LedgerError):
        return None
    try:
        return os.read(fd, max_bytes + 1)
    except OSError:
        return None
    finally:
        os.close(fd)


def printable(raw: bytes, max_chars: int) -> str:
    """A file's words as they may appear in a message: decoded, control characters replaced."""
    text = raw.decode("utf-8", "replace")[:max_chars]
    return "".join(c if c.isprintable() else "?" for c in text).strip()
