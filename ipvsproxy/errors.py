"""The project's own exception tree; foreign errors are mapped to it once, at the boundary.

    IpvsproxyError
    ├── ConfigError          bad flags, unreadable or malformed input files
    ├── StateParseError      an observed-state text (ipvsadm-save) that cannot be read
    ├── WatchError           the Kubernetes API refuses us in a way retrying cannot fix
    ├── ApiUnavailable       `diff` could not reach or understand the Kubernetes API
    └── KernelError          one kernel operation failed
        ├── NotFound         the object to change or delete does not exist
        ├── AlreadyExists    the object to add exists already
        ├── Unsupported      the kernel lacks a scheduler, protocol or feature
        └── KernelUnavailable  the backend cannot be used at all
            └── FallbackRefused  IPVS is not usable and --no-fallback forbids iptables

Imports: the standard library only.
"""


class IpvsproxyError(Exception):
    """Base of every error ipvsproxy raises on purpose."""


class ConfigError(IpvsproxyError):
    """Invalid configuration or input (flags, manifests, state files)."""


class StateParseError(IpvsproxyError):
    """A saved kernel state (the text of `ipvsadm-save -n`) could not be parsed."""


class WatchError(IpvsproxyError):
    """The API server refused a list or watch for good (a wrong token, no RBAC, no such API)."""


class ApiUnavailable(IpvsproxyError):
    """`diff` could not reach the API server, or could not read its reply (refused, bad TLS,
    silent, too large, not JSON, not a list). `run` never raises it: it retries."""


class KernelError(IpvsproxyError):
    """A kernel operation failed; reported per operation, never aborting a whole sync."""


class NotFound(KernelError):
    """The service, destination or address does not exist."""


class AlreadyExists(KernelError):
    """The service, destination or address exists already."""


class Unsupported(KernelError):
    """The kernel does not support what was asked (scheduler module, protocol, flag)."""


class RestoreFailed(KernelError):
    """An `iptables-restore` (`ip6tables-restore`: `version` 6) run failed: what kube-proxy's
    iptables_restore_failures_total counts, per run, however many operations it carried."""

    def __init__(self, message: str, *, version: int) -> None:
        super().__init__(message)
        self.version = version


class KernelUnavailable(KernelError):
    """The backend cannot be used at all (no IPVS, no permission)."""


class FallbackRefused(KernelUnavailable):
    """IPVS is not usable here and the iptables fallback is not allowed (`--no-fallback`)."""
