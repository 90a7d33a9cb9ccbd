"""The ``variantgen`` command: validate, render, precompile, probe, list, clear, check, demo,
doctor, explain.

Errors variantgen raises on purpose (and ValueErrors from bad settings) are printed as one
``error: ...`` message on stderr with exit status 1; usage errors exit with 2 (click). Output
piped into a reader that stops early (``| head``) ends the command quietly.

This module holds the group and its options; the commands live in cli_build (precompile, list,
clear), cli_inspect (validate, specs, render, explain, doctor) and cli_run (check, probe, demo).
"""

from __future__ import annotations

import errno
import logging
import os
from typing import Any

import click

from .._version import __version__
from ..core import env
from ..core.errors import VariantgenError
from .cli_build import clear, list_cmd, precompile
from .cli_inspect import doctor, explain, render, specs_cmd, validate
from .cli_options import FOLDER
from .cli_run import check, demo, probe_cmd

log = logging.getLogger("variantgen.tools.cli")

LOG_LEVELS = ("debug", "info", "warning", "error")


class _Group(click.Group):
    """Turns deliberate errors into one clear line instead of a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (VariantgenError, ValueError, OSError) as e:
            if isinstance(e, OSError) and e.errno == errno.EPIPE:
                raise  # the reader went away (`| head`): click's main ends quietly
            text = str(e) if not isinstance(e, OSError) or not e.strerror else f"{e.strerror}: {e.filename}"
            click.echo(f"error: {text}", err=True)
            ctx.exit(1)


# ----------------------------------------------------------------------------- group


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="variantgen")
@click.option("--log-level", type=click.Choice(LOG_LEVELS, case_sensitive=False), default=None,
              help="Logging level of the variantgen.* loggers (default: warning).")
@click.option("--cache-dir", type=FOLDER, default=None,
              help="Module cache root (sets VARIANTGEN_CACHE_DIR for this run).")
def main(log_level: str | None, cache_dir: str | None) -> None:
    """YAML attention-variant specs -> cached FlashInfer kernels.

    SPEC arguments are spec files or names of the specs shipped with variantgen
    (`variantgen specs` lists them), e.g. `variantgen demo mm_prefix`.
    """
    level = getattr(logging, (log_level or "warning").upper())
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")  # no-op if configured
    if log_level:
        logging.getLogger("variantgen").setLevel(level)
    if cache_dir:
        os.environ["VARIANTGEN_CACHE_DIR"] = str(cache_dir)
    env.reload_settings()


for _command in (validate, specs_cmd, render, explain, doctor, precompile, list_cmd, clear, check, probe_cmd, demo):
    main.add_command(_command)


if __name__ == "__main__":  # pragma: no cover
    main()
