"""`pip install .` (not editable) gives a package that runs the scripts from anywhere: the local
metrics and the demo models' configs travel inside it."""

import json
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

from conftest import REPO, launch_env


def test_a_non_editable_install_runs_the_scripts_from_outside_the_repository(tmp_path):
    # A fresh virtual environment that sees this one's packages (torch, transformers, ...) through a
    # plain path entry, which adds none of their .pth hooks: not the editable install of ddp_utils.
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    site = subprocess.check_output(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
    )
    Path(site.strip(), "project_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # The wheel is built with this environment's setuptools (a fresh venv's is too old to build one), offline.
    quiet = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    build = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", tmp_path, REPO]
    built = subprocess.run(build, capture_output=True, text=True, timeout=300, env=quiet)
    assert built.returncode == 0, built.stderr[-3000:]
    wheel = next(tmp_path.glob("ddp_finetune-*.whl"))
    install = subprocess.run(
        [python, "-m", "pip", "install", "--quiet", "--no-deps", "--force-reinstall", wheel],
        capture_output=True,
        text=True,
        timeout=300,
        env=quiet,
    )
    assert install.returncode == 0, install.stderr[-3000:]

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = launch_env()
    env.pop("PYTHONPATH")  # nothing of the repository on the path: only what was installed
    check = [python, "-c", "import ddp_utils; print(ddp_utils.__file__)"]
    where = subprocess.run(check, cwd=outside, env=env, capture_output=True, text=True, timeout=120)
    assert where.stdout.startswith(str(env_dir)), where.stdout + where.stderr

    for script, samples in (("train.py", "64"), ("train_image.py", "64")):  # their offline demos: metrics and a config
        output_dir = outside / script.removesuffix(".py")
        command = [python, REPO / "scripts" / script, "--output_dir", output_dir, "--max_train_steps", "1"]
        command += ["--max_train_samples", samples, "--max_eval_samples", "16", "--checkpointing_steps", "no"]
        run = subprocess.run(command, cwd=outside, env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, f"{script}:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
        metrics = json.loads((output_dir / "metrics.json").read_text())
        assert metrics["optimizer_steps"] == 1 and 0 <= metrics["eval_accuracy"] <= 1, script
