"""A checkpoint's manifest: every file it holds, with its size and checksum, written when the
checkpoint is saved and checked before it is loaded, so a damaged checkpoint (a copy cut short, a
file system fault) is found before anything is loaded from it. Nothing here communicates."""

from __future__ import annotations

import json
import os

MANIFEST_FILE = "manifest.json"
_CHUNK = 8 * 2**20


def _checksum(path: str) -> str:
    """XXH3-128 of the file (xxhash comes with `datasets`): several GB/s, so a large checkpoint is
    checked in seconds, where SHA-256 would take minutes."""
    import xxhash

    digest = xxhash.xxh3_128()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(directory: str) -> None:
    """Write `directory`/manifest.json: each file under it (relative path) with its size in bytes
    and its XXH3-128 checksum. One process calls it, once every file is written."""
    files = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            relative = os.path.relpath(path, directory)
            if relative != MANIFEST_FILE:
                files[relative] = {"bytes": os.path.getsize(path), "xxh3_128": _checksum(path)}
    with open(os.path.join(directory, MANIFEST_FILE), "w") as handle:
        json.dump({"files": dict(sorted(files.items()))}, handle, indent=1)


def checkpoint_problem(directory: str) -> str | None:
    """What is wrong with the checkpoint in `directory`, checked against its manifest (a file
    missing, of another size, or with another checksum), or None when it checks out. A checkpoint
    saved before manifests existed has none: None (it is loaded as before)."""
    path = os.path.join(directory, MANIFEST_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as handle:
            files = json.load(handle)["files"]
    except (OSError, ValueError, KeyError) as exc:
        return f"its {MANIFEST_FILE} cannot be read ({type(exc).__name__})"
    for relative, expected in files.items():
        file = os.path.join(directory, relative)
        if not os.path.isfile(file):
            return f"{relative} is missing"
        size = os.path.getsize(file)
        if size != expected["bytes"]:
            return f"{relative} holds {size:,} bytes, {expected['bytes']:,} were written"
        if _checksum(file) != expected["xxh3_128"]:
            return f"{relative} has changed since it was written (its checksum differs)"
    return None
