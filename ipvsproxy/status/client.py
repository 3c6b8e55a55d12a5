"""The CLI's side of `/status`: find the agent, ask it, check what it answers.

Owns: `agent_url()` (the metrics bind address as a URL a local client can reach), `fetch()`
and `AgentUnreachable`. No proxy is used (the agent is on this host), the answer is bounded
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
