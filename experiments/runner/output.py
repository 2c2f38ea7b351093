"""The output folder of a run, claimed before anything trains: whether it may be written
(`output_problem`), who holds it (`OutputLock`), and the one-line error for a write that
fails (`cannot_write`).

The root process claims the folder: it creates it, takes an advisory lock on the file
`LOCK` in it (``fcntl.flock``: the kernel drops it when the holder dies, so a stale lock
is taken over without a word) and writes its host and PID there, so that a second run
into the same folder is refused naming the first. The lock is released at exit.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import tempfile
import time
from pathlib import Path

LOCK = ".shoal-run.lock"


def output_problem(out: Path, resume: bool, overwrite: bool, can_resume: bool = True) -> str | None:
    """Why the run must not write into ``out`` (None: it may): a folder that is not empty
    holds an earlier run's results, which only ``--resume`` (continue them) or
    ``--overwrite`` (replace them) may touch. The lock file alone is not a result."""
    if out.exists() and not out.is_dir():
        return f"output folder {out} is a file, not a folder: choose another --out"
    if overwrite or (resume and can_resume) or not out.is_dir():
        return None
    if all(p.name == LOCK for p in out.iterdir()):
        return None
    how = "--resume to continue that run, " if can_resume else ""
    return (
        f"output folder {out} is not empty (it may hold an earlier run's results): pass "
        f"--overwrite to replace them, {how}or --out to write elsewhere"
    )


def cannot_write(folder: Path, error: OSError) -> str:
    """The one-line error for ``error``, raised writing into ``folder``."""
    what = error.strerror or str(error)
    if error.errno == errno.EFBIG:
        what += " (the file size limit, ulimit -f)"
    where = f" ({error.filename})" if error.filename else ""
    return f"cannot write to output folder {folder}: {what}{where}"


def writable_problem(folder: Path) -> str | None:
    """Why this process cannot create files in ``folder`` (made if missing), or None.
    Processes may ask at once about one folder: it is made, never removed, here."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        return cannot_write(folder, e)
    return None


def _missing(folder: Path) -> Path | None:
    """The outermost of ``folder`` and its parents that does not exist (None: it does)."""
    return next((p for p in reversed((folder, *folder.parents)) if not p.exists()), None)


def _remove_empty(folder: Path, made: Path | None) -> None:
    """Remove ``folder`` and its parents up to ``made`` (its outermost folder created here),
    innermost first, as long as they are empty."""
    if made is None:
        return
    for p in (folder, *folder.parents):
        try:
            p.rmdir()
        except OSError:
            return
        if p == made:
            return


class OutputLock:
    """An advisory lock on the output folder ``out``, naming its holder.

    `acquire` creates the folder if needed (so it also checks that it can be written)
    and returns None once the lock is held, or why it is not; `release` drops it, removes
    the lock file, and the folder too when this lock created it and nothing else was
    written there.

    Example:
      >>> import tempfile, pathlib
      >>> out = pathlib.Path(tempfile.mkdtemp()) / "run"
      >>> first, second = OutputLock(out), OutputLock(out)
      >>> first.acquire() is None, "in use by" in second.acquire()
      (True, True)
      >>> first.release(); second.acquire() is None
      True
      >>> second.release(); out.exists()
      False
    """

    def __init__(self, out: Path):
        self.out = Path(out)
        self.path = self.out / LOCK
        self._fd: int | None = None
        self._made: Path | None = None  # the outermost folder this lock created

    def acquire(self) -> str | None:
        made = _missing(self.out)
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            return cannot_write(self.out, e)
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                return cannot_write(self.out, e)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = os.read(fd, 4096).decode(errors="replace").strip() or "another process"
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    return cannot_write(self.out, e)
                return (
                    f"output folder {self.out} is in use by another shoal-run ({holder}; "
                    f"lock file {self.path}): wait for it to end, or choose another --out"
                )
            try:  # the file we locked may have been released and unlinked meanwhile
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        holder = f"host {socket.gethostname()}, pid {os.getpid()}, since {time.strftime('%c')}"
        try:
            os.ftruncate(fd, 0)
            os.write(fd, (holder + "\n").encode())
        except OSError as e:
            os.close(fd)
            return cannot_write(self.out, e)
        self._fd, self._made = fd, made
        return None

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            pass  # a read-only folder by now: the lock itself goes with the descriptor
        os.close(self._fd)
        self._fd = None
        _remove_empty(self.out, self._made)  # what this lock created, if nothing was written
