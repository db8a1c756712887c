"""The per-server secret that proves a request to `verifier` or `drafter` comes from the
`speculative` model of the same server.

Those two models hold every sequence's state and act on any correlation id they are given
(step it, read its hidden states, END it), so they must not answer clients. The
orchestrator puts this token in the parameters of each BLS call; they refuse a request
without it.

Where it lives: the three models' stubs are children of one `tritonserver` process. The
first model to load writes a random token to `<private dir>/server-<pid>-<start time>.token`
(that process's id and start time: a restarted server gets a new token); the others read
it. The private directory is `$TRITONSPEC_RUNTIME_DIR`, else `<tmp>/tritonspec-<uid>`,
mode 0700 and ours, or the load fails. Nothing a client can reach holds it: config.pbtxt
parameters would not do, Triton serves them on `/v2/models/<name>/config`. The same works
under `tritonspec serve`, a plain `tritonserver --model-repository model_repository` and a
read-only repository (docker-compose mounts it so).
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import stat
import tempfile
from pathlib import Path

TOKEN_PARAMETER = "tritonspec_token"


class PeerTokenError(RuntimeError):
    """The token cannot be kept privately (a shared or foreign directory, a bad file)."""


def token_dir() -> Path:
    base = os.environ.get("TRITONSPEC_RUNTIME_DIR")
    path = Path(base) if base else Path(tempfile.gettempdir()) / f"tritonspec-{os.getuid()}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_private(path, "directory")
    return path


def _check_private(path: Path, what: str) -> None:
    # Someone else's file or directory could hand us a token they know.
    info = path.lstat()
    if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077 or stat.S_ISLNK(info.st_mode):
        raise PeerTokenError(
            f"{path}: the {what} holding the internal token must be owned by uid {os.getuid()} "
            "with no group or other access (chmod 700 / 600), or set TRITONSPEC_RUNTIME_DIR "
            "to a private directory"
        )


def _process(pid: int) -> tuple[str, int, int]:
    """(name, parent pid, start time in clock ticks) from /proc/<pid>/stat."""
    text = Path(f"/proc/{pid}/stat").read_text()
    name = text[text.index("(") + 1 : text.rindex(")")]
    fields = text[text.rindex(")") + 2 :].split()
    return name, int(fields[1]), int(fields[19])


def server_process() -> tuple[int, int]:
    """(pid, start time) of the tritonserver that runs this stub: the nearest ancestor named
    so, or the parent (a stub is its direct child)."""
    parent = os.getppid()
    pid = parent
    while pid > 1:
        name, ppid, start = _process(pid)
        if name == "tritonserver":
            return pid, start
        pid = ppid
    return parent, _process(parent)[2]


def _read(path: Path) -> str:
    _check_private(path, "file")
    token = path.read_text().strip()
    if len(token) != 64 or not all(c in "0123456789abcdef" for c in token):
        raise PeerTokenError(f"{path} does not hold a token; delete it and reload the models")
    return token


def server_token() -> str:
    """This server's token, created by the first model that asks."""
    directory = token_dir()
    pid, start = server_process()
    path = directory / f"server-{pid}-{start}.token"
    if not path.exists():
        tmp = directory / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}"  # unique per caller, threads too
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        try:
            os.link(tmp, path)  # atomic: one model's token wins, complete, and the others read it
            _remove_stale(directory)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    return _read(path)


def _remove_stale(directory: Path) -> None:
    """Tokens of servers that are gone (their process exited or its pid was reused)."""
    for path in directory.glob("server-*-*.token"):
        _, pid, start = path.stem.split("-")
        try:
            alive = _process(int(pid))[2] == int(start)
        except (OSError, ValueError):
            alive = False
        if not alive:
            path.unlink(missing_ok=True)


def with_token(parameters: dict | None, token: str) -> dict:
    """BLS request parameters carrying the token."""
    return {**(parameters or {}), TOKEN_PARAMETER: token}


def has_token(parameters_json: str, token: str) -> bool:
    """Whether a request's parameters carry this server's token."""
    try:
        given = json.loads(parameters_json or "{}").get(TOKEN_PARAMETER)
    except (ValueError, AttributeError):
        return False
    return isinstance(given, str) and hmac.compare_digest(given.encode(), token.encode())
