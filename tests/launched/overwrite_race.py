"""Launched by the tests: both ranks call ddp_utils.prepare_output_dir with overwrite on a
directory that holds an earlier run, with the race widened: rank 0 waits 0.5 s before deleting it
and 1.5 s before creating it again; on the other ranks, listing a directory takes 1 s. A rank that
checks the directory itself (isdir, then listdir) lists it while it does not exist.

usage: overwrite_race.py OUTPUT_DIR
"""

import os
import shutil
import sys
import time

import ddp_utils


def main():
    output_dir = sys.argv[1]
    accelerator = ddp_utils.make_accelerator(seed=0, ddp_timeout=30)
    if accelerator.is_main_process:
        real_rmtree = shutil.rmtree

        def slow_rmtree(path, *args, **kwargs):
            time.sleep(0.5)
            real_rmtree(path, *args, **kwargs)
            time.sleep(1.5)

        shutil.rmtree = slow_rmtree
    else:
        real_listdir = os.listdir

        def slow_listdir(path="."):
            time.sleep(1.0)
            return real_listdir(path)

        os.listdir = slow_listdir
    ddp_utils.prepare_output_dir(accelerator, output_dir, overwrite=True)
    assert os.path.isdir(output_dir) and not os.listdir(output_dir), "an empty output directory on every rank"
    print(f"rank {accelerator.process_index}: output directory ready", flush=True)


if __name__ == "__main__":
    ddp_utils.run(main)
