"""Small things every part of the checklist uses: the error line of a failed run, JSON files read and written, a
safetensors header, the time, a free port, numbers formatted for the tables, ratios, the compile counts' names."""

from __future__ import annotations

import json
import os
import re
import socket
import time
from pathlib import Path

from checklist_steps import REPO


def error_line(text: str, rc: int | None) -> str:
    """The line that says why a run failed: our scripts' one-line error ("[rank 0] error: ..."), else the
    last exception line of a traceback but the launcher's own, else the last line printed."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if re.search(r"\berror: ", line) and line.startswith("[rank"):
            return line[:400]
    launchers = ("ChildFailedError", "CalledProcessError")  # torchrun's and the simple launcher's, after the script's
    for line in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception|Interrupt|Exit)\b.*", line) and not any(n in line for n in launchers):
            return line[:400]
    return (f"exit {rc}: " if rc else "") + (lines[-1][:400] if lines else "no output")


def safetensors_header(data: bytes) -> tuple[dict, int]:
    """A safetensors file's JSON header, read from its first bytes with the standard library (an 8-byte little-endian
    length, then the header), and the offset where its tensors' data begins."""
    end = 8 + int.from_bytes(data[:8], "little")
    return json.loads(data[8:end]), end


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def read_jsonl(path: Path) -> list[dict]:
    path = Path(path)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


def f(value, digits: int) -> str:
    if value is None:
        return "-"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:,.{digits}f}"
    return str(value)


def none_low(value):
    return -1 if value is None else value


def ratio(row: dict, base: dict | None, key: str) -> str:
    return f(row[key] / base[key], 3) if base and base.get(key) else "-"


def compile_count_names() -> tuple:
    """ddp_utils' compile counts (`compilation.COUNTS`), read from their file: the runner imports only the standard
    library, and on the GPU machine neither the package (not on this process's path) nor torch is importable here."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("compilation", REPO / "ddp_utils" / "training" / "compilation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.COUNTS


def ratio_of(a, b):
    return a / b if a is not None and b else None
