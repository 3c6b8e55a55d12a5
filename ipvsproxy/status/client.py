"""The CLI's side of the agent's endpoints: find the agent, ask it, check what it answers.

Owns: `agent_url()` (a bind address as a URL a local client can reach), `fetch()` (the
`/status` document), `waiting_for()` (what `/readyz` says the agent still waits for) and
`AgentUnreachable`. No proxy is used (the agent is on this host), the answer is bounded
(`MAX_BODY`) and must be a Status document of this apiVersion.

Imports: status.document, errors, the standard library.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import quote

from ipvsproxy.errors import ConfigError, IpvsproxyError
from ipvsproxy.status.document import API_VERSION, KIND, Selector

MAX_BODY = 64 * 1024 * 1024  # bytes of one document (1000 Service ports of 100 endpoints: ~40 MB)


class AgentUnreachable(IpvsproxyError):
    """Nothing answers at the agent's address (no agent running there)."""


def agent_url(host: str, port: int) -> str:
    """`http://HOST:PORT` for a bind address; a wildcard one is reached on loopback."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def fetch(url: str, selector: Selector | None, *, timeout: float = 10.0) -> dict[str, Any]:
    """The agent's document (for one Service with `selector`)."""
    target = url.rstrip("/") + "/status"
    if selector is not None:
        target += "?service=" + quote(str(selector), safe="/:")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(target, timeout=timeout) as answer:
            body = answer.read(MAX_BODY + 1)
    except urllib.error.HTTPError as exc:
        text = exc.read(500).decode("utf-8", "replace").strip().splitlines()
        line = text[0] if text else exc.reason
        if exc.code == 400:
            raise ConfigError(f"{line}") from exc
        raise IpvsproxyError(f"{target}: {exc.code} {line}") from exc
    except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
        reason = getattr(exc, "reason", exc)
        raise AgentUnreachable(f"no agent answers at {url}: {reason}") from exc
    except ValueError as exc:  # a malformed URL
        raise ConfigError(f"--agent {url!r}: {exc}") from exc
    if len(body) > MAX_BODY:
        raise IpvsproxyError(f"{target}: the answer is larger than {MAX_BODY} bytes")
    try:
        doc = json.loads(body)
    except ValueError as exc:
        raise IpvsproxyError(f"{target}: not JSON: {exc}") from exc
    if not isinstance(doc, dict) or (doc.get("apiVersion"), doc.get("kind")) != (API_VERSION, KIND):
        raise IpvsproxyError(f"{target}: not a {API_VERSION} {KIND} document")
    return doc


def waiting_for(url: str, *, timeout: float = 5.0) -> str | None:
    """None when the agent at `url` (its health port) answers `/readyz` with 200: a full
    pass has completed since it started, so this node is served by it. Else what it waits
    for, in words (the agent's own `waitingFor`, or why nothing answered)."""
    target = url.rstrip("/") + "/readyz"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(target, timeout=timeout):
            return None
    except urllib.error.HTTPError as exc:
        try:
            body = json.loads(exc.read(64 * 1024))
        except ValueError:
            body = {}
        if not isinstance(body, dict):
            body = {}
        if "waitingFor" in body:
            return str(body["waitingFor"])
        if body.get("nodeEligible") is False:
            return "this node to be eligible (its Node object is missing or being deleted)"
        return f"its passes to complete on time ({target} answers {exc.code})"
    except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
        reason = getattr(exc, "reason", exc)
        return f"an ipvsproxy agent to answer at {target} ({reason})"
