"""Durable file replacement, for everything a node keeps across crashes.

A file written in place can be left half-written by a crash. Writing a
temporary file, flushing it to disk, renaming it over the old one and then
flushing the directory (which holds the rename) leaves either the old or the
new content after any crash, never a mix.
"""

from __future__ import annotations

import os
from pathlib import Path


def replace_durably(tmp: Path, path: Path) -> None:
    """Flush the finished file `tmp` to disk and atomically rename it to `path`."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
