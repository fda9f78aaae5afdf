"""A Hugging Face Hub on this machine: a hub cache laid out as huggingface_hub lays it
out, and an HTTP server answering the endpoints ``snapshot_download`` calls
(huggingface_hub 2.4: repo info, the recursive tree, then HEAD and GET of each file's
``resolve`` URL), serving a model directory's files as one repo at one commit."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

# The files of an imported model a repo on the Hub would hold (not Semantic's own records).
REPO_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class RepoFile:
    name: str
    path: Path  # its bytes on this machine
    size: int
    git_oid: str  # the Git blob id: the Hub's ETag of a file kept in Git
    sha256: str | None  # a Git LFS file's id (safetensors weights are kept in LFS), its ETag and blob name

    @property
    def etag(self) -> str:
        return self.sha256 or self.git_oid


def repo_files(model_dir: Path, names: tuple[str, ...] = REPO_FILES) -> list[RepoFile]:
    files = []
    for name in names:
        path = model_dir / name
        data_digest = hashlib.sha256()
        git = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
        with path.open("rb") as handle:
            while chunk := handle.read(1 << 24):
                data_digest.update(chunk)
                git.update(chunk)
        lfs = name.endswith(".safetensors")
        files.append(RepoFile(name, path, path.stat().st_size, git.hexdigest(), data_digest.hexdigest() if lfs else None))
    return files


def build_hf_cache(cache_dir: Path, repo_id: str, model_dir: Path, commit: str) -> Path:
    """``model_dir``'s files as ``repo_id`` at ``commit`` in the hub cache ``cache_dir``, as
    huggingface_hub writes it: ``blobs/<etag>``, ``snapshots/<commit>/<file>`` linking to its
    blob, ``refs/main`` holding the commit. Returns the snapshot directory."""
    repo = cache_dir / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    for file in repo_files(model_dir):
        blob = repo / "blobs" / file.etag
        if not blob.exists():
            try:
                os.link(file.path, blob)  # the weights are hundreds of MB: share them when the file system can
            except OSError:
                shutil.copyfile(file.path, blob)
        (snapshot / file.name).symlink_to(Path("..") / ".." / "blobs" / file.etag)
    return snapshot


def tree(root: Path) -> dict[str, str]:
    """Every path under ``root`` and what it is (a link's target, a file's size): a cache's state."""
    state = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        state[key] = f"-> {os.readlink(path)}" if path.is_symlink() else ("dir" if path.is_dir() else
                                                                            str(path.stat().st_size))
    return state


@dataclass
class FakeHub:
    """Serves one repo at one commit. ``cut_after[name] = n`` ends the connection after
    ``n`` bytes of that file's next GET (each GET consumes one entry of ``cuts``)."""

    repo_id: str
    commit: str
    files: list[RepoFile]
    cuts: dict[str, list[int]] = field(default_factory=dict)
    requests: list[str] = field(default_factory=list)

    @contextmanager
    def serve(self) -> Iterator[str]:
        """Listen on a free local port; yields the endpoint (for HF_ENDPOINT)."""
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                hub.requests.append(f"GET {self.path}")
                hub.answer(self, head=False)

            def do_HEAD(self) -> None:  # noqa: N802
                hub.requests.append(f"HEAD {self.path}")
                hub.answer(self, head=True)

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}"
        finally:
            server.shutdown()
            server.server_close()

    def answer(self, handler: BaseHTTPRequestHandler, head: bool) -> None:
        path = handler.path.split("?", 1)[0]
        repo = re.escape(self.repo_id)
        if re.fullmatch(f"/api/models/{repo}/revision/[^/]+", path):
            return self._json(handler, {"id": self.repo_id, "sha": self.commit,
                                        "siblings": [{"rfilename": f.name} for f in self.files]})
        if re.fullmatch(f"/api/models/{repo}/tree/{self.commit}/?", path):
            return self._json(handler, [{"type": "file", "oid": f.git_oid, "size": f.size, "path": f.name,
                                         **({"lfs": {"oid": f.sha256, "size": f.size, "pointerSize": 134}}
                                            if f.sha256 else {})} for f in self.files])
        match = re.fullmatch(f"/{repo}/resolve/[^/]+/(.+)", path)
        file = next((f for f in self.files if match and f.name == match.group(1)), None)
        if file is None:
            handler.send_response(404)
            handler.send_header("X-Error-Code", "EntryNotFound" if f"/{self.repo_id}/" in path else "RepoNotFound")
            handler.send_header("Content-Length", "0")
            handler.end_headers()
            return None
        start = int(m.group(1)) if (m := re.fullmatch(r"bytes=(\d+)-", handler.headers.get("Range", ""))) else 0
        handler.send_response(206 if start else 200)
        handler.send_header("X-Repo-Commit", self.commit)
        handler.send_header("ETag", f'"{file.etag}"')
        handler.send_header("Content-Length", str(file.size - start))
        if start:
            handler.send_header("Content-Range", f"bytes {start}-{file.size - 1}/{file.size}")
        handler.end_headers()
        if head:
            return None
        cut = self.cuts.get(file.name, [])
        limit = cut.pop(0) if cut else None
        sent = 0
        with file.path.open("rb") as source:
            source.seek(start)
            while chunk := source.read(1 << 20):
                if limit is not None and sent + len(chunk) > limit:
                    handler.wfile.write(chunk[:limit - sent])
                    handler.wfile.flush()
                    handler.close_connection = True
                    handler.connection.shutdown(2)  # the connection drops mid-file
                    return None
                handler.wfile.write(chunk)
                sent += len(chunk)
        return None

    @staticmethod
    def _json(handler: BaseHTTPRequestHandler, body: object) -> None:
        data = json.dumps(body).encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(data)
