"""A local stand-in for the Hugging Face Hub HTTP API: the real `huggingface_hub` client talks to it when
HF_ENDPOINT points at it, and it records what was uploaded to files under a record directory, so a test can
prove which files `HfApi().create_repo(...)` + `HfApi().create_commit(...)` (or `upload_folder`) sent, from any
process, and what each repository holds afterwards.

Endpoints answered (anything else is a 404, and is logged like every request):
  POST /api/repos/create                          creates the repo with a .gitattributes, as the Hub does (409 with
                                                  its url when it exists; an existing repo keeps its visibility)
  POST /api/{type}s/{ns}/{name}/preupload/{rev}   every file "regular": contents come inline, base64, in the commit;
                                                  "oid" is the git blob id of the file the repo holds at that path
  POST /api/{type}s/{ns}/{name}/commit/{rev}      the NDJSON commit, recorded as commit-NNNN.json, applied to the repo:
                                                  files added, deletedFile / deletedFolder removed (404 EntryNotFound
                                                  for a path it does not hold); 412 when its parentCommit is not the
                                                  head
  PUT  /api/{type}s/{ns}/{name}/settings          {"visibility": "private" | "public"} (or {"private": bool}, older
                                                  clients): changes the repo's visibility (`settings_fail_with` refuses)
  POST /api/validate-yaml                         a README.md's metadata, always valid
  GET  /api/whoami-v2                             user "standin-user" (401 without a token)
  GET  /api/agent-harnesses                       an empty registry (the client's user-agent telemetry asks for it)
  GET  /api/{type}s/{ns}/{name}[/revision/{rev}]  repo info with its files as "siblings" (404 for a repo never created,
                                                  or a private one asked without a token, as the Hub answers)
  GET  /api/{type}s/{ns}/{name}/tree/{rev}[/{path}][?recursive=true]  the files and folders at a revision (the head or
                                                  an earlier commit's oid), in one page
No LFS or Xet endpoint: the preupload answer keeps every file out of those paths, with or without hf_xet.

Client environment: HF_ENDPOINT=<hub.endpoint>, HF_TOKEN=hf_<anything>, HF_HUB_OFFLINE=0 (set, or unset: with
HF_HUB_OFFLINE=1 the client refuses to connect). HF_HUB_DISABLE_XET=1 is optional but recommended: with hf_xet
installed, upload_folder uses its pipelined path, which retries a failed commit 5 times (~25 s for fail_with=500);
without xet it is one create_commit and one commit POST, failing at once.

In a test (the server runs in the test process; the uploader may be a subprocess):
    with HubStandIn(tmp_path / "hub", fail_with=None, delay_s=0) as hub:
        subprocess.run([...], env={..., "HF_ENDPOINT": hub.endpoint, "HF_TOKEN": "hf_x", "HF_HUB_OFFLINE": "0"})
        [commit] = hub.uploads()  # {"repo_id", "private", "summary", "authorized", "files": {path: bytes}}
        hub.requests()            # [{"method", "path", "authorized", "status"}, ...]: the token's presence, never it
        hub.files("standin-user/name")  # {path: bytes}: what the repo holds now, .gitattributes included
    hub.add_repo("someone/x", private=False, files={...}) puts a repo there before a test, as an earlier push would.
As a process: `python tests/hub_standin.py RECORD_DIR PORT_FILE [--fail-with CODE] [--delay-s S]` serves until
killed; read its records with read_uploads(RECORD_DIR) and read_requests(RECORD_DIR).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote

USER = "standin-user"
REPO = r"/api/(?P<type>models|datasets|spaces)/(?P<repo>[^/]+/[^/]+)"
# What the Hub puts in a new repository (the start of the real one: the LFS rules for large files).
GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.bin filter=lfs diff=lfs merge=lfs -text\n"


def git_blob_oid(data: bytes) -> str:
    """The id git gives a file's content, which the Hub returns as a regular file's "oid"."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def read_uploads(record_dir) -> list[dict]:
    """The commits received, in order, with each file's exact bytes."""
    commits = [json.loads(p.read_text()) for p in sorted(Path(record_dir).glob("commit-*.json"))]
    for commit in commits:
        commit["files"] = {path: base64.b64decode(data) for path, data in commit["files"].items()}
    return commits


def read_requests(record_dir) -> list[dict]:
    path = Path(record_dir) / "requests.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


class HubStandIn:
    def __init__(
        self,
        record_dir,
        *,
        port: int = 0,
        fail_with: int | None = None,
        delay_s: float = 0.0,
        on_commit=None,
        settings_fail_with: int | None = None,
    ):
        """`on_commit`: called (no arguments) as each commit arrives, before `delay_s` and `fail_with`.
        `settings_fail_with`: answer a settings change with this status (403: a member who may write to
        the repository but not change its visibility)."""
        self.record_dir = Path(record_dir)
        self.record_dir.mkdir(parents=True, exist_ok=True)
        self.fail_with, self.delay_s, self.on_commit = fail_with, delay_s, on_commit
        self.settings_fail_with = settings_fail_with
        # repo_id -> {"private": bool, "sha": head oid, "history": {oid: {path: bytes}}}
        self.repos: dict[str, dict] = {}
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", port), _make_handler(self))
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, name="hub-standin", daemon=True)

    def __enter__(self) -> HubStandIn:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def uploads(self) -> list[dict]:
        return read_uploads(self.record_dir)

    def requests(self) -> list[dict]:
        return read_requests(self.record_dir)

    def files(self, repo_id: str, revision: str | None = None) -> dict[str, bytes]:
        """What the repo holds at `revision` (default: its head), path -> bytes."""
        with self.lock:
            repo = self.repos[repo_id]
            return dict(repo["history"][revision or repo["sha"]])

    def add_repo(self, repo_id: str, *, private: bool = False, files: dict[str, bytes] | None = None) -> str:
        """A repo as an earlier push left it: .gitattributes and `files`, in one commit. Returns its head."""
        with self.lock:
            return self._new_repo(repo_id, private, {".gitattributes": GITATTRIBUTES, **(files or {})})

    def _new_repo(self, repo_id: str, private: bool, files: dict[str, bytes]) -> str:
        oid = hashlib.sha1(json.dumps([repo_id, sorted(files)]).encode()).hexdigest()
        self.repos[repo_id] = {"private": private, "sha": oid, "history": {oid: files}}
        return oid

    def log(self, entry: dict) -> None:
        with self.lock, open(self.record_dir / "requests.jsonl", "a") as handle:
            handle.write(json.dumps(entry) + "\n")

    def create_repo(self, body: dict) -> tuple[int, dict]:
        repo_id = f"{body.get('organization') or USER}/{body['name']}"
        url = f"{self.endpoint}/{repo_id}" if body.get("type") in (None, "model") else None
        url = url or f"{self.endpoint}/{body['type']}s/{repo_id}"
        with self.lock:
            if repo_id in self.repos:
                return 409, {"error": "You already created this repo", "url": url}
            private = body.get("visibility") == "private" or body.get("private") is True
            self._new_repo(repo_id, private, {".gitattributes": GITATTRIBUTES})
        return 200, {"url": url, "name": repo_id, "id": repo_id}

    def update_settings(self, repo_id: str, body: dict, authorized: bool) -> tuple[int, dict]:
        if not authorized:
            return 401, {"error": "Invalid credentials in Authorization header"}
        if repo_id not in self.repos:
            return 404, {"error": f"Repository not found: {repo_id}", "code": "RepoNotFound"}
        if self.settings_fail_with:
            return self.settings_fail_with, {"error": "You don't have the rights to change the visibility of this repo"}
        visibility = body.get("visibility") or {True: "private", False: "public"}.get(body.get("private"))
        if visibility not in (None, "private", "public"):
            return 400, {"error": f"Invalid visibility: {visibility!r}"}
        with self.lock:
            if visibility:
                self.repos[repo_id]["private"] = visibility == "private"
        return 200, {}

    def _visible(self, repo_id: str, authorized: bool) -> bool:
        """The Hub answers a private repo asked without a token as if it did not exist."""
        repo = self.repos.get(repo_id)
        return repo is not None and (authorized or not repo["private"])

    def tree(self, repo_id: str, revision: str, path: str, recursive: bool) -> tuple[int, object]:
        repo = self.repos[repo_id]
        revision = repo["sha"] if revision == "main" else revision
        if revision not in repo["history"]:
            return 404, {"error": f"Invalid rev id: {revision}", "code": "RevisionNotFound"}
        prefix = f"{path.strip('/')}/" if path.strip("/") else ""
        entries: dict[str, dict] = {}
        for name, data in sorted(repo["history"][revision].items()):
            if not name.startswith(prefix):
                continue
            parts = name[len(prefix) :].split("/")
            folders = parts[:-1] if recursive else parts[:1] if len(parts) > 1 else []
            for depth in range(1, len(folders) + 1):
                folder = prefix + "/".join(parts[:depth])
                entries[folder] = {"type": "directory", "oid": hashlib.sha1(folder.encode()).hexdigest(), "size": 0}
            if recursive or len(parts) == 1:
                entries[name] = {"type": "file", "oid": git_blob_oid(data), "size": len(data)}
        if prefix and not entries:
            return 404, {"error": f"Entry not found: {path}", "code": "EntryNotFound"}
        return 200, [{**entry, "path": name} for name, entry in entries.items()]

    def commit(self, repo_type: str, repo_id: str, raw: bytes, authorized: bool) -> tuple[int, dict]:
        if self.on_commit:
            self.on_commit()
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.fail_with:
            return self.fail_with, {"error": f"hub stand-in: commit refused with {self.fail_with}, as told"}
        lines = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
        header = next((item["value"] for item in lines if item["key"] == "header"), {})
        files, others = {}, []
        for item in lines:
            if item["key"] == "file":
                files[item["value"]["path"]] = item["value"]["content"]  # already base64
            elif item["key"] != "header":
                others.append(item)  # lfsFile / deletedFile / deletedFolder: kept as sent
        oid = hashlib.sha1(raw).hexdigest()
        with self.lock:
            repo = self.repos.get(repo_id)
            if repo is None:
                return 404, {"error": f"Repository not found: {repo_id}", "code": "RepoNotFound"}
            parent = header.get("parentCommit")
            if parent and not repo["sha"].startswith(parent):
                return 412, {"error": "A commit has happened since. Please refresh and try again."}
            # Applied as the Hub does, all or nothing: deletions first, then the files the commit adds.
            tree = dict(repo["history"][repo["sha"]])
            for item in others:
                path = item["value"]["path"]
                if item["key"] == "deletedFile":
                    gone = [path] if path in tree else []
                elif item["key"] == "deletedFolder":
                    gone = [name for name in tree if name.startswith(path.rstrip("/") + "/")]
                else:
                    return 400, {"error": f"hub stand-in: {item['key']} is not served (every file is regular)"}
                if not gone:
                    return 404, {"error": f"Entry not found: {path}", "code": "EntryNotFound"}
                for name in gone:
                    del tree[name]
            tree.update({path: base64.b64decode(data) for path, data in files.items()})
            repo["history"][oid] = tree
            repo["sha"] = oid
            number = len(list(self.record_dir.glob("commit-*.json")))
            record = {
                "repo_id": repo_id,
                "repo_type": repo_type,
                "private": repo["private"],
                "summary": header.get("summary"),
                "description": header.get("description"),
                "authorized": authorized,
                "oid": oid,
                "other_operations": others,
                "files": files,
            }
            tmp = self.record_dir / f".commit-{number:04d}.tmp"
            tmp.write_text(json.dumps(record))
            tmp.rename(self.record_dir / f"commit-{number:04d}.json")  # whole or absent for a reader
        prefix = "" if repo_type == "model" else f"/{repo_type}s"
        url = f"{self.endpoint}{prefix}/{repo_id}/commit/{oid}"
        return 200, {"success": True, "commitOid": oid, "commitUrl": url, "pullRequestUrl": None}

    def route(self, method: str, path: str, body: bytes, authorized: bool, query: str = "") -> tuple[int, object]:
        if method == "POST" and path == "/api/repos/create":
            return self.create_repo(json.loads(body))
        if method == "POST" and path == "/api/validate-yaml":
            return 200, {"errors": [], "warnings": []}
        if method == "GET" and path == "/api/agent-harnesses":
            return 200, {"standardEnvVars": [], "harnesses": {}}
        if method == "GET" and path == "/api/whoami-v2":
            user = {"type": "user", "name": USER, "orgs": [], "auth": {"accessToken": {"role": "write"}}}
            return (200, user) if authorized else (401, {"error": "Invalid credentials in Authorization header"})
        match = re.fullmatch(REPO + r"/(?P<op>preupload|commit)/(?P<rev>[^/]+)", path)
        if method == "POST" and match and match["op"] == "preupload":
            repo = self.repos.get(match["repo"])
            held = repo["history"][repo["sha"]] if repo else {}
            answer = [
                {
                    "path": f["path"],
                    "uploadMode": "regular",
                    "shouldIgnore": False,
                    "oid": git_blob_oid(held[f["path"]]) if f["path"] in held else None,
                }
                for f in json.loads(body)["files"]
            ]
            return 200, {"files": answer, "commitOid": repo and repo["sha"]}
        if method == "POST" and match:
            return self.commit(match["type"][:-1], match["repo"], body, authorized)
        match = re.fullmatch(REPO + r"/settings", path)
        if method == "PUT" and match:
            return self.update_settings(match["repo"], json.loads(body or b"{}"), authorized)
        match = re.fullmatch(REPO + r"/tree/(?P<rev>[^/]+)(?P<path>/.*)?", path)
        if method == "GET" and match and self._visible(match["repo"], authorized):
            recursive = parse_qs(query).get("recursive", ["false"])[0].lower() == "true"
            return self.tree(match["repo"], unquote(match["rev"]), unquote(match["path"] or ""), recursive)
        info = re.fullmatch(REPO + r"(/revision/(?P<rev>[^/]+))?", path)
        if method == "GET" and info and self._visible(info["repo"], authorized):
            repo = self.repos[info["repo"]]
            sha = unquote(info["rev"] or "main")
            sha = repo["sha"] if sha == "main" else sha
            if sha not in repo["history"]:
                return 404, {"error": f"Invalid rev id: {sha}", "code": "RevisionNotFound"}
            siblings = [{"rfilename": name} for name in sorted(repo["history"][sha])]
            return 200, {"id": info["repo"], "sha": sha, "private": repo["private"], "siblings": siblings}
        if method == "GET" and (match or info):
            return 404, {"error": f"Repository Not Found for url: {path}", "code": "RepoNotFound"}
        return 404, {"error": f"hub stand-in: no such endpoint or repo: {method} {path}"}


def _make_handler(hub: HubStandIn) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _serve(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            authorized = self.headers.get("Authorization", "").startswith("Bearer ")
            path, _, query = self.path.partition("?")
            try:
                status, answer = hub.route(self.command, path, body, authorized, query)
            except Exception as exc:  # a malformed request: the client sees a 400, the log says why
                status, answer = 400, {"error": f"hub stand-in: {type(exc).__name__}: {exc}"}
            hub.log({"method": self.command, "path": self.path, "authorized": authorized, "status": status})
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if isinstance(answer, dict) and answer.get("code"):
                self.send_header("X-Error-Code", answer["code"])
            if status >= 400:
                self.send_header("X-Error-Message", answer["error"])
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_DELETE = _serve

        def log_message(self, *args) -> None:  # quiet: requests.jsonl is the log
            pass

    return Handler


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Serve the Hub stand-in until killed.")
    parser.add_argument("record_dir")
    parser.add_argument("port_file")
    parser.add_argument("--fail-with", type=int, default=None, help="answer the commit call with this status")
    parser.add_argument("--delay-s", type=float, default=0.0, help="wait this long before answering a commit")
    args = parser.parse_args()
    with HubStandIn(args.record_dir, fail_with=args.fail_with, delay_s=args.delay_s) as hub:
        Path(args.port_file + ".tmp").write_text(str(hub.port))
        Path(args.port_file + ".tmp").rename(args.port_file)
        hub.thread.join()
