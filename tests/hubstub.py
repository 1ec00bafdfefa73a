"""A loopback stand-in for the Hugging Face Hub, driven by the real huggingface_hub (2.4) client.

Only the HTTP calls the client makes for create_repo, upload_folder / create_commit (legacy LFS path,
Xet disabled), model_info / repo_info, list_repo_tree, whoami and hf_hub_download are served; payload
shapes follow the client's source (hf_api.py, _commit_api.py, lfs.py, file_download.py, utils/_http.py).
Model repos and the "main" branch only. Anything else is answered 404 and listed in `unhandled`.
"""

import base64
import hashlib
import json
import re
import secrets
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import yaml  # a hard dependency of huggingface_hub; the real /api/validate-yaml parses the front matter too

REPO = r"(?P<repo>[\w.-]+/[\w.-]+)"
BAD_TOKEN = "Invalid credentials in Authorization header"  # the Hub's wording; the client keys on it


class HubError(Exception):
    """An error answer: status, message (body "error" and X-Error-Message), X-Error-Code the client maps."""

    def __init__(self, status, message, code=None, headers=None):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HubStub:
    """Context manager: a Hub on 127.0.0.1 that accepts exactly one token."""

    def __init__(self, lfs_threshold: int = 10_000, user: str = "stub-user"):
        self.lfs_threshold, self.user = lfs_threshold, user
        self.token = "hf_" + secrets.token_hex(16)
        self.requests: list[dict] = []  # method, path, query (raw), headers (lower-case names), body
        self.unhandled: list[str] = []  # "METHOD /path" of every request no route matched
        self.repos: dict[str, dict] = {}  # commits[i]["files"] is the whole tree after commit i
        self._lfs: dict[str, bytes] = {}  # LFS objects received via PUT, by sha256
        self._upload_keys: dict[str, str] = {}  # oid -> one-off key in the upload href (PUTs carry no auth)
        self._lock = threading.Lock()
        self._routes = [
            ("GET", r"/api/agent-harnesses", None, lambda m, q, b: {"standardEnvVars": [], "harnesses": {}}),
            ("GET", r"/api/whoami-v2", "write", self._whoami),
            ("POST", r"/api/repos/create", "write", self._create),
            ("POST", r"/api/validate-yaml", "write", self._validate_yaml),
            ("GET", rf"/api/models/{REPO}(?:/revision/(?P<rev>[^/]+))?", "read", self._info),
            ("GET", rf"/api/models/{REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.+))?", "read", self._tree),
            ("POST", rf"/api/models/{REPO}/preupload/(?P<rev>[^/]+)", "write", self._preupload),
            ("POST", rf"/api/models/{REPO}/commit/(?P<rev>[^/]+)", "write", self._commit),
            ("POST", rf"/{REPO}\.git/info/lfs/objects/batch", "write", self._lfs_batch),
            ("POST", rf"/{REPO}\.git/info/lfs/objects/verify", "write", self._lfs_verify),
            ("PUT", r"/__lfs_upload__/(?P<oid>[0-9a-f]{64})", None, self._lfs_put),
            ("GET", rf"/{REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)", "read", self._resolve),
        ]

    # --- lifecycle -------------------------------------------------------------------------------
    def __enter__(self):
        stub = self

        class Handler(_Handler):
            hub = stub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        # A short poll interval keeps shutdown() (and so each test's teardown) quick.
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()
        self._tmp = tempfile.TemporaryDirectory(prefix="hubstub-")
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()
        self._tmp.cleanup()

    def configure_client(self, monkeypatch) -> None:
        """Point the imported client at this stub for one test.

        huggingface_hub reads HF_ENDPOINT, HF_HUB_DISABLE_XET, HF_HUB_OFFLINE and its paths at import time, so
        setting the environment is not enough: the module constants are patched too. Xet off selects the legacy
        LFS upload path; telemetry off skips the agent-harness lookup (it writes a file under HF_HOME); the token
        file and download cache move into the stub's temp dir, so only the token a test passes is ever sent and
        nothing lands in ~/.cache.
        """
        from huggingface_hub import constants

        for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
        patches = {"HF_HUB_DISABLE_XET": True, "HF_HUB_OFFLINE": False, "HF_HUB_DISABLE_TELEMETRY": True,
                   "HF_TOKEN_PATH": f"{self._tmp.name}/no-token", "HF_HUB_CACHE": f"{self._tmp.name}/hub",
                   "ENDPOINT": self.url,  # hf_hub_url() builds on this template, then swaps in `endpoint`
                   "HUGGINGFACE_CO_URL_TEMPLATE": self.url + "/{repo_id}/resolve/{revision}/{filename}"}
        for name, value in patches.items():
            monkeypatch.setattr(constants, name, value)
        # The module-level functions (file_exists, which PEFT's from_pretrained calls, ...) use one HfApi made at
        # import, whose endpoint was read from the constants then.
        from huggingface_hub import hf_api

        monkeypatch.setattr(hf_api.api, "endpoint", self.url)

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        with self._lock:
            commit = self._find_commit(repo_id, revision)
            return dict(commit["files"]) if commit else {}

    # --- helpers (called with the lock held) -----------------------------------------------------
    def _repo(self, repo_id):
        if repo_id not in self.repos:
            raise HubError(404, f"Repository not found: {repo_id}", "RepoNotFound")
        return self.repos[repo_id]

    def _find_commit(self, repo_id, rev):
        commits = self._repo(repo_id)["commits"]
        if rev == "main":
            return commits[-1] if commits else None
        for commit in commits:
            if len(rev) >= 7 and commit["oid"].startswith(rev):
                return commit
        raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")

    def _oid(self, data: bytes) -> str:  # what the client compares with its local oid to skip unchanged files
        return hashlib.sha256(data).hexdigest() if len(data) >= self.lfs_threshold else git_blob_oid(data)

    # --- endpoints: each gets (match, query, body) and returns a JSON-able object or (status, headers, bytes)
    def _whoami(self, m, q, body):
        access = {"displayName": "hubstub", "role": "write"}
        return {"type": "user", "name": self.user, "orgs": [], "auth": {"type": "access_token", "accessToken": access}}

    def _create(self, m, q, body):
        payload = json.loads(body)
        if payload.get("type", "model") != "model":
            raise HubError(400, "hubstub serves model repos only")
        repo_id = f"{payload.get('organization') or self.user}/{payload['name']}"
        if repo_id in self.repos:  # create_repo(exist_ok=True) reads "url" from this 409 body
            return 409, {}, {"error": "You already created this model repo", "url": f"{self.url}/{repo_id}"}
        self.repos[repo_id] = {"private": payload.get("visibility") == "private", "commits": []}
        return {"url": f"{self.url}/{repo_id}", "name": repo_id}

    def _validate_yaml(self, m, q, body):
        content = json.loads(body)["content"]
        if not content.startswith("---"):
            return {"errors": [], "warnings": []}
        parts = re.split(r"^---\s*$", content, maxsplit=2, flags=re.M)
        try:
            if len(parts) < 3:
                raise yaml.YAMLError("no closing '---' after the YAML front matter")
            if not isinstance(yaml.safe_load(parts[1]) or {}, dict):
                raise yaml.YAMLError("the front matter is not a mapping")
        except yaml.YAMLError as e:
            return 400, {}, {"errors": [{"message": f"Invalid YAML in README.md: {e}"}], "warnings": []}
        return {"errors": [], "warnings": []}

    def _info(self, m, q, body):
        repo, commit = self._repo(m["repo"]), self._find_commit(m["repo"], m["rev"] or "main")
        files = commit["files"] if commit else {}
        return {"id": m["repo"], "author": m["repo"].split("/")[0], "sha": commit and commit["oid"],
                "private": repo["private"], "siblings": [{"rfilename": p} for p in sorted(files)]}

    def _tree(self, m, q, body):
        commit = self._find_commit(m["repo"], m["rev"])
        prefix = (m["path"].strip("/") + "/") if m["path"] else ""
        recursive = q.get("recursive", ["False"])[0].lower() == "true"
        entries = {}
        for path, data in sorted((commit["files"] if commit else {}).items()):
            if not path.startswith(prefix):
                continue
            rest = path[len(prefix):]
            if "/" in rest and not recursive:
                folder = prefix + rest.split("/")[0]
                entries[folder] = {"type": "directory", "path": folder, "oid": git_blob_oid(folder.encode())}
                continue
            entry = {"type": "file", "path": path, "size": len(data), "oid": git_blob_oid(data)}
            if len(data) >= self.lfs_threshold:
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            entries[path] = entry
        if prefix and not entries:
            raise HubError(404, f"{prefix} does not exist on main", "EntryNotFound")
        return list(entries.values())

    def _preupload(self, m, q, body):
        commit = self._find_commit(m["repo"], m["rev"])
        current = commit["files"] if commit else {}
        return {"files": [{"path": f["path"], "shouldIgnore": False,
                           "uploadMode": "lfs" if f["size"] >= self.lfs_threshold else "regular",
                           "oid": self._oid(current[f["path"]]) if f["path"] in current else None}
                          for f in json.loads(body)["files"]]}

    def _lfs_batch(self, m, q, body):
        self._repo(m["repo"])
        objects = []
        for obj in json.loads(body)["objects"]:
            entry = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
            if obj["oid"] not in self._lfs:  # no "actions" tells the client the object is already stored
                key = self._upload_keys.setdefault(obj["oid"], secrets.token_hex(8))
                entry["actions"] = {
                    "upload": {"href": f"{self.url}/__lfs_upload__/{obj['oid']}?key={key}", "header": {}},
                    "verify": {"href": f"{self.url}/{m['repo']}.git/info/lfs/objects/verify", "header": {}}}
            objects.append(entry)
        return 200, {"Content-Type": "application/vnd.git-lfs+json"}, {"transfer": "basic", "objects": objects}

    def _lfs_put(self, m, q, body):
        oid = m["oid"]
        if q.get("key", [None])[0] != self._upload_keys.get(oid):
            raise HubError(403, "bad or missing upload key")
        if hashlib.sha256(body).hexdigest() != oid:
            raise HubError(400, "uploaded content does not match its sha256 oid")
        self._lfs[oid] = body
        return 200, {"ETag": f'"{hashlib.md5(body).hexdigest()}"'}, b""

    def _lfs_verify(self, m, q, body):
        obj = json.loads(body)
        if obj["oid"] not in self._lfs or len(self._lfs[obj["oid"]]) != obj["size"]:
            raise HubError(404, f"LFS object {obj['oid']} was not uploaded")
        return {"success": True}

    def _commit(self, m, q, body):
        repo_id = m["repo"]
        if m["rev"] != "main" or q.get("create_pr"):
            raise HubError(400, "hubstub commits to main only (no branches, no pull requests)")
        head = self._find_commit(repo_id, "main")
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "the first ndjson line must be the commit header")
        header = lines[0]["value"]
        if header.get("parentCommit") not in (None, head and head["oid"]):
            raise HubError(412, "A commit has happened since. Please refresh and try again.")
        files = dict(head["files"]) if head else {}
        for line in lines[1:]:
            key, value = line["key"], line["value"]
            if key == "file" and value.get("encoding") == "base64":
                files[value["path"]] = base64.b64decode(value["content"])
            elif key == "lfsFile":
                if value["oid"] not in self._lfs:
                    raise HubError(400, f"LFS object {value['oid']} for {value['path']} was never uploaded")
                files[value["path"]] = self._lfs[value["oid"]]
            elif key == "deletedFile":
                if value["path"] not in files:  # the client adds a hint when it sees this wording
                    raise HubError(404, f"A file with this name doesn't exist: {value['path']}", "EntryNotFound")
                del files[value["path"]]
            elif key == "deletedFolder":
                files = {p: d for p, d in files.items() if not p.startswith(value["path"].rstrip("/") + "/")}
            else:
                raise HubError(400, f"unsupported commit line: {key} (encoding {value.get('encoding')})")
        digest = hashlib.sha1(json.dumps([repo_id, head and head["oid"], header.get("summary"),
                                          sorted((p, hashlib.sha256(d).hexdigest()) for p, d in files.items())]).encode())
        oid = digest.hexdigest()
        self.repos[repo_id]["commits"].append({"oid": oid, "message": header.get("summary"),
                                               "description": header.get("description", ""), "files": files})
        return {"success": True, "commitOid": oid, "commitUrl": f"{self.url}/{repo_id}/commit/{oid}", "hookOutput": ""}

    def _resolve(self, m, q, body):
        commit = self._find_commit(m["repo"], m["rev"])
        path = m["path"]
        if commit is None or path not in commit["files"]:  # X-Repo-Commit lets the client cache the miss
            raise HubError(404, f"Entry not found: {path}", "EntryNotFound",
                           {"X-Repo-Commit": commit["oid"]} if commit else None)
        data = commit["files"][path]
        # The client caches by ETag: git sha1 for regular files, sha256 for LFS ones.
        return 200, {"X-Repo-Commit": commit["oid"], "ETag": f'"{self._oid(data)}"',
                     "Content-Type": "application/octet-stream"}, data


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the client's connection pool expects
    hub: HubStub

    def log_message(self, *args):  # keep test output quiet
        pass

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while (size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)) > 0:
                chunks.append(self.rfile.read(size))
                self.rfile.readline()  # CRLF after each chunk
            while self.rfile.readline().strip():  # trailers up to the blank line
                pass
            return b"".join(chunks)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _send(self, status, headers, payload):
        if not isinstance(payload, bytes):
            payload = json.dumps(payload).encode()
            headers = {"Content-Type": "application/json", **headers}
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, " ".join(str(value).split()))  # a YAML error spans lines; headers cannot
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    def _handle(self):
        hub = self.hub
        url = urlsplit(self.path)
        body = self._read_body()
        with hub._lock:
            hub.requests.append({"method": self.command, "path": url.path, "query": url.query,
                                 "headers": {k.lower(): v for k, v in self.headers.items()}, "body": body})
        method = "GET" if self.command == "HEAD" else self.command
        auth = self.headers.get("Authorization")
        try:
            for verb, pattern, needs, handler in hub._routes:
                m = re.fullmatch(pattern, url.path) if verb == method else None
                if m is None:
                    continue
                groups = {k: unquote(v) if v else v for k, v in m.groupdict().items()}
                if needs and auth is not None and auth != f"Bearer {hub.token}":
                    return self._send(401, {"X-Error-Message": BAD_TOKEN}, {"error": BAD_TOKEN})
                with hub._lock:
                    if needs == "write" and auth is None:
                        raise HubError(401, "You must be authenticated to access this resource")
                    if needs == "read" and auth is None and groups.get("repo") in hub.repos \
                            and hub.repos[groups["repo"]]["private"]:
                        raise HubError(401, "Repository not found", "RepoNotFound")
                    result = handler(groups, parse_qs(url.query), body)
                return self._send(*(result if isinstance(result, tuple) else (200, {}, result)))
            with hub._lock:
                hub.unhandled.append(f"{self.command} {url.path}")
            raise HubError(404, f"hubstub has no route for {self.command} {url.path}")
        except (KeyError, TypeError, ValueError) as e:  # a malformed payload; a 5xx would make the client retry
            self._send(400, {"X-Error-Message": "malformed request"}, {"error": f"malformed request: {e!r}"})
        except HubError as e:
            headers = {"X-Error-Message": e.message, **e.headers}
            if e.code:
                headers["X-Error-Code"] = e.code
            self._send(e.status, headers, {"error": e.message})

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = _handle
