"""Files written by the main process only, atomically: a reader sees a complete file or none. Any rank
may call these; the others do nothing. No communication."""

from __future__ import annotations

import json
import os
import tempfile

from accelerate import Accelerator


def write_json(accelerator: Accelerator, path: str, data) -> None:
    """Write `data` as JSON, on the main process only, atomically (a complete file or none).
    Any rank may call it; the others do nothing."""
    _write_text_on_main(accelerator, path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_jsonl(accelerator: Accelerator, path: str, rows: list[dict]) -> None:
    """Write `rows` one JSON object per line, on the main process only, atomically. Any rank may
    call it; the others do nothing."""
    _write_text_on_main(accelerator, path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def _write_text_on_main(accelerator: Accelerator, path: str, text: str) -> None:
    """Write `text` to `path` on the main process only, through a temporary file in the same
    directory and a rename, so readers see a complete file or none."""
    if not accelerator.is_main_process:
        return
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=directory, suffix=".tmp", delete=False) as handle:
        handle.write(text)
    os.replace(handle.name, path)


def existing_parent(path: str) -> str:
    """`path`, or its nearest existing parent."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path
