"""A model carried in float16 to fit one device call: `pack` copies its wheel with the float32 tensors in float16
(`half_wheel`), `install` makes them float32 again (`restore_float32`). Needs numpy and safetensors."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

from checklist_util import safetensors_header
from payload_wheels import HALF_KEY


def safetensors_metadata(data: bytes) -> dict:
    """The __metadata__ of a safetensors file, from its first bytes."""
    return safetensors_header(data)[0].get("__metadata__") or {}


def half_wheel(path: Path, out_dir: Path) -> tuple[Path, dict]:
    """A copy of the wheel `path` whose safetensors files hold their float32 tensors as float16, named in the
    file's metadata (HALF_KEY) for `install` to make float32 again; its RECORD updated. Returns the copy and
    what the rounding changed (largest relative error of a weight of magnitude at least float16's smallest
    normal number, and largest absolute one)."""
    import numpy as np
    from safetensors.numpy import load, save

    out_dir.mkdir(parents=True, exist_ok=True)
    copy, changed, report = out_dir / path.name, {}, {"files": [], "tensors": 0, "max_rel_error": 0.0}
    report["max_abs_error"] = 0.0
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(copy, "w", zipfile.ZIP_DEFLATED) as target:
        for info in source.infolist():
            data = source.read(info)
            if info.filename.endswith(".safetensors"):
                metadata, tensors = safetensors_metadata(data), load(data)
                names = sorted(k for k, v in tensors.items() if v.dtype == np.float32)
                for key in names:
                    weight = tensors[key]
                    rounded = weight.astype(np.float16)
                    error = np.abs(rounded.astype(np.float32) - weight)
                    normal = np.abs(weight) >= np.finfo(np.float16).tiny
                    if error.size:
                        report["max_abs_error"] = max(report["max_abs_error"], float(error.max()))
                    if normal.any():
                        relative = float((error[normal] / np.abs(weight[normal])).max())
                        report["max_rel_error"] = max(report["max_rel_error"], relative)
                    tensors[key] = rounded
                data = save(tensors, metadata={**metadata, HALF_KEY: ",".join(names)})
                changed[info.filename] = data
                report["files"].append(info.filename)
                report["tensors"] += len(names)
            elif info.filename.endswith(".dist-info/RECORD"):
                continue  # written last, with the new hashes
            target.writestr(info, data)
        record = [info.filename for info in source.infolist() if info.filename.endswith(".dist-info/RECORD")][0]
        lines = []
        for line in source.read(record).decode().splitlines():
            name = line.split(",")[0]
            if name in changed:
                digest = base64.urlsafe_b64encode(hashlib.sha256(changed[name]).digest()).rstrip(b"=").decode()
                line = f"{name},sha256={digest},{len(changed[name])}"
            lines.append(line)
        target.writestr(source.getinfo(record), "\n".join(lines) + "\n")
    return copy, report


def restore_float32(path: Path) -> None:
    """The tensors a `half` wheel carried in float16 (named in the file's metadata) back in float32."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    with open(path, "rb") as handle:
        head = handle.read(8)
        metadata = safetensors_metadata(head + handle.read(int.from_bytes(head, "little")))
    names = [name for name in metadata.pop(HALF_KEY, "").split(",") if name]
    tensors = load_file(path)
    for name in names:
        tensors[name] = tensors[name].astype(np.float32)
    save_file(tensors, path, metadata=metadata)
