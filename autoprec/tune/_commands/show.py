"""`autoprec show`: a policy file for a person."""

from __future__ import annotations

import argparse

from autoprec.policy import load_policy
from autoprec.tune._commands._shared import Verb, print_json
from autoprec.tune._report._show import show_policy


def _show_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("policy", help="path to a policy.json")
    p.add_argument("--markdown", action="store_true", help="markdown tables")


def cmd_show(args: argparse.Namespace) -> int:
    policy = load_policy(args.policy)
    if args.json:
        print_json(args, policy.to_dict(), indent=2)
    else:
        print(show_policy(policy, markdown=args.markdown))
    return 0


SHOW = Verb("show", "print a policy file for a person", _show_arguments, cmd_show)
