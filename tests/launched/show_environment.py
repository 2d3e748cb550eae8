"""Write what a launched process sees to <OUT>.rank<RANK>.json: its arguments, working directory, first import
path and environment (tests/test_launch.py compares `accelerate launch` with the warm launcher).

usage: show_environment.py OUT [ARG ...]
"""

import json
import os
import sys

record = {"argv": sys.argv[2:], "cwd": os.getcwd(), "path0": sys.path[0], "env": dict(os.environ)}
with open(f"{sys.argv[1]}.rank{os.environ['RANK']}.json", "w") as handle:
    json.dump(record, handle)
