"""The `onecat` command line. Each command parses flags and calls one library function.

Library code never imports this module. Every command turns an OnecatError into a clear
message on stderr and exit status 1.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import click

from onecat.errors import OnecatError


def _friendly(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a command so that OnecatError ends it with a message and exit status 1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except OnecatError as exc:
            click.secho(f"error: {exc}", fg="red", err=True)
            sys.exit(1)

    return wrapper


@click.group()
@click.version_option(package_name="onecat")
def main() -> None:
    """onecat: 4-bit Qwen3.5 on Tesla V100 GPUs."""


# --- quantize / eval (onecat.quantize) -----------------------------------------------


# --- pack (onecat.pack) ----------------------------------------------------------------


# --- build-kernels / tune / doctor (onecat.kernels) --------------------------------------


# --- serve / generate (onecat.runtime) ---------------------------------------------------


if __name__ == "__main__":
    main()
