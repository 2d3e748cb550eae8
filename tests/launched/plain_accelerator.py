"""Launched by the tests: what a hand-written script does, `Accelerator()` without cpu=True,
followed by the launch guard. On a machine without GPUs the guard must refuse it on every rank."""

from accelerate import Accelerator

import ddp_utils
from ddp_utils.lifecycle.launch_guard import check_launch


def main():
    check_launch(Accelerator())
    print("the guard let a mis-launched run through", flush=True)


if __name__ == "__main__":
    ddp_utils.run(main)
