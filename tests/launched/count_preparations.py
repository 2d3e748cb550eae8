"""Launched by the tests: runs scripts/train.py unchanged, but every function given to
`datasets.Dataset.map` appends this rank's number to $PREPARED_LOG.rank<RANK> when it really runs
(a cache miss), so a test can tell which ranks prepared the data and which read a cache.

usage: count_preparations.py <train.py arguments>
"""

import functools
import os
import runpy
import sys

import datasets

original_map = datasets.Dataset.map


def counted(function):
    @functools.wraps(function)
    def run(*args, **kwargs):
        # The path is read when it runs: a value captured here would differ per rank, and so would the
        # function's fingerprint, which names the cache.
        with open(f"{os.environ['PREPARED_LOG']}.rank{os.environ.get('RANK', '0')}", "a") as handle:
            handle.write(f"{function.__name__}\n")
        return function(*args, **kwargs)

    return run


def map_counted(self, function=None, *args, **kwargs):
    return original_map(self, counted(function) if function is not None else None, *args, **kwargs)


datasets.Dataset.map = map_counted
script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "train.py")
sys.argv = [script, *sys.argv[1:]]
runpy.run_path(script, run_name="__main__")
