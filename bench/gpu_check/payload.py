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

This file is the command; the wheels and sets are in payload_wheels.py, each command in its module: payload_fetch.py,
payload_pack.py (with payload_float16.py), payload_install.py (receive, probe, install).
"""

from __future__ import annotations

import argparse
import sys

from payload_fetch import fetch
from payload_install import install, probe, receive
from payload_pack import pack
from payload_wheels import SETS, SITE


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
