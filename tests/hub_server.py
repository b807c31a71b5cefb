"""A local stand-in for the Hugging Face Hub, enough of its API and file protocol for huggingface_hub:
``model_info`` (``/api/models/{repo}`` and ``/revision/{rev}``), the tree and paths-info listings
``HfFileSystem`` asks for, and ``/{repo}/resolve/{rev}/{file}`` with HEAD and ranged GET (ETag,
X-Repo-Commit, Content-Length, Content-Range headers), serving folders the tests write.

It binds 127.0.0.1 on a free port, runs in a daemon thread, counts every request and every body byte it
serves, and stops itself after ``lifetime_s`` even if a test forgets to. ``modes[repo]`` makes one
repository misbehave: ``gated401`` / ``gated403`` (GatedRepo), ``private`` (401 without the token),
``ratelimit`` (429), ``slow`` (answers after ``slow_s``), ``truncate`` (announces a file's body and sends
half), ``truncate-weights`` (the same, for the safetensors files only).
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit


class HubServer:
    def __init__(self, repos: dict[str, Path], *, token: str | None = None, lifetime_s: float = 300,
                 slow_s: float = 4.0):
        self.repos = {rid: Path(p) for rid, p in repos.items()}
        self.modes: dict[str, str] = {}
        self.token = token
        self.slow_s = slow_s
        self.requests: list[tuple[str, str, int]] = []  # method, path, body bytes served
        self.auth_seen: list[str | None] = []
        # bumped by reset(): a request that arrived before it (a slow reply to the last test's client, which has
        # hung up) is served but not counted as this test's
        self.generation = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.httpd.handle_error = lambda request, address: None  # a client that hung up (timeouts, cuts): expected
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self._timer = threading.Timer(lifetime_s, self.stop)
        self._timer.daemon = True

    # -- lifecycle
    def __enter__(self) -> HubServer:
        self._thread.start()
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if not self._stop.is_set():
            self._stop.set()
            self._timer.cancel()
            self.httpd.shutdown()
            self.httpd.server_close()

    # -- what was served
    def reset(self) -> None:
        with self._lock:
            self.generation += 1
            self.requests.clear()
            self.auth_seen.clear()

    @property
    def bytes_served(self) -> int:
        return sum(n for _, _, n in self.requests)

    def _log(self, method: str, path: str, n: int, auth: str | None, generation: int | None = None) -> None:
        with self._lock:
            if generation is not None and generation != self.generation:
                return  # arrived before the last reset()
            self.requests.append((method, path, n))
            self.auth_seen.append(auth)

    # -- the repositories
    def commit(self, repo_id: str) -> str:
        """A stable 40-hex commit of the folder's names and sizes (as a git commit would change with them)."""
        h = hashlib.sha1(repo_id.encode())
        for name, size in sorted(self.files(repo_id).items()):
            h.update(f"{name}\0{size}\0".encode())
        return h.hexdigest()

    def files(self, repo_id: str) -> dict[str, int]:
        root = self.repos[repo_id]
        return {p.relative_to(root).as_posix(): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                self._serve(head=True)

            def do_GET(self):
                self._serve(head=False)

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length).decode() if length else ""
                self._serve(head=False, form=parse_qs(body))

            # -- replies
            def _reply(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False,
                       length: int | None = None) -> None:
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body) if length is None else length))
                self.end_headers()
                sent = 0
                if not head and body:
                    self.wfile.write(body)
                    sent = len(body)
                server._log(self.command, self.path, sent, self.headers.get("Authorization"),
                            getattr(self, "generation", None))

            def _json(self, status: int, obj, head=False, headers=None) -> None:
                self._reply(status, json.dumps(obj).encode(), {"Content-Type": "application/json", **(headers or {})},
                            head=head)

            def _error(self, status: int, code: str | None, message: str, head: bool) -> None:
                headers = {"X-Error-Message": message}
                if code:
                    headers["X-Error-Code"] = code
                self._json(status, {"error": message}, head=head, headers=headers)

            def _serve(self, head: bool, form: dict | None = None) -> None:
                self.generation = server.generation  # as the request arrives
                url = urlsplit(self.path)
                path = unquote(url.path)
                api = path.startswith("/api/models/")
                parts = (path[len("/api/models/"):] if api else path.lstrip("/")).split("/")
                repo_id = "/".join(parts[:2])
                rest = parts[2:]
                if repo_id not in server.repos:
                    return self._error(404, "RepoNotFound", "Repository not found", head)
                mode = server.modes.get(repo_id)
                if mode in ("gated401", "gated403"):
                    return self._error(401 if mode == "gated401" else 403, "GatedRepo",
                                       "Access to model is restricted. You must have access to it and be authenticated "
                                       "to access it. Please log in.", head)
                if mode == "private" and self.headers.get("Authorization") != f"Bearer {server.token}":
                    return self._error(401, None, "Invalid username or password.", head)
                if mode == "ratelimit":
                    return self._error(429, None, "You have been rate-limited", head)
                if mode == "slow":
                    server._stop.wait(server.slow_s)
                commit = server.commit(repo_id)
                files = server.files(repo_id)
                if api:
                    return self._api(repo_id, rest, commit, files, head, form, parse_qs(url.query))
                if len(rest) >= 3 and rest[0] == "resolve":
                    rev, name = rest[1], "/".join(rest[2:])
                    if rev not in ("main", commit):
                        return self._error(404, "RevisionNotFound", "Invalid rev id", head)
                    if name not in files:
                        return self._error(404, "EntryNotFound", "Entry not found", head)
                    return self._file(repo_id, name, commit, head, mode)
                return self._error(404, None, "not served here", head)

            def _api(self, repo_id, rest, commit, files, head, form, query) -> None:
                rev = "main"
                if rest[:1] == ["revision"]:
                    rev = "/".join(rest[1:])
                elif rest[:1] in (["tree"], ["paths-info"]):
                    rev = rest[1]
                if rev not in ("main", commit):
                    return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
                if rest[:1] == ["tree"]:
                    under = "/".join(rest[2:]).strip("/")
                    entries = [self._entry(n, s) for n, s in files.items() if not under or n.startswith(under + "/")]
                    return self._json(200, entries, head)
                if rest[:1] == ["paths-info"]:
                    wanted = set((form or {}).get("paths", []))
                    return self._json(200, [self._entry(n, s) for n, s in files.items() if n in wanted], head)
                blobs = query.get("blobs") == ["True"] or query.get("blobs") == ["true"]
                siblings = [{"rfilename": n, **({"size": s} if blobs else {})} for n, s in files.items()]
                return self._json(200, {"id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
                                        "gated": False, "disabled": False, "siblings": siblings, "tags": []}, head)

            @staticmethod
            def _entry(name: str, size: int) -> dict:
                oid = hashlib.sha1(f"{name}{size}".encode()).hexdigest()
                return {"type": "file", "path": name, "size": size, "oid": oid}

            def _file(self, repo_id, name, commit, head, mode) -> None:
                data = (server.repos[repo_id] / name).read_bytes()
                etag = '"' + hashlib.sha256(data).hexdigest() + '"'
                headers = {"ETag": etag, "X-Repo-Commit": commit, "Accept-Ranges": "bytes",
                           "Content-Type": "application/octet-stream"}
                if head:
                    return self._reply(200, data, headers, head=True)
                rng = self.headers.get("Range") or self.headers.get("range")
                status, body = 200, data
                if rng and rng.startswith("bytes="):
                    start_s, _, end_s = rng[len("bytes="):].partition("-")
                    start = int(start_s)
                    end = min(int(end_s) if end_s else len(data) - 1, len(data) - 1)
                    if start >= len(data):
                        return self._reply(416, b"", {"Content-Range": f"bytes */{len(data)}"})
                    status, body = 206, data[start:end + 1]
                    headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
                if mode == "truncate" or (mode == "truncate-weights" and name.endswith(".safetensors")):
                    # announce the whole body, send half, hang up
                    self.send_response(status)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    half = body[:len(body) // 2]
                    self.wfile.write(half)
                    self.wfile.flush()
                    server._log(self.command, self.path, len(half), self.headers.get("Authorization"),
                                getattr(self, "generation", None))
                    self.close_connection = True
                    return
                self._reply(status, body, headers)

        return Handler


