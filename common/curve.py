"""CurveZMQ on the project's sockets: a run's keys, who may connect, and who a peer is.

A run's keys live in one folder (mode 0700; every secret file 0600), made by `python -m
launch.keys RUN_DIR` or by the launchers, which hand its path to every role in the environment
(`CONVEYOR_KEYS`), never on a command line or in a world-readable file:

    server.pub / server.secret     the services' key pair (the buffer's and the weight-sync service's)
    <name>.pub / <name>.secret     one pair per client identity: `learner`, `scorer`, `admin`, and
                                   one per generator, named after its worker id (`gen-0`, ...)

A process is its key's name (`CONVEYOR_KEY_NAME`, else the role's default name); a client whose
key is not there yet makes it (a generator added while the run goes on), since anyone who can
write the folder is trusted already. The name says the role (`role_of`): `learner*`, `gen-*` or
`generator*`, `scorer*`, `admin*`.

A service's sockets are CURVE servers (`common/zap.py`); a ZAP handler (one per ZeroMQ context, in a thread)
admits a peer only if its public key is one of the folder's and its role may use that socket
(`Guard(policy)`: {socket name: roles}); any other peer gets no connection at all, counted in
`Guard.refused` by socket. Each message then carries its sender's name as ZeroMQ's `User-Id`
property (`Guard.who(frame)`), so a service can check what a role may ask (only the learner sets
the version, a generator acts on its own leases only).

When it is on (`mode`): "on", "off", or "auto" = on exactly when the service binds anything but
loopback (127.0.0.0/8, ::1, localhost). A service in CURVE mode without a key folder refuses to
start, naming the command that makes one. Clients follow the folder: with `CONVEYOR_KEYS` set
they speak CURVE, without it plain TCP.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BeforeValidator

KEYS_ENV = "CONVEYOR_KEYS"
NAME_ENV = "CONVEYOR_KEY_NAME"
SERVER = "server"
ROLES = ("learner", "generator", "scorer", "admin")
CLIENT_NAMES = ("learner", "scorer", "admin")  # made with the folder; generators make their own
MODES = ("auto", "on", "off")
# a config key's type: YAML reads a bare `on` / `off` as a boolean, which means the same here
Mode = Annotated[Literal["auto", "on", "off"],
                 BeforeValidator(lambda v: ("on" if v else "off") if isinstance(v, bool) else v)]
MAKE_KEYS = "python -m launch.keys RUN_DIR"


class KeyFolderError(RuntimeError):
    """A key folder that is missing, unsafe or incomplete (the message says which and how to fix it)."""


# --------------------------------------------------------------------------------------------
# the folder


def make_keys(folder: str | Path, names: tuple[str, ...] = CLIENT_NAMES) -> Path:
    """The key folder at `folder` with the server's pair and one pair per name (existing pairs are
    kept, so a resumed run keeps its keys)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    for name in (SERVER, *names):
        ensure_pair(folder, name)
    return folder


def ensure_pair(folder: Path, name: str) -> tuple[bytes, bytes]:
    """(public, secret) z85 keys of `name`, made first if the folder has none."""
    check_name(name)
    pub, sec = folder / f"{name}.pub", folder / f"{name}.secret"
    if not sec.exists():
        import zmq

        public, secret = zmq.curve_keypair()
        tmp = folder / f".{name}.secret.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secret + b"\n")
        pub.write_bytes(public + b"\n")
        os.replace(tmp, sec)  # (the secret last: a pair is complete once its secret is there)
    return read_key(pub), read_key(sec)


def check_name(name: str) -> str:
    if not name or len(name) > 128 or not all(c.isalnum() or c in "-_." for c in name) or name[0] == ".":
        raise KeyFolderError(f"key name {name!r}: use 1-128 letters, digits, '-', '_' or '.', not starting with '.'")
    return name


def role_of(name: str) -> str | None:
    """The role a key's name says: learner, generator, scorer or admin (None: no role; refused)."""
    for role, prefixes in (("learner", ("learner",)), ("generator", ("gen-", "generator")),
                           ("scorer", ("scorer",)), ("admin", ("admin",))):
        if name.startswith(prefixes):
            return role
    return None


def role_refusal(request: str, who: str | None, allowed: tuple[str, ...]) -> str:
    """Why the key named `who` may not make `request` (a message's name), whose roles are `allowed`;
    "" when it may. The one rule both services apply to each request when CURVE is on."""
    role = role_of(who) if who else None
    if role in allowed:
        return ""
    return (f"{request} is for the {' or '.join(allowed) or 'nobody'}; this peer's key is {who or 'unknown'} "
            f"({role or 'no role'})")


def read_key(path: Path) -> bytes:
    key = path.read_bytes().strip()
    if len(key) != 40:
        raise KeyFolderError(f"{path}: not a z85 CURVE key (40 characters)")
    return key


def keys_folder(required_by: str = "") -> Path | None:
    """The run's key folder from `CONVEYOR_KEYS` (None if unset), checked to be private."""
    value = os.environ.get(KEYS_ENV, "")
    if not value:
        if required_by:
            raise KeyFolderError(f"{required_by} speaks CurveZMQ but {KEYS_ENV} is not set: make the run's keys with "
                            f"`{MAKE_KEYS}` and set {KEYS_ENV}=RUN_DIR/keys (the launchers do both)")
        return None
    folder = Path(value)
    if not (folder / f"{SERVER}.pub").exists():
        raise KeyFolderError(f"{KEYS_ENV}={value}: no {SERVER}.pub there; make the keys with `{MAKE_KEYS}`")
    mode = folder.stat().st_mode & 0o777
    if mode & 0o077:
        raise KeyFolderError(f"{KEYS_ENV}={value} is readable by others (mode {mode:o}): chmod 700 it")
    return folder


# --------------------------------------------------------------------------------------------
# clients


def client_options(default_name: str, folder: Path | None = None) -> dict[int, bytes]:
    """Socket options that make a client socket speak CURVE as this process's identity
    (`CONVEYOR_KEY_NAME`, else `default_name`); {} when the run has no key folder."""
    folder = folder or keys_folder()
    if folder is None:
        return {}
    import zmq

    name = os.environ.get(NAME_ENV) or default_name
    public, secret = ensure_pair(folder, name)
    return {zmq.CURVE_SERVERKEY: read_key(folder / f"{SERVER}.pub"), zmq.CURVE_PUBLICKEY: public,
            zmq.CURVE_SECRETKEY: secret}


def default_identity(name: str) -> None:
    """This process's key name is `name` unless the launcher named it (`CONVEYOR_KEY_NAME`)."""
    os.environ.setdefault(NAME_ENV, check_name(name))


def apply(sock, options: dict[int, bytes]):
    """`sock` with `options` (from `client_options`) set."""
    for opt, value in options.items():
        sock.setsockopt(opt, value)
    return sock


# --------------------------------------------------------------------------------------------
# services


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and `localhost`; a wildcard (0.0.0.0, *) or any other name is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def curve_on(mode: str, host: str) -> bool:
    if mode not in MODES:
        raise ValueError(f"curve mode {mode!r}: expected one of {', '.join(MODES)}")
    return mode == "on" or (mode == "auto" and not is_loopback(host))
