"""``python -m parallax.plan MODEL --batch REF --loss REF [...]``: the plan as a table (or JSON).

MODEL, ``--batch`` and ``--loss`` are ``package.module:name`` references (a model object or a
function returning one; arrays or ``jax.ShapeDtypeStruct`` s or a function returning them;
the loss function). Run it from the directory that holds your package, or set PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import sys

from parallax.plan import plan
from parallax.plan.candidates import DEFAULT_STRATEGIES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallax.plan", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="package.module:name of the model (or of a function that returns it)")
    parser.add_argument("--batch", required=True, help="package.module:name of one global batch (or a function)")
    parser.add_argument("--loss", required=True, help="package.module:name of loss_fn(model, batch)")
    parser.add_argument("--optimizer", default="adamw", help="adamw (default), adam, sgd, or package.module:name")
    parser.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES),
                        help="comma-separated: dp, fsdp, tp joined by + with optional sizes (default "
                             f"{','.join(DEFAULT_STRATEGIES)})")
    parser.add_argument("--devices", default=None, help="comma-separated device counts (default: this machine's)")
    parser.add_argument("--budget", default=None, help="comma-separated memory budgets per device, e.g. 16GB,80GB")
    parser.add_argument("--target", default=None, help="the backend the plan is for: gpu, tpu or cpu")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = parser.parse_args(argv)
    try:
        devices = None if args.devices is None else [int(n) for n in args.devices.split(",")]
    except ValueError:
        parser.error(f"--devices {args.devices!r}: give comma-separated integers, e.g. 8,64")
    try:
        report = plan(args.model, args.optimizer, args.batch, loss_fn=args.loss,
                      strategies=[s for s in args.strategies.split(",") if s], devices=devices,
                      memory_budget=None if args.budget is None else args.budget.split(","), target=args.target)
    except ValueError as err:
        print(f"python -m parallax.plan: {err}", file=sys.stderr)
        return 2
    print(json.dumps(report.as_dict(), indent=1) if args.json else report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
