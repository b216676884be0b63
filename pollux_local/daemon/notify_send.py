"""The job-side sender of a job's notifications: runs as the job's owner, never as the daemon.

The daemon (:mod:`pollux_local.daemon.notify`) starts ``python -c <this file's source>`` as the
owner of a job that ended and writes one JSON object to its stdin::

    {"title": "...", "body": "...", "failed": false, "state": "succeeded",
     "urls": ["ntfy://..."], "on": "end", "job": {"id": "12", "name": "...", ...}}

``urls``/``on`` are the job's own destinations (``submit --notify URL --notify-on ...``).  This
process adds the owner's standing destinations from ``~/.config/pollux-local/notify.toml``::

    urls = ["ntfy://ntfy.sh/my-topic", "mailto://me:app-password@gmail.com"]
    on = "failure"            # or "end" (the default)

It reads that file itself, with the owner's own permissions: a link to a file the owner cannot
read is refused by the kernel, exactly as it would be for any of the owner's programs.

Each ``http://`` and ``https://`` URL is POSTed as JSON with urllib; any other is sent through
``apprise`` when it is installed; without it, ``json://`` and ``jsons://`` URLs are POSTed as
JSON with urllib too and any other URL is reported as needing apprise.  Each failure is one
line on stderr naming the destination by its number and scheme (and host, for web hooks and
mail: a URL may hold a password or token); the exit status is 1 when any destination failed,
else 0.

Stdlib only and Python 3.8 syntax: the daemon may run it with the system's interpreter when its
own is not one every user can run.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.parse
import urllib.request
from typing import Any

#: The owner's standing destinations, relative to their home.
USER_FILE = os.path.join(".config", "pollux-local", "notify.toml")
#: The most bytes of the per-user file read.
USER_FILE_LIMIT = 64 * 1024
#: Seconds one destination may take (the daemon kills the whole sender after its own
#: ``notify.SEND_TIMEOUT_S``).
SEND_TIMEOUT_S = 8.0
#: URL schemes posted with urllib when apprise is not installed: scheme -> the HTTP scheme used.
WEBHOOK_SCHEMES = {"json": "http", "jsons": "https", "http": "http", "https": "https"}


def redact(url: str) -> str:
    """``url`` as it may be logged.  For web hooks and mail: its scheme and host, no user,
    password, path or query; for any other scheme only the scheme, since many (``ntfy://topic``,
    ``tgram://bot-token/chat``, ``slack://tokens``) keep a secret where the host would be."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or ""
    except ValueError:
        return "<malformed url>"
    if parts.scheme in WEBHOOK_SCHEMES or parts.scheme in ("mailto", "mailtos"):
        return f"{parts.scheme}://{host}"
    return f"{parts.scheme}://..."


def read_user_file(home: str) -> tuple[list[str], str]:
    """``(urls, on)`` of the owner's ``notify.toml`` under ``home`` (``([], "end")`` when there
    is none); ``ValueError`` with one line naming the file and the problem otherwise."""
    path = os.path.join(home, USER_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return [], "end"
    except OSError as error:
        raise ValueError(f"{path}: cannot open: {error.strerror}") from None
    try:
        with os.fdopen(fd, "rb") as handle:
            raw = handle.read(USER_FILE_LIMIT + 1)
    except OSError as error:
        raise ValueError(f"{path}: cannot read: {error.strerror}") from None
    if len(raw) > USER_FILE_LIMIT:
        raise ValueError(f"{path}: larger than {USER_FILE_LIMIT} bytes")
    return parse_user_file(raw, path)


def parse_user_file(raw: bytes, path: str) -> tuple[list[str], str]:
    """The ``urls`` and ``on`` of a per-user file's bytes (``ValueError``: one line naming the
    file and the problem)."""
    try:
        import tomllib as toml  # Python 3.11+
    except ImportError:
        try:
            import tomli as toml  # type: ignore[no-redef]
        except ImportError:
            raise ValueError(f"{path}: reading TOML needs Python 3.11 or tomli") from None
    try:
        data = toml.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, toml.TOMLDecodeError) as error:
        raise ValueError(f"{path}: not valid TOML: {error}") from None
    unknown = sorted(set(data) - {"urls", "on"})
    if unknown:
        raise ValueError(f"{path}: unknown key {unknown[0]!r} (known: urls, on)")
    urls = data.get("urls", [])
    if isinstance(urls, str):
        urls = [urls]
    if not isinstance(urls, list) or not all(isinstance(url, str) and url for url in urls):
        raise ValueError(f"{path}: urls must be a list of URLs")
    on = data.get("on", "end")
    if on not in ("end", "failure"):
        raise ValueError(f"{path}: on must be 'end' or 'failure', got {on!r}")
    return list(urls), on


def wanted(on: str, failed: bool) -> bool:
    """Whether destinations asking for ``on`` are told of this end."""
    return on == "end" or failed


def destinations(payload: dict[str, Any], user_urls: list[str], user_on: str) -> list[str]:
    """The job's own URLs and the owner's standing ones that want this end, each once."""
    failed = bool(payload.get("failed"))
    chosen: list[str] = []
    if wanted(str(payload.get("on", "end")), failed):
        chosen.extend(str(url) for url in payload.get("urls") or [])
    if wanted(user_on, failed):
        chosen.extend(user_urls)
    return list(dict.fromkeys(chosen))


def send_apprise(apprise: Any, url: str, title: str, body: str, failed: bool) -> None:
    sender = apprise.Apprise()
    if not sender.add(url):
        raise ValueError("apprise does not understand this URL")
    kind = apprise.NotifyType.FAILURE if failed else apprise.NotifyType.SUCCESS
    if not sender.notify(title=title, body=body, notify_type=kind):
        raise ValueError("apprise could not deliver it")


def send_webhook(url: str, payload: dict[str, Any]) -> None:
    """POST the notification as JSON to a ``json://``/``jsons://``/``http(s)://`` URL."""
    parts = urllib.parse.urlsplit(url)
    target = urllib.parse.urlunsplit(
        (WEBHOOK_SCHEMES[parts.scheme], parts.netloc, parts.path, parts.query, "")
    )
    body = {
        "version": "1.0",
        "title": payload.get("title", ""),
        "message": payload.get("body", ""),
        "type": "failure" if payload.get("failed") else "success",
        "job": payload.get("job", {}),
    }
    request = urllib.request.Request(
        target,
        data=json.dumps(body).encode("utf-8"),
        headers={"Content-Type": "application/json", "User-Agent": "pollux-local"},
        method="POST",
    )
    if parts.username is not None:
        import base64

        token = (
            f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        )
        request.add_header("Authorization", "Basic " + base64.b64encode(token.encode()).decode())
        # the credentials are in the header; the URL sent must not carry them
        netloc = parts.hostname or ""
        if parts.port is not None:
            netloc += f":{parts.port}"
        request.full_url = urllib.parse.urlunsplit(
            (WEBHOOK_SCHEMES[parts.scheme], netloc, parts.path, parts.query, "")
        )
    with urllib.request.urlopen(request, timeout=SEND_TIMEOUT_S) as reply:
        reply.read(65536)


def send_all(payload: dict[str, Any], urls: list[str]) -> list[str]:
    """Send to every URL; one line per failure."""
    try:
        import apprise
    except ImportError:
        apprise = None
    title, body = str(payload.get("title", "")), str(payload.get("body", ""))
    failures: list[str] = []
    for number, url in enumerate(urls, 1):
        scheme = url.split("://", 1)[0].lower()
        try:
            if scheme in ("http", "https") or (apprise is None and scheme in WEBHOOK_SCHEMES):
                send_webhook(url, payload)
            elif apprise is not None:
                send_apprise(apprise, url, title, body, bool(payload.get("failed")))
            else:
                raise ValueError("apprise not installed (pip install 'pollux-local[notify]')")
        except Exception as error:  # noqa: BLE001 - every failure is reported, none stops the rest
            reason = str(error) or type(error).__name__
            failures.append(f"destination {number} ({redact(url)}): {reason}")
    return failures


def main() -> int:
    # run with ``-c`` from the owner's home: nothing there is imported in place of a module
    sys.path[:] = [entry for entry in sys.path if entry not in ("", ".")]
    try:
        payload = json.loads(sys.stdin.read(1024 * 1024))
        if not isinstance(payload, dict):
            raise ValueError("not an object")
    except ValueError as error:
        print(f"notification payload is not JSON: {error}", file=sys.stderr)
        return 1
    home = os.environ.get("HOME", "/")
    try:
        os.chdir(home)
    except OSError:
        os.chdir("/")
    failures: list[str] = []
    try:
        user_urls, user_on = read_user_file(home)
    except ValueError as error:
        failures.append(str(error))
        user_urls, user_on = [], "end"
    failures.extend(send_all(payload, destinations(payload, user_urls, user_on)))
    for line in failures:
        print(line, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
