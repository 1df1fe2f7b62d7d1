"""Every fenced code block of the user documentation runs as written.

The pages: README.md, server/README.md, client/README.md, docker/README.md,
benchmarks/README.md and docs/*.md. Each fenced block is one test (id `page:line`), run in page
order:

- ```python runs in a fresh `python` process; ```bash (or ```sh / ```shell) runs under
  `bash -euo pipefail`. Both run on the CPU (CUDA_VISIBLE_DEVICES is empty), in a scratch
  directory of their own page, with the repository's packages importable and its console
  scripts (`moe-gemm-server`, `moe-gemm-client`) on PATH.
- A live `moe-gemm-server` (CPU, torch backend, no keys) serves every block. Blocks address it
  as the docs do, http://127.0.0.1:8000 (that address in a block is pointed at the test's
  server, and MOE_GEMM_BASE_URL, which the client reads, is set to it). Each page starts with
  no weight sets; the blocks of one page share the server's state in page order, as a reader
  following the page would.
- Any other language (```text, ```json, ...) is not code and is not run. A block without a
  language fails: say what it is.
- A block that cannot run here (it needs a GPU, docker, a cluster, installs packages, or
  starts a server that runs until stopped) carries a visible marker on the line before it:
  `<!-- doc-test: skip (why) -->`. It is reported as a skipped test with that reason. A marker
  that does not stand right before a block, or says anything else, fails.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = ["README.md", "server/README.md", "client/README.md", "docker/README.md",
         "benchmarks/README.md", *sorted(str(p.relative_to(REPO))
                                         for p in (REPO / "docs").glob("*.md"))]
RUN = {"python": "python", "bash": "bash", "sh": "bash", "shell": "bash"}
DOC_ADDRESS = re.compile(r"(127\.0\.0\.1|localhost):8000\b")
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\s]*)[^`]*$")
MARKER = re.compile(r"^\s*<!--\s*doc-test:(?P<body>.*?)-->\s*$")
SKIP = re.compile(r"\s*skip\s+\((?P<why>[^)]+)\)\s*")
BLOCK_TIMEOUT_S = 180


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    skip: str | None  # the marker's reason, if the block is marked


def parse_page(page: str, text: str) -> list[Block]:
    """The fenced blocks of a markdown page; ValueError for a misplaced or unknown marker."""
    lines = text.splitlines()
    blocks: list[Block] = []
    pending: tuple[int, str] | None = None  # (line, reason) of a skip marker not yet used
    i = 0
    while i < len(lines):
        m = MARKER.match(lines[i])
        if m:
            s = SKIP.fullmatch(m.group("body"))
            if s is None:
                raise ValueError(f"{page}:{i + 1}: unknown doc-test marker {lines[i].strip()!r};"
                                 " the one marker is <!-- doc-test: skip (why) -->")
            if pending is not None:
                raise ValueError(f"{page}:{pending[0]}: doc-test marker not followed by a block")
            pending = (i + 1, s.group("why").strip())
            i += 1
            continue
        f = FENCE.match(lines[i])
        if f is None:
            if pending is not None and lines[i].strip():
                raise ValueError(f"{page}:{pending[0]}: doc-test marker not right before a "
                                 "block")
            i += 1
            continue
        fence, indent = f.group("fence"), len(f.group("indent"))
        start, body = i, []
        i += 1
        while i < len(lines) and not re.match(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}"
                                              r"[ \t]*$", lines[i]):
            line = lines[i]
            body.append(line[indent:] if line[:indent].strip() == "" else line.lstrip())
            i += 1
        if i == len(lines):
            raise ValueError(f"{page}:{start + 1}: code block never closed")
        i += 1
        blocks.append(Block(page, start + 1, f.group("info").lower(), "\n".join(body) + "\n",
                            pending[1] if pending else None))
        pending = None
    if pending is not None:
        raise ValueError(f"{page}:{pending[0]}: doc-test marker not followed by a block")
    return blocks


def _collect() -> list[Block]:
    out: list[Block] = []
    for page in PAGES:
        path = REPO / page
        if path.exists():
            out.extend(parse_page(page, path.read_text()))
    return out


BLOCKS = _collect()


# ----------------------------------------------------------------------------- the live server

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_GEMM_")}
    paths = [str(REPO), str(REPO / "server"), str(REPO / "client")]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    # `python`, `moe-gemm-server` and `moe-gemm-client` are this interpreter's.
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env["CUDA_VISIBLE_DEVICES"] = ""
    # An unmarked install command fails instead of changing the environment the suite runs in.
    env["PIP_NO_INDEX"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("docs-server")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = root / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moe_gemm_server", "--host", "127.0.0.1", "--port", str(port),
             "--data-dir", str(root / "data"), "--device", "cpu", "--backend", "torch"],
            stdout=log, stderr=subprocess.STDOUT, env=_env())
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited {proc.returncode}: {log_path.read_text()}")
            try:
                if httpx.get(f"{url}/v2/health/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready in 60 s: {log_path.read_text()}")
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def workspaces(tmp_path_factory: pytest.TempPathFactory, server: str) -> Iterator[dict]:
    """page -> its scratch directory; the first use of a page empties the server's weights."""
    made: dict[str, Path] = {}

    def get(page: str) -> Path:
        if page not in made:
            for w in httpx.get(f"{server}/v1/weights", timeout=30).json()["weights"]:
                assert httpx.delete(f"{server}/v1/weights/{w['name']}",
                                    timeout=30).status_code == 200
            made[page] = tmp_path_factory.mktemp(re.sub(r"\W", "_", page))
        return made[page]

    yield get  # type: ignore[misc]


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b.page}:{b.line}" for b in BLOCKS])
def test_doc_block(block: Block, server: str, workspaces) -> None:
    if block.skip is not None:
        pytest.skip(f"marked in {block.page}: {block.skip}")
    if not block.lang:
        pytest.fail(f"{block.page}:{block.line}: a code block without a language; label it "
                    "```python or ```bash (run), or ```text (not run)")
    if block.lang not in RUN:
        pytest.skip(f"{block.lang} block: not code")
    port = server.rsplit(":", 1)[1]
    code = DOC_ADDRESS.sub(f"127.0.0.1:{port}", block.code)
    cwd = workspaces(block.page)
    if RUN[block.lang] == "python":
        cmd = [sys.executable, "-c", code]
    else:
        cmd = [shutil.which("bash") or "/bin/bash", "-euo", "pipefail", "-c", code]
    out = subprocess.run(cmd, cwd=cwd, env=_env(MOE_GEMM_BASE_URL=server),
                         capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    assert out.returncode == 0, (
        f"{block.page}:{block.line} ({block.lang}) exited {out.returncode}\n--- block\n"
        f"{block.code}--- stdout\n{out.stdout[-3000:]}\n--- stderr\n{out.stderr[-6000:]}")


def test_the_parser_honours_markers() -> None:
    page = ("text\n<!-- doc-test: skip (needs docker) -->\n```bash\ndocker ps\n```\n\n"
            "```python\nprint(1)\n```\n~~~text\nout\n~~~\n")
    a, b, c = parse_page("p.md", page)
    assert (a.lang, a.skip, a.line, a.code) == ("bash", "needs docker", 3, "docker ps\n")
    assert (b.lang, b.skip, b.code) == ("python", None, "print(1)\n")
    assert (c.lang, c.skip) == ("text", None)
    indented = "1. step\n\n   ```python\n   x = 1\n   print(x)\n   ```\n"
    (d,) = parse_page("p.md", indented)
    assert d.code == "x = 1\nprint(x)\n"
    for bad in ("<!-- doc-test: skip -->\n```bash\nls\n```\n",
                "<!-- doc-test: run (x) -->\n```bash\nls\n```\n",
                "<!-- doc-test: skip (x) -->\nsome prose\n```bash\nls\n```\n",
                "<!-- doc-test: skip (x) -->\n",
                "```bash\nls\n"):
        with pytest.raises(ValueError):
            parse_page("p.md", bad)
