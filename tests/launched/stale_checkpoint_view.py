"""Launched by the tests: runs scripts/train.py unchanged, but on every rank other than 0 the
output directory looks as it did one checkpoint ago, as with node-local caches or NFS attribute
caching: `list_checkpoints` there does not see the newest checkpoint. `--resume_from_checkpoint
latest` must still resume every rank from the checkpoint the main process sees.

usage: stale_checkpoint_view.py <train.py arguments>
"""

import os
import runpy
import sys

import ddp_utils.checkpoints.checkpoint_load

if os.environ.get("RANK", "0") != "0":
    fresh_list_checkpoints = ddp_utils.checkpoints.checkpoint_load.list_checkpoints
    ddp_utils.checkpoints.checkpoint_load.list_checkpoints = lambda output_dir: fresh_list_checkpoints(output_dir)[:-1]

script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "train.py")
sys.argv = [script, *sys.argv[1:]]
runpy.run_path(script, run_name="__main__")
