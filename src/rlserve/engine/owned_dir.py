"""Private directories in the temp dir that a server killed outright cannot leave behind for
long: their owner holds a lock on a file in each while it lives (the kernel drops it when the
owner dies, however it dies), and making a directory of a kind first removes this user's
directories of that kind that nobody holds."""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

OWNER_LOCK = ".owner"
# A directory younger than this may be one whose owner has not locked it yet.
ABANDONED_AFTER_S = 60.0


class OwnedDir:
    """A directory `prefix`* in the temp dir only this user can enter (mkdtemp: mode 0700),
    locked while this object lives; `remove()` deletes it with everything in it."""

    def __init__(self, prefix: str) -> None:
        remove_abandoned(prefix)
        self.path = Path(tempfile.mkdtemp(prefix=prefix))
        self._lock: int | None = os.open(self.path / OWNER_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX)

    def remove(self) -> None:
        """Idempotent."""
        shutil.rmtree(self.path, ignore_errors=True)
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


def remove_abandoned(prefix: str) -> list[Path]:
    """Remove this user's `prefix`* directories in the temp dir that no process holds (their
    owner was killed outright); returns them. A directory whose lock is held, that is younger
    than a minute, that has no lock file, or that is not a plain directory of this user is
    left alone."""
    removed = []
    for path in Path(tempfile.gettempdir()).glob(prefix + "*"):
        try:
            st = os.lstat(path)
            if (
                not stat.S_ISDIR(st.st_mode)
                or st.st_uid != os.geteuid()
                or time.time() - st.st_mtime < ABANDONED_AFTER_S
            ):
                continue
            fd = os.open(path / OWNER_LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its owner lives
            os.close(fd)
            continue
        try:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(fd)
    return removed
