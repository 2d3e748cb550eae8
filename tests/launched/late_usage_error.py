"""Launched by the tests: after the ranks have met, every rank finds the same bad input, but rank
1 finds it 3 s later than rank 0 (it was still loading its data, say). Each rank must still report
it: the launcher stops every rank once the first one exits.

usage: late_usage_error.py
"""

import time

import ddp_utils


def main():
    accelerator = ddp_utils.make_accelerator(seed=0, ddp_timeout=30)
    if accelerator.process_index == 1:
        time.sleep(3)
    raise ddp_utils.UsageError("the same bad input, found by each rank on its own")


if __name__ == "__main__":
    ddp_utils.run(main)
