"""What the ``meshplan`` subcommands share: the --engine choices, argument types that refuse
bad numbers in one line, the one-line argparse errors, and loading the model a spec names.
"""

from __future__ import annotations

import argparse

from meshplan.checks import check_batch_and_seq
from meshplan.costmodel.runtime_profiles import PROFILES

# --engine of plan and estimate: "auto", or any runtime profile the cost model prices
# (meshplan's engines, then the stacks it prices and exports but does not run)
ENGINE_CHOICES = ("auto",) + PROFILES

EXIT_USER_ERROR = 2


def load_model_and_graph(args):
    """The model spec, the model loaded at --batch (and --seq, for token models) on the meta
    device with its example call (specs.LoadedModel), and its traced graph."""
    from meshplan.specs import parse_model_spec

    spec = parse_model_spec(args.model)
    loaded = spec.load(args.batch, args.seq, device="meta")
    if not loaded.bundle:
        check_batch_and_seq(loaded.model, args.batch, args.seq)
    return spec, loaded, loaded.trace(spec.name)


class OneLineParser(argparse.ArgumentParser):
    """argparse, with its errors as one line (no usage block) and exit code 2;
    ``last_error`` keeps the line for ``--json``'s error document."""

    last_error = ""

    def error(self, message: str):
        OneLineParser.last_error = f"{self.prog}: {message}"
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive(cast):
    def check(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text} must be positive")
        return value
    check.__name__ = cast.__name__  # argparse names the type in its messages
    return check


POSITIVE_INT, POSITIVE_FLOAT = _positive(int), _positive(float)
