"""The console script ``shoal-run``: answers ``--help`` and argument errors from the parser
alone, then hands the command to `shoal.experiments.runner.cli`.

`cli` imports JAX, Flax, Optax and orbax at module level (seconds); this module imports
only `shoal.experiments.runner.arguments`, so that asking for help costs a fraction of that.
"""

from __future__ import annotations

from shoal.experiments.runner.arguments import build_parser


def main(argv: list[str] | None = None) -> int:
    """Run ``shoal-run`` with ``argv`` (None: ``sys.argv[1:]``, as a command).

    Args:
      argv: the arguments after the program name; None when started as a command.

    Returns:
      the exit status of `shoal.experiments.runner.cli.main`. ``-h``/``--help`` and
      arguments argparse rejects raise ``SystemExit`` here, before JAX is imported.
    """
    # Parsed again by cli.main: parsing is cheap and without side effects, and cli.main
    # keeps its own handling (argv None there means a command that may restart itself).
    build_parser().parse_args(argv)
    if argv is None:  # a command: restart with the heap kept now, before the imports below
        from shoal.experiments.runner.malloc import RUNNER_DEFAULT, reexec_with_tunables

        reexec_with_tunables(default=RUNNER_DEFAULT)
    from shoal.experiments.runner import cli

    return cli.main(argv)
