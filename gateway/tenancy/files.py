"""The data directory holds every tenant's prompts and answers: owner-only, 0700 folders, 0600 files.

SQLite creates its -wal and -shm files with the database file's own mode, so creating the database
file 0600 first keeps all three private; the KV tier creates its segment files 0600 itself.
"""

from __future__ import annotations

import os
from pathlib import Path

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def private_dir(path: Path) -> Path:
    path = Path(path)
    path.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    os.chmod(path, PRIVATE_DIR_MODE)  # an existing folder keeps its old mode otherwise
    return path


def private_file(path: Path) -> Path:
    """Create `path` empty with mode 0600 if it is missing, else tighten its mode to 0600."""
    path = Path(path)
    private_dir(path.parent)
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, PRIVATE_FILE_MODE))
    os.chmod(path, PRIVATE_FILE_MODE)
    return path
