"""Launched by the tests: runs scripts/train.py unchanged, with the Hub client's HfApi replaced by
a recorder that writes every call to $HUB_CALLS.rank<RANK> (JSON lines) and the files it was asked
to upload, so --push_to_hub can be tested up to the network call. The Hub is "online" and a token
is set for the run, as a user's would be.

usage: fake_hub.py <train.py arguments>
"""

import json
import os
import runpy
import sys

os.environ["HF_HUB_OFFLINE"] = "0"  # read by huggingface_hub when imported, below
os.environ.setdefault("HF_TOKEN", "hf_FakeTokenForTheTests0001")

import huggingface_hub  # noqa: E402
from huggingface_hub.utils import filter_repo_objects  # noqa: E402


def record(call: dict) -> None:
    with open(f"{os.environ['HUB_CALLS']}.rank{os.environ.get('RANK', '0')}", "a") as handle:
        handle.write(json.dumps(call) + "\n")


class RecordingHfApi:
    def create_repo(self, repo_id, private=False, exist_ok=False, **kwargs):
        record({"call": "create_repo", "repo_id": repo_id, "private": private, "exist_ok": exist_ok})
        return huggingface_hub.RepoUrl(f"https://huggingface.co/{repo_id}")

    def upload_folder(self, repo_id, folder_path, ignore_patterns=None, **kwargs):
        files = sorted(
            os.path.relpath(os.path.join(root, name), folder_path)
            for root, _, names in os.walk(folder_path)
            for name in names
        )
        uploaded = sorted(filter_repo_objects(files, ignore_patterns=ignore_patterns))
        contents = {name: open(os.path.join(folder_path, name), "rb").read().decode("latin-1") for name in uploaded}
        record(
            {
                "call": "upload_folder",
                "repo_id": repo_id,
                "files": uploaded,
                "token_in_files": any(os.environ["HF_TOKEN"] in text for text in contents.values()),
            }
        )


huggingface_hub.HfApi = RecordingHfApi
script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "train.py")
sys.argv = [script, *sys.argv[1:]]
runpy.run_path(script, run_name="__main__")
