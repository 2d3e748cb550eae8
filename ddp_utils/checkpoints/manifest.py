"""What makes a checkpoint complete (`list_checkpoints`: its directory holds trainer_state.json) and
its manifest: every file it holds, with its size and checksum, written when the
checkpoint is saved and checked before it is loaded, so a damaged checkpoint (a copy cut short, a
bit flipped on disk or in a copy, a file system fault) is found before anything is loaded from it.

Built for checkpoints of 100 GB, where reading every byte on one process takes minutes:

- at a save, each rank hashes the files it wrote itself (`written_by`), from the page cache, while
  a second thread flushes them to disk (`hash_and_flush`): the hash, several GB/s, hides behind
  the flush, which the save needs anyway, and no rank hashes another's files;
- at a resume, the sizes are checked at once (`size_problem`), and the checksums by all ranks in
  parallel, each reading its share of the bytes (`share_of`, `checksum_problem`); the load then
  finds most of what it reads in the page cache.

Nothing here communicates: `checkpoint_save.save_checkpoint` and
`checkpoint_load.find_resume_checkpoint` gather what the ranks found.
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

from accelerate.logging import get_logger

logger = get_logger(__name__)

MANIFEST_FILE = "manifest.json"
STATE_FILE = "trainer_state.json"  # the run's progress, written last: a checkpoint without it is incomplete
CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")
_CHUNK = 8 * 2**20
# The files Accelerate's `save_state` writes on each rank carry the rank in their names: its RNG states
# (random_states_<rank>.pkl), FSDP's sharded state (__<rank>_<n>.distcp, or pytorch_model_fsdp_rank<rank>.bin for a
# local state dict), DeepSpeed ZeRO's partitions (zero_pp_rank_<rank>_...). The main process writes the others but
# scaler.pt, which every rank writes with the same bytes; the main process hashes it once all have.
_RANK_IN_NAME = re.compile(r"(?:^|/)(?:random_states_|__|(?:\w+_)?zero_pp_rank_|\w*_rank)(\d+)[_.]")


def written_by(relative: str, world_size: int) -> int | None:
    """The rank whose name the checkpoint file at `relative` (a path inside the checkpoint)
    carries, modulo `world_size` (a checkpoint of more ranks, resumed on fewer), or None: a file of
    the main process, or of every rank."""
    match = _RANK_IN_NAME.search(relative)
    return int(match.group(1)) % world_size if match else None


def checkpoint_files(directory: str) -> list[str]:
    """Every file under `directory` but the manifest, as paths relative to it, sorted."""
    found = []
    for root, _, names in os.walk(directory):
        found += [os.path.relpath(os.path.join(root, name), directory) for name in names]
    return sorted(name for name in found if name != MANIFEST_FILE)


def list_checkpoints(output_dir: str) -> list[str]:
    """Complete checkpoints in `output_dir`, oldest first (temporary directories are ignored)."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = CHECKPOINT_NAME.match(name)
        if match and os.path.isfile(os.path.join(output_dir, name, STATE_FILE)):
            found.append((int(match.group(1)), os.path.join(output_dir, name)))
    return [path for _, path in sorted(found)]


def _checksum(path: str) -> str:
    """XXH3-128 of the file (xxhash comes with `datasets`): 11 to 15 GiB/s here from the page cache
    (bench/bench_manifest.py), where SHA-256 would be several times slower. Reads into one buffer,
    so a large file costs no memory."""
    import xxhash

    digest, buffer = xxhash.xxh3_128(), bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while read := handle.readinto(buffer):
            digest.update(view[:read])
    return digest.hexdigest()


def _flush(paths: list[str]) -> None:
    for path in paths:
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def hash_and_flush(directory: str, relatives: list[str]) -> dict[str, dict]:
    """{relative: {"bytes", "xxh3_128"}} for the files of `directory` at `relatives` (those this
    rank wrote), hashed in this thread while another flushes them to disk (fsync releases the GIL,
    and the hash reads what the write left in the page cache). Returns once both are done."""
    paths = [os.path.join(directory, relative) for relative in relatives]
    with ThreadPoolExecutor(max_workers=1) as flusher:
        flushing = flusher.submit(_flush, paths)
        entries = {
            relative: {"bytes": os.path.getsize(path), "xxh3_128": _checksum(path)}
            for relative, path in zip(relatives, paths)
        }
        flushing.result()
    return entries


def write_manifest(directory: str, entries: dict[str, dict]) -> None:
    """Write `directory`/manifest.json from every rank's `hash_and_flush` entries, flushed to disk.
    The main process calls it once every file is written. A file that no rank hashed (a name
    `written_by` does not know) is hashed here, with a warning, rather than left out of the check."""
    unlisted = sorted(set(checkpoint_files(directory)) - set(entries))
    if unlisted:
        logger.warning(f"no rank hashed the checkpoint's files {unlisted}: the main process does")
        entries = {**entries, **hash_and_flush(directory, unlisted)}
    path = os.path.join(directory, MANIFEST_FILE)
    with open(path, "w") as handle:
        json.dump({"files": dict(sorted(entries.items()))}, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())


def read_manifest(directory: str) -> tuple[dict | None, str | None]:
    """(the manifest's files, None), or (None, None) for a checkpoint saved before manifests
    existed (it is loaded as before), or (None, the problem) when it cannot be read."""
    path = os.path.join(directory, MANIFEST_FILE)
    if not os.path.isfile(path):
        return None, None
    try:
        with open(path) as handle:
            files = json.load(handle)["files"]
        for entry in files.values():  # the manifest itself damaged: an entry without its size or checksum
            if not (isinstance(entry["bytes"], int) and isinstance(entry["xxh3_128"], str)):
                raise ValueError(entry)
        return files, None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return None, f"its {MANIFEST_FILE} cannot be read ({type(exc).__name__})"


def size_problem(directory: str, files: dict) -> str | None:
    """A file of the manifest that is missing, or of another size (a copy cut short), or None.
    Reads the file system's metadata only: instant at any size."""
    for relative, expected in files.items():
        path = os.path.join(directory, relative)
        if not os.path.isfile(path):
            return f"{relative} is missing"
        size = os.path.getsize(path)
        if size != expected["bytes"]:
            return f"{relative} holds {size:,} bytes, {expected['bytes']:,} were written"
    return None


def share_of(files: dict, rank: int, world_size: int) -> dict:
    """Rank `rank`'s share of the manifest's `files` to checksum at a resume: the files that carry
    a rank's name go to that rank (under FSDP and DeepSpeed, the shards it loads itself, so on its
    own node), and the others one by one, largest first, to the rank with the fewest bytes so far,
    so the ranks read about as much each. The same on every rank (it depends on the manifest only)."""
    loads, owner = [0] * world_size, {}
    for relative, entry in files.items():
        writer = written_by(relative, world_size)
        if writer is not None:
            owner[relative] = writer
            loads[writer] += entry["bytes"]
    shared = [(relative, entry) for relative, entry in files.items() if relative not in owner]
    for relative, entry in sorted(shared, key=lambda item: (-item[1]["bytes"], item[0])):
        least = min(range(world_size), key=lambda r: (loads[r], r))
        owner[relative] = least
        loads[least] += entry["bytes"]
    return {relative: entry for relative, entry in files.items() if owner[relative] == rank}


def checksum_problem(directory: str, files: dict) -> str | None:
    """The first of `files` whose checksum differs from the manifest's (bit rot, a bad copy: damage
    that keeps the size), or None. Reads every byte of them."""
    for relative, expected in sorted(files.items()):
        if _checksum(os.path.join(directory, relative)) != expected["xxh3_128"]:
            return f"{relative} has changed since it was written (its checksum differs)"
    return None


def checkpoint_problem(directory: str) -> str | None:
    """What is wrong with the checkpoint in `directory`, checked on this process alone against its
    manifest (a file missing, of another size, or with another checksum), or None when it checks
    out or has no manifest. For tools and tests; a run checks on all its ranks at once
    (`checkpoint_load.verify_checkpoint`)."""
    files, problem = read_manifest(directory)
    if files is None:
        return problem
    return size_problem(directory, files) or checksum_problem(directory, files)
