"""Launched by the tests: only the last rank finds a problem (as when only the main process holds
the weights a check needs, or the other way round); `ddp_utils.refuse_together` must make every
rank report it and stop, none left waiting in the next collective.

usage: refuse_on_one_rank.py
"""

import ddp_utils


def main():
    accelerator = ddp_utils.make_accelerator(seed=0, ddp_timeout=20)
    last = accelerator.process_index == accelerator.num_processes - 1
    ddp_utils.refuse_together(accelerator, f"rank {accelerator.process_index} found a problem" if last else None)
    accelerator.wait_for_everyone()
    print("a rank went on past the refusal", flush=True)


if __name__ == "__main__":
    ddp_utils.run(main)
