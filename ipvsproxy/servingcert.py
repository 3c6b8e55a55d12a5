"""The secure metrics port's TLS: the server context from `--tls-cert-file` and
`--tls-private-key-file`, or from a self-signed pair made at start (as kube-scheduler and
kube-controller-manager do without a certificate).

Owns `server_context()` and `self_signed()`. The self-signed pair is made by the `openssl`
binary (Debian's, in the image: no Python dependency for it), an EC P-256 key and a
certificate valid for a year naming `localhost`, 127.0.0.1 and the given host names and
addresses; openssl writes both to a pipe, and they are put in anonymous memory files
(memfd, mode 0600) that ssl loads by name once and that are closed then: the private key
never lands on disk. A scraper of a self-signed port checks nothing (`insecureSkipVerify`), as for
kube-scheduler's; give a certificate your CA signs to have it verified.

Imports: errors, the standard library.
"""

from __future__ import annotations

import ipaddress
import os
import re
import ssl
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from ipvsproxy.errors import ConfigError

DAYS = 365
_BLOCK = re.compile(rb"-----BEGIN ([A-Z ]+)-----.*?-----END \1-----\n?", re.DOTALL)


def server_context(
    cert_file: Path | None, key_file: Path | None, *, names: Sequence[str] = ()
) -> ssl.SSLContext:
    """A TLS server context (TLS 1.2 at least) for the given pair, or a self-signed one for
    `names` when neither file is given; a ConfigError line for a missing half or a pair
    that cannot be loaded."""
    if (cert_file is None) != (key_file is None):
        raise ConfigError("--tls-cert-file and --tls-private-key-file go together: give both")
    if cert_file is None or key_file is None:
        cert, key = self_signed(names)
        fds = [_memory_file(cert), _memory_file(key)]
        cert_path, key_path = (f"/proc/self/fd/{fd}" for fd in fds)
        where = "the self-signed certificate"
    else:
        fds = []
        cert_path, key_path = str(cert_file), str(key_file)
        where = f"--tls-cert-file {cert_file} / --tls-private-key-file {key_file}"
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert_path, key_path)  # read once: the memory files can go
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load {where}: {exc.strerror or exc}") from exc
    finally:
        for fd in fds:
            os.close(fd)
    return context


def self_signed(names: Sequence[str] = ()) -> tuple[bytes, bytes]:
    """(certificate PEM, private key PEM): a self-signed pair for localhost, 127.0.0.1 and
    `names` (host names or addresses), made by `openssl req`."""
    alt = ["DNS:localhost", "IP:127.0.0.1"]
    for name in names:
        try:
            entry = f"IP:{ipaddress.ip_address(name)}"
        except ValueError:
            entry = f"DNS:{name}"
        if name and entry not in alt and "," not in name:
            alt.append(entry)
    command = [
        "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-nodes", "-days", str(DAYS), "-subj", f"/CN=ipvsproxy@{int(time.time())}",
        "-addext", "subjectAltName=" + ",".join(alt),
        "-addext", "basicConstraints=critical,CA:FALSE",
        "-addext", "keyUsage=critical,digitalSignature",
        "-addext", "extendedKeyUsage=serverAuth",
        "-keyout", "/dev/stdout", "-out", "/dev/stdout",
    ]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(
            f"cannot make a self-signed certificate (openssl: {exc}): give --tls-cert-file "
            "and --tls-private-key-file"
        ) from exc
    blocks = {m.group(1): m.group(0) for m in _BLOCK.finditer(done.stdout)}
    cert, key = blocks.get(b"CERTIFICATE"), blocks.get(b"PRIVATE KEY")
    if done.returncode != 0 or cert is None or key is None:
        why = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no pair"]
        raise ConfigError(f"cannot make a self-signed certificate: openssl: {why[0]}")
    return cert, key


def _memory_file(data: bytes) -> int:
    """An anonymous file (memfd, mode 0600) holding `data`, its descriptor."""
    try:
        fd = os.memfd_create("ipvsproxy-serving", os.MFD_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"cannot keep the serving key in memory: memfd_create: {exc}") from exc
    os.fchmod(fd, 0o600)
    with open(fd, "wb", closefd=False) as memory:
        memory.write(data)
    return fd
