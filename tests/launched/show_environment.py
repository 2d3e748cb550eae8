"""Write what a launched process sees to <OUT>.rank<RANK>.json (rank 0 without a world): its arguments, working
directory, first import path, environment, the settings torch reads from the environment at its import and its
threads (tests/test_launch.py compares `accelerate launch` with the warm launcher, whose processes were forked after
that import).

usage: show_environment.py OUT [ARG ...]
"""

import json
import os
import sys

record = {"argv": sys.argv[2:], "cwd": os.getcwd(), "path0": sys.path[0], "env": dict(os.environ)}

import torch  # noqa: E402  (after the environment is read: its import sets TORCHINDUCTOR_CACHE_DIR)
import torch._dynamo.config  # noqa: E402

record["dynamo_backend_override"] = torch._dynamo.config.debug_backend_override
record["threads"] = torch.get_num_threads()
with open(f"{sys.argv[1]}.rank{os.environ.get('RANK', '0')}.json", "w") as handle:
    json.dump(record, handle)
