"""`payload.py fetch`, here with network: every wheel of WHEELS downloaded for the GPU machine's Python and
platform, or built (DeepSpeed's), into .gpu_payload/wheels."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from payload_wheels import PAYLOAD, PLATFORMS, PYTHON_VERSION, SETS, WHEELS, Wheel, last_line, wheel_file


def fetch(args) -> int:
    """Download (or build) every wheel of WHEELS (or of --sets) into .gpu_payload/wheels, saying why each is needed."""
    wheels_dir = PAYLOAD / "wheels"
    wheels_dir.mkdir(parents=True, exist_ok=True)
    failures = {}
    sets = set(args.sets.split(",")) if getattr(args, "sets", None) else set(SETS)
    for wheel in (w for w in WHEELS if sets.intersection(w.sets)):
        if wheel_file(wheels_dir, wheel):
            print(f"have  {wheel.requirement:34} {wheel.why}", flush=True)
            continue
        print(f"fetch {wheel.requirement:34} {wheel.why}", flush=True)
        error = build_deepspeed(wheel, wheels_dir) if wheel.build else download(wheel, wheels_dir)
        if error:
            failures[wheel.name] = error
            print(f"  FAILED: {error}", flush=True)
    (PAYLOAD / "fetch_failures.json").write_text(json.dumps(failures, indent=2) + "\n")
    total = sum(path.stat().st_size for path in wheels_dir.glob("*.whl"))
    print(f"{len(list(wheels_dir.glob('*.whl')))} wheels, {total / 2**20:.1f} MiB in {wheels_dir}", flush=True)
    return 1 if failures and not args.allow_failures else 0


def download(wheel: Wheel, wheels_dir: Path) -> str | None:
    """pip download of one wheel for the GPU machine's Python and platform (binary only, no dependencies)."""
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    command += ["--python-version", PYTHON_VERSION, "--implementation", "cp", "-d", str(wheels_dir)]
    command += [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    done = subprocess.run([*command, wheel.requirement], capture_output=True, text=True)
    return None if done.returncode == 0 else last_line(done.stderr or done.stdout)


def build_deepspeed(wheel: Wheel, wheels_dir: Path) -> str | None:
    """DeepSpeed ships only a source distribution; its setup.py imports torch, so it is built with this
    environment's torch (no build isolation), with no op compiled ahead (DS_BUILD_OPS=0) and CUDA named as
    its accelerator (DS_ACCELERATOR=cuda): a pure-Python wheel whose ops JIT-compile on the GPU machine."""
    env = {**os.environ, "DS_BUILD_OPS": "0", "DS_ACCELERATOR": "cuda"}
    with tempfile.TemporaryDirectory() as scratch:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary=:all:", "-d", scratch]
            + [wheel.requirement],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            return "sdist download: " + last_line(done.stderr or done.stdout)
        sdist = next(Path(scratch).glob("*.tar.gz"))
        done = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation"]
            + ["-w", str(wheels_dir), str(sdist)],
            capture_output=True,
            text=True,
            env=env,
        )
    return None if done.returncode == 0 else "build: " + last_line(done.stderr or done.stdout)
