"""How the nftables firewall talks to nftables: libnftables in this process, else the `nft`
tool. Both take the same text (`nft -f` syntax) and answer the same JSON.

Owns: `NftRunner` (the interface), `Libnftables` (the library through ctypes, opened by
`Libnftables.open()`, None where it cannot be loaded) and `NftTool` (the `nft` program, run by
`Commands`, so also behind `ip netns exec`).

Why the library: a pass that changes one Service writes a few set elements; as a process,
`nft` costs about 2 ms natively and 0.15 s under the VM's emulation (exec, dynamic linking),
in the library the same transaction takes 0.05 ms natively (measured: one element,
`add element`, median of 100). It is the library the tool itself is a thin front to, from
the `nftables` package (Debian: libnftables1, a dependency of `nftables`), with a C API stable
since 0.9 (`libnftables(3)`); python3-nftables wraps the same calls, for Debian's system
interpreter only. The library works in the network namespace of the thread that calls it.

Imports: host.commands, errors, the standard library.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Protocol

from ipvsproxy.errors import KernelError, KernelUnavailable
from ipvsproxy.host.commands import Commands

NFT_CTX_OUTPUT_JSON = 1 << 4  # libnftables.h, enum nft_output_flags
MISSING = "No such file or directory"  # nft's words for a table that is not there


class NftRunner(Protocol):
    name: str  # "libnftables" | "nft"

    def run(self, script: str, *, check: bool = False) -> None:
        """Commit `script` as one transaction (`check`: let the kernel check it, commit
        nothing). KernelError with nft's message when it is refused."""

    def list_json(self, *words: str) -> str:
        """`nft -j list WORDS...`'s output. KernelError (MISSING in it when the object is
        not there)."""

    def close(self) -> None: ...


class NftTool:
    """The `nft` program."""

    name = "nft"

    def __init__(self, commands: Commands) -> None:
        self.commands = commands

    def run(self, script: str, *, check: bool = False) -> None:
        self.commands.run(["nft", *(["-c"] if check else []), "-f", "-"], stdin=script)

    def list_json(self, *words: str) -> str:
        return self.commands.run(["nft", "-j", "list", *words])

    def close(self) -> None:
        pass


class Libnftables:
    """libnftables, for the firewall's life (not shared between threads): two contexts, one
    that writes and one that lists. A context keeps what it last read of the ruleset as its
    cache; one that listed the table holds every element, and a write on it then starts by
    reading them all again (28 ms instead of 0.2 ms for one element at 10,000 Services,
    measured): the writer never lists."""

    name = "libnftables"

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self._ctx: int | None = self._context()
        self._lister: int | None = self._context()
        lib.nft_ctx_output_set_flags(self._lister, NFT_CTX_OUTPUT_JSON)

    def _context(self) -> int:
        ctx: int | None = self._lib.nft_ctx_new(0)
        if not ctx:
            raise KernelUnavailable("libnftables: no context")
        self._lib.nft_ctx_buffer_output(ctx)
        self._lib.nft_ctx_buffer_error(ctx)
        return ctx

    @classmethod
    def open(cls) -> Libnftables | None:
        """The library, or None where it is not installed (then the tool is used)."""
        name = ctypes.util.find_library("nftables") or "libnftables.so.1"
        try:
            lib = ctypes.CDLL(name, use_errno=True)
        except OSError:
            return None
        _declare(lib)
        return cls(lib)

    def run(self, script: str, *, check: bool = False) -> None:
        self._lib.nft_ctx_set_dry_run(self._ctx, check)
        try:
            self._command(script)
        finally:
            self._lib.nft_ctx_set_dry_run(self._ctx, False)

    def list_json(self, *words: str) -> str:
        return self._command("list " + " ".join(words), self._lister)

    def _command(self, text: str, ctx: int | None = None) -> str:
        ctx = ctx or self._ctx
        if ctx is None:
            raise KernelError("libnftables: closed")
        code = self._lib.nft_run_cmd_from_buffer(ctx, text.encode())
        output = (self._lib.nft_ctx_get_output_buffer(ctx) or b"").decode()
        error = (self._lib.nft_ctx_get_error_buffer(ctx) or b"").decode()
        if code:
            detail = error.strip().replace("\n", "; ") or f"status {code}"
            raise KernelError(f"nft failed: {detail}")
        return output

    def close(self) -> None:
        for ctx in (self._ctx, self._lister):
            if ctx is not None:
                self._lib.nft_ctx_free(ctx)
        self._ctx = self._lister = None


def _declare(lib: ctypes.CDLL) -> None:
    """The C signatures of the calls used (libnftables(3))."""
    ctx = ctypes.c_void_p
    lib.nft_ctx_new.argtypes, lib.nft_ctx_new.restype = [ctypes.c_uint32], ctx
    lib.nft_ctx_free.argtypes, lib.nft_ctx_free.restype = [ctx], None
    for name in ("nft_ctx_buffer_output", "nft_ctx_buffer_error"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [ctx], ctypes.c_int
    for name in ("nft_ctx_get_output_buffer", "nft_ctx_get_error_buffer"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [ctx], ctypes.c_char_p
    lib.nft_ctx_set_dry_run.argtypes, lib.nft_ctx_set_dry_run.restype = [ctx, ctypes.c_bool], None
    lib.nft_ctx_output_set_flags.argtypes = [ctx, ctypes.c_uint]
    lib.nft_ctx_output_set_flags.restype = None
    lib.nft_run_cmd_from_buffer.argtypes = [ctx, ctypes.c_char_p]
    lib.nft_run_cmd_from_buffer.restype = ctypes.c_int
