"""The sections of `--help` and the option decorator that files an option under one:
kube-proxy's flags, ipvsproxy's own, HTTP, logging, and kube-proxy's flags that mean nothing
here.

Imports: click (only in ipvsproxy.cli).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])

# The sections of `--help`, in this order; an option names its own (`SectionOption`)
KUBE_PROXY = "kube-proxy compatible options"
OWN = "ipvsproxy options"
HTTP = "HTTP options (metrics, healthz)"
LOGGING = "Logging options"
IGNORED = "kube-proxy flags accepted with no meaning here (warned of unless kube-proxy's default)"
SECTIONS = (KUBE_PROXY, OWN, HTTP, LOGGING, IGNORED)


class SectionOption(click.Option):
    """An option that says under which heading of `--help` it is listed."""

    def __init__(self, *args: Any, section: str = OWN, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.section = section


def format_sections(command: click.Command, ctx: click.Context, out: click.HelpFormatter) -> None:
    """The options of `command`, one titled list per section (click has no option groups)."""
    rows: dict[str, list[tuple[str, str]]] = {section: [] for section in SECTIONS}
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is not None:
            rows[getattr(param, "section", OWN)].append(record)
    for title, records in rows.items():
        if records:
            with out.section(title):
                out.write_dl(records)


class SectionArgument(click.Argument):
    """An argument that, as every parameter, names its section (listed in the usage line)."""

    def __init__(self, *args: Any, section: str = OWN, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.section = section


class Command(click.Command):
    """A command whose `--help` lists its options by section."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        format_sections(self, ctx, formatter)


class Group(click.Group):
    """The group: its own options by section, then its commands (each a `Command`)."""

    command_class = Command

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        format_sections(self, ctx, formatter)
        self.format_commands(ctx, formatter)


def option(*decls: str, section: str, **kwargs: Any) -> Callable[[F], F]:
    return click.option(*decls, cls=SectionOption, section=section, **kwargs)


def kube_proxy_flag(*decls: str, help: str, section: str = KUBE_PROXY) -> Callable[[F], F]:
    """A boolean flag as kube-proxy's (pflag's) are: `--name`, `--name=true|false`."""
    return option(*decls, section=section, type=click.BOOL, is_flag=False, flag_value=True,
                  default=False, metavar="[=true|false]", help=help)  # fmt: skip


def apply(func: F, options: Sequence[Callable[[F], F]]) -> F:
    for decorate in reversed(options):
        func = decorate(func)
    return func
