"""Write what a launched process sees to <OUT>.rank<RANK>.json: its arguments, working directory, first import
path, environment, and the settings torch reads from the environment at its import (tests/test_launch.py compares
`accelerate launch` with the warm launcher, whose processes were forked after that import).

usage: show_environment.py OUT [ARG ...]
"""

import json
import os
import sys

record = {"argv": sys.argv[2:], "cwd": os.getcwd(), "path0": sys.path[0], "env": dict(os.environ)}

import torch._dynamo.config  # noqa: E402  (after the environment is read: its import sets TORCHINDUCTOR_CACHE_DIR)

record["dynamo_backend_override"] = torch._dynamo.config.debug_backend_override
with open(f"{sys.argv[1]}.rank{os.environ['RANK']}.json", "w") as handle:
    json.dump(record, handle)
