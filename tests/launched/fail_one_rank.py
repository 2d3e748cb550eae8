"""Launched by the tests: rank 1 fails (MODE=raise) or hangs (MODE=stuck) while rank 0 waits in a
collective. The launch must end non-zero within the --ddp_timeout, with the error visible.

usage: fail_one_rank.py MODE DDP_TIMEOUT_S
"""

import sys
import time

import ddp_utils
from ddp_utils.lifecycle.start import make_accelerator


def main():
    mode, timeout = sys.argv[1], int(sys.argv[2])
    accelerator = make_accelerator(seed=0, ddp_timeout=timeout)
    if accelerator.process_index == 1:
        if mode == "raise":
            raise ValueError("boom on rank 1")
        time.sleep(3600)  # stuck: never reaches the collective
    accelerator.wait_for_everyone()
    print("rank 0 passed the barrier", flush=True)


if __name__ == "__main__":
    ddp_utils.run(main)
