"""Write meshplan/stacks/megatron_flags.txt: every ``--flag`` Megatron-LM's training parser
takes at one commit (names only, as data).

    python tools/megatron_flags.py MEGATRON_LM_CHECKOUT COMMIT DATE

The checkout is Megatron-LM at COMMIT (e.g. ``git archive COMMIT megatron | tar -x``). Its
``megatron/training/arguments.py`` ``add_megatron_arguments`` is run on an empty argparse
parser and the option strings of every action are listed: many flags are generated from
megatron-core's config dataclasses (``argument_utils.ArgumentGroupFactory``), so a text
search of arguments.py would miss them. Megatron-LM's main branch needs Python >= 3.12
(``typing.override``); on 3.11 ``typing_extensions.override`` stands in for it (the parser
only names it).
"""

import argparse
import sys
import typing
import warnings


def main(checkout: str, commit: str, date: str) -> None:
    import typing_extensions

    warnings.filterwarnings("ignore")
    typing.override = getattr(typing, "override", typing_extensions.override)
    sys.path.insert(0, checkout)
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    flags = sorted({s for a in parser._actions for s in a.option_strings if s.startswith("--")})
    flags.remove("--help")
    out = "meshplan/stacks/megatron_flags.txt"
    with open(out, "w", encoding="utf-8") as f:
        f.write(f"# Megatron-LM training flags (megatron/training/arguments.py "
                f"add_megatron_arguments)\n# commit {commit} ({date}), main branch; "
                f"{len(flags)} flags; written by tools/megatron_flags.py\n")
        f.write("\n".join(flags) + "\n")
    print(f"wrote {out}: {len(flags)} flags")


if __name__ == "__main__":
    main(*sys.argv[1:4])
