"""The sections of `--help` and the option decorator that files an option under one:
kube-proxy's flags, ipvsproxy's own, HTTP, logging, and kube-proxy's flags that mean nothing
here. The group shows click's usage errors as every other error: one line.

Imports: click (only in ipvsproxy.cli), logs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import IO, Any, TypeVar

import click

from ipvsproxy import logs

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


class OneLineUsageError(click.UsageError):
    """A usage error shown as our other errors are: `ipvsproxy: error: --flag: why (see
    'ipvsproxy run -h')`, one line (JSON under --log-format json), exit status 2."""

    def __init__(self, error: click.UsageError) -> None:
        message = error.format_message()
        param = getattr(error, "param", None)
        if isinstance(error, click.BadParameter) and isinstance(param, click.Option):
            message = f"{param.opts[0]}: {error.message}"  # click: "Invalid value for ..."
        super().__init__(message, error.ctx)  # exit status 2, as every UsageError's

    def show(self, file: IO[Any] | None = None) -> None:
        text = self.message.rstrip(".")
        if text[1:2].islower():  # click's "No such option ...": ours start in lower case
            text = text[0].lower() + text[1:]
        if self.ctx is not None:
            text += f" (see '{self.ctx.command_path} -h')"
        click.echo(logs.error_line(text), file=file, err=file is None)


@contextmanager
def one_line_usage() -> Iterator[None]:
    """Raise click's usage errors (a bad value, an unknown option or command) as
    `OneLineUsageError`; `--help` and a group called bare (its help) are left as they are."""
    try:
        yield
    except (OneLineUsageError, click.exceptions.NoArgsIsHelpError):
        raise
    except click.UsageError as exc:
        raise OneLineUsageError(exc) from None


class Group(click.Group):
    """The group: its own options by section, then its commands (each a `Command`); usage
    errors, its own and its commands', in one line (`OneLineUsageError`)."""

    command_class = Command

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        format_sections(self, ctx, formatter)
        self.format_commands(ctx, formatter)

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        with one_line_usage():  # the group's own options
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx: click.Context) -> Any:
        with one_line_usage():  # the command's name, options and body
            return super().invoke(ctx)


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
