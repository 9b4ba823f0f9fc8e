"""A fake of the Hugging Face Hub's repo and commit API on loopback, as ``huggingface_hub`` 2.x uses it to
create a repo and commit files to it: what ``export --push-to-hub`` and the launcher's push at the end of a
run send.

It follows what the client sends and parses (``hf_api.py``, ``_commit_api.py``, ``lfs.py``):

* ``GET /api/whoami-v2``: the user, their organisations and the token's role (``auth.accessToken.role``).
* ``POST /api/repos/create`` with ``{name, organization, visibility, type}``: 200 with the repo's ``url``; an
  existing repo is 409 with its ``url`` too (the client's ``exist_ok`` reads it); a namespace the user may not
  write is 403. No ``visibility`` means public, as the Hub does for a user's repo.
* ``GET /api/models/{repo}``: ``id``, ``private``, ``sha``, ``siblings``; an unknown repo is 404 with
  ``X-Error-Code: RepoNotFound`` (the client's ``RepositoryNotFoundError``).
* ``POST /api/validate-yaml``: the README's front matter must be a YAML mapping (400 with ``errors`` if not).
* ``POST /api/models/{repo}/preupload/{rev}``: each file's ``uploadMode``, ``lfs`` for the patterns of the
  Hub's default ``.gitattributes`` (weights, archives) and for files over 10 MB, else ``regular``; and the
  ``oid`` of a file the repo already holds.
* LFS (``{repo}.git/info/lfs/objects/batch``, basic transfer): an ``upload`` action to a pre-signed URL (a PUT
  with no token, whose body must hash to the oid) and a ``verify`` action; an object already stored has no
  actions. The Xet transfer hf_xet would use instead is not reproduced: the client runs with
  ``HF_HUB_DISABLE_XET=1`` and takes the LFS path the Hub also serves.
* ``POST /api/models/{repo}/commit/{rev}``: the ndjson header, ``file`` (base64) and ``lfsFile`` (an uploaded
  oid) lines, applied all at once or not at all; 200 with ``commitOid`` and ``commitUrl``.

Every request needs ``Authorization: Bearer <token>`` but the pre-signed PUT; a wrong token is 401 with the
Hub's ``Invalid credentials in Authorization header``. ``refuse`` answers the next requests to a route with
an error status. Repos, their commits and every request are recorded for the tests to check.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

import yaml

# The Hub's default .gitattributes sends these through LFS (an excerpt: what a model folder holds).
LFS_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.onnx", "*.gguf", "*.zip")
LFS_MIN_BYTES = 10 * 1024 * 1024


def git_blob_oid(data: bytes) -> str:
    """A regular file's oid as the Hub reports it: git's blob sha1."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class FakeRepo:
    id: str
    private: bool
    files: dict[str, bytes] = field(default_factory=dict)
    lfs: set[str] = field(default_factory=set)  # paths stored through LFS
    commits: list[dict[str, Any]] = field(default_factory=list)

    @property
    def sha(self) -> str:
        return self.commits[-1]["oid"] if self.commits else "0" * 40

    def oid(self, path: str) -> str:
        data = self.files[path]
        return hashlib.sha256(data).hexdigest() if path in self.lfs else git_blob_oid(data)


class FakeHub:
    """The Hub on 127.0.0.1, for ``user`` (member of ``orgs``) with ``token`` (of ``role``: write or read)."""

    def __init__(self, token: str, user: str, orgs: tuple[str, ...] = (), role: str = "write") -> None:
        self.token = token
        self.user = user
        self.orgs = orgs
        self.role = role
        self.repos: dict[str, FakeRepo] = {}
        self.objects: dict[str, bytes] = {}  # LFS objects uploaded, by sha256
        self.requests: list[tuple[str, str]] = []
        self.refusals: list[tuple[str, str, int]] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeHub:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def refuse(self, method: str, path_prefix: str, status: int, times: int = 1) -> None:
        """Answer the next ``times`` ``method`` requests whose path starts with ``path_prefix`` with ``status``."""
        self.refusals += [(method, path_prefix, status)] * times

    def requests_to(self, method: str, path_prefix: str) -> list[str]:
        return [path for m, path in self.requests if m == method and path.startswith(path_prefix)]

    # --- the repo side ---------------------------------------------------------------------------------

    def _create(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        namespace = body.get("organization") or self.user
        repo_id = f"{namespace}/{body['name']}"
        if body.get("type", "model") != "model":
            return 400, {"error": "only model repos here"}
        if namespace not in (self.user, *self.orgs):
            return 403, {
                "error": f'You don\'t have the rights to create a model under the namespace "{namespace}"'
            }
        with self._lock:
            if repo_id in self.repos:
                return 409, {"error": "You already created this model repo", "url": f"{self.url}/{repo_id}"}
            self.repos[repo_id] = FakeRepo(repo_id, private=body.get("visibility") == "private")
        return 200, {
            "url": f"{self.url}/{repo_id}",
            "name": repo_id,
            "id": hashlib.sha1(repo_id.encode()).hexdigest(),
        }

    def _upload_mode(self, path: str, size: int) -> str:
        name = path.rsplit("/", 1)[-1]
        lfs = size >= LFS_MIN_BYTES or any(fnmatch.fnmatch(name, p) for p in LFS_PATTERNS)
        return "lfs" if lfs else "regular"

    def _commit(self, repo: FakeRepo, lines: list[dict[str, Any]]) -> tuple[int, dict[str, Any]]:
        if not lines or lines[0].get("key") != "header":
            return 400, {"error": "the first line of a commit must be its header"}
        files, lfs = {}, set()
        for line in lines[1:]:
            value = line["value"]
            if line["key"] == "file":
                files[value["path"]] = base64.b64decode(value["content"])
            elif line["key"] == "lfsFile":
                data = self.objects.get(value["oid"])
                if data is None or len(data) != value["size"]:
                    return 422, {"error": f"LFS object {value['oid']} of {value['path']} was never uploaded"}
                files[value["path"]] = data
                lfs.add(value["path"])
            else:
                return 400, {"error": f"unsupported commit operation {line['key']!r}"}
        oid = hashlib.sha1(
            json.dumps([repo.sha, sorted(files)]).encode() + b"".join(files.values())
        ).hexdigest()
        with self._lock:
            repo.files.update(files)
            repo.lfs = (repo.lfs - set(files)) | lfs
            repo.commits.append({"oid": oid, "summary": lines[0]["value"]["summary"], "paths": sorted(files)})
        return 200, {
            "success": True,
            "commitOid": oid,
            "commitUrl": f"{self.url}/{repo.id}/commit/{oid}",
            "hookOutput": "",
        }

    # --- HTTP -----------------------------------------------------------------------------------------

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # keep test output clean
                pass

            def _json(self, code: int, body: Any, headers: dict[str, str] | None = None) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> bytes:
                """The request's body, sent with a length or chunked (a streamed file)."""
                if self.headers.get("Transfer-Encoding", "").lower() != "chunked":
                    return self.rfile.read(int(self.headers.get("Content-Length", 0)))
                chunks = []
                while size := int(self.rfile.readline().split(b";")[0], 16):
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
                self.rfile.readline()
                return b"".join(chunks)

            def _authorised(self) -> bool:
                if self.headers.get("authorization") == f"Bearer {fake.token}":
                    return True
                self._json(401, {"error": "Invalid credentials in Authorization header"})
                return False

            def _refused(self, method: str, path: str) -> bool:
                for refusal in fake.refusals:
                    wanted, prefix, status = refusal
                    if wanted == method and path.startswith(prefix):
                        fake.refusals.remove(refusal)
                        self._json(status, {"error": f"refused by the test ({status})"})
                        return True
                return False

            def _repo(self, repo_id: str) -> FakeRepo | None:
                repo = fake.repos.get(repo_id)
                if repo is None:
                    self._json(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
                return repo

            def _route(self, method: str) -> None:
                path = unquote(urlsplit(self.path).path)
                fake.requests.append((method, path))
                body = self._body() if method in ("POST", "PUT") else b""
                if self._refused(method, path):
                    return None
                if method == "PUT" and path.startswith("/__lfs/"):  # the pre-signed URL: no token
                    oid = path.removeprefix("/__lfs/")
                    if hashlib.sha256(body).hexdigest() != oid:
                        return self._json(400, {"error": "the body does not hash to the object's oid"})
                    fake.objects[oid] = body
                    return self._json(200, {}, {"ETag": f'"{oid[:32]}"'})
                if not self._authorised():
                    return None
                if method == "GET" and path == "/api/whoami-v2":
                    return self._json(
                        200,
                        {
                            "type": "user",
                            "id": "u1",
                            "name": fake.user,
                            "orgs": [{"name": org} for org in fake.orgs],
                            "auth": {
                                "type": "access_token",
                                "accessToken": {"displayName": "t", "role": fake.role},
                            },
                        },
                    )
                if method == "POST" and path == "/api/repos/create":
                    return self._json(*fake._create(json.loads(body)))
                if method == "POST" and path == "/api/validate-yaml":
                    return self._validate_yaml(json.loads(body)["content"])
                if path.endswith(".git/info/lfs/objects/batch") and method == "POST":
                    return self._lfs_batch(
                        path.removeprefix("/").removesuffix(".git/info/lfs/objects/batch"), body
                    )
                if path.endswith(".git/info/lfs/objects/verify") and method == "POST":
                    sent = json.loads(body)
                    stored = fake.objects.get(sent["oid"])
                    if stored is None or len(stored) != sent["size"]:
                        return self._json(404, {"error": "object not found"})
                    return self._json(200, {})
                segments = path.strip("/").split("/")
                if segments[:2] != ["api", "models"] or len(segments) < 4:
                    return self._json(404, {"error": "not found"})
                repo = self._repo("/".join(segments[2:4]))
                if repo is None:
                    return None
                rest = segments[4:]
                if method == "GET" and rest in ([], ["revision", "main"]):
                    return self._json(
                        200,
                        {
                            "id": repo.id,
                            "private": repo.private,
                            "sha": repo.sha,
                            "siblings": [{"rfilename": name} for name in sorted(repo.files)],
                        },
                    )
                if method == "POST" and rest[:1] == ["preupload"]:
                    files = json.loads(body)["files"]
                    return self._json(
                        200,
                        {
                            "files": [
                                {
                                    "path": f["path"],
                                    "uploadMode": fake._upload_mode(f["path"], f["size"]),
                                    "shouldIgnore": False,
                                    "oid": repo.oid(f["path"]) if f["path"] in repo.files else None,
                                }
                                for f in files
                            ]
                        },
                    )
                if method == "POST" and rest[:1] == ["commit"]:
                    lines = [json.loads(line) for line in body.splitlines() if line.strip()]
                    return self._json(*fake._commit(repo, lines))
                return self._json(404, {"error": "not found"})

            def _validate_yaml(self, content: str) -> None:
                front = content.split("---", 2)[1] if content.startswith("---") else ""
                try:
                    metadata = yaml.safe_load(front)
                except yaml.YAMLError as e:
                    return self._json(400, {"errors": [{"message": f"invalid YAML: {e}"}], "warnings": []})
                if not isinstance(metadata, dict):
                    return self._json(
                        400, {"errors": [{"message": "metadata is not a mapping"}], "warnings": []}
                    )
                return self._json(200, {"errors": [], "warnings": []})

            def _lfs_batch(self, repo_id: str, body: bytes) -> None:
                if self._repo(repo_id) is None:
                    return None
                request = json.loads(body)
                objects = []
                for obj in request["objects"]:
                    entry = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
                    if obj["oid"] not in fake.objects:
                        entry["actions"] = {
                            "upload": {"href": f"{fake.url}/__lfs/{obj['oid']}"},
                            "verify": {"href": f"{fake.url}/{repo_id}.git/info/lfs/objects/verify"},
                        }
                    objects.append(entry)
                return self._json(200, {"transfer": "basic", "objects": objects})

            def do_GET(self) -> None:  # noqa: N802
                self._route("GET")

            def do_POST(self) -> None:  # noqa: N802
                self._route("POST")

            def do_PUT(self) -> None:  # noqa: N802
                self._route("PUT")

        return Handler
