#!/usr/bin/env python
"""What attention_shapes/sitecustomize.py logged, per process: each optimizer step's training-pass shape (its first
attention call's query: batch, heads, length, head width), how many different ones the run took, and in which of
the profiled steps (4 to 8, as bench/step_profile profiles them) a shape was new.

    python bench/attention_shapes/lengths.py outputs/shapes
"""

import json
import sys
from pathlib import Path


def step_shapes(path: Path) -> list:
    """Each step's first attention call's query shape, in step order."""
    first = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        first.setdefault(record["step"], tuple(record["query"]))
    return [first[step] for step in sorted(first)]


def main():
    if len(sys.argv) != 2:
        raise SystemExit("usage: python bench/attention_shapes/lengths.py ATTENTION_SHAPES_DIR")
    for path in sorted(Path(sys.argv[1]).glob("shapes-*.jsonl")):
        shapes = step_shapes(path)
        new = [step for step in range(4, 9) if step <= len(shapes) and shapes[step - 1] not in shapes[: step - 1]]
        print(f"{path.name}: {len(shapes)} steps, {len(set(shapes))} different shapes; new in profiled steps {new}")
        print("  " + ", ".join("x".join(map(str, shape)) for shape in shapes))


if __name__ == "__main__":
    main()
