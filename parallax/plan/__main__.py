"""``python -m parallax.plan MODEL --batch REF --loss REF [...]``: the plan as a table (or JSON).

MODEL, ``--batch`` and ``--loss`` are ``package.module:name`` references (a model object or a
function returning one; arrays or ``jax.ShapeDtypeStruct`` s or a function returning them;
the loss function). Run it from the directory that holds your package, or set PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import sys

from parallax.models.remat_policy import NAMED_POLICIES, named_policy
from parallax.parallel.names import parse_strategy
from parallax.plan import plan
from parallax.plan.candidates import DEFAULT_STRATEGIES, with_options
from parallax.pricing.hardware import known


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallax.plan", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="package.module:name of the model (or of a function that returns it)")
    parser.add_argument("--batch", required=True, help="package.module:name of one global batch (or a function)")
    parser.add_argument("--loss", required=True, help="package.module:name of loss_fn(model, batch)")
    parser.add_argument("--optimizer", default="adamw", help="adamw (default), adam, sgd, or package.module:name")
    parser.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES),
                        help="comma-separated: dp, fsdp, tp, pp, cp, ep joined by + with optional sizes, or auto "
                             "(every mesh strategy='auto' prices, and its pick; "
                             f"default {','.join(DEFAULT_STRATEGIES)})")
    parser.add_argument("--min-weight-size", type=int, default=None,
                        help="FSDP option: params with at most this many elements stay replicated (default 2**18)")
    parser.add_argument("--split", default=None, choices=("largest", "output", "input", "auto"),
                        help="FSDP option: the dim each param is split on (default largest)")
    parser.add_argument("--offload", default=None, choices=("optimizer", "optimizer+params"),
                        help="keep the optimizer state (and the params) in host memory between steps")
    parser.add_argument("--remat", default=None,
                        help="comma-separated module class names whose activations are recomputed, e.g. Block")
    parser.add_argument("--remat-policy", default=None, choices=sorted(NAMED_POLICIES),
                        help="what the --remat modules keep instead of recomputing")
    parser.add_argument("--compile", default=None, choices=("auto", "jit", "shard_map"),
                        help="the compile path of every step (default: the cost model's pick, as compile='auto')")
    parser.add_argument("--devices", default=None, help="comma-separated device counts (default: this machine's)")
    parser.add_argument("--budget", default=None, help="comma-separated memory budgets per device, e.g. 16GB,80GB")
    parser.add_argument("--target", default=None, help="the backend the plan is for: gpu, tpu or cpu")
    parser.add_argument("--hardware", default=None,
                        help=f"the accelerator to plan for ({', '.join(known())}): step time, tokens/s, MFU per row; "
                             "its memory is the default budget and its hosts the topology; a TPU is compiled by the "
                             "TPU compiler (needs libtpu: pip install 'parallax-flax[tpu]')")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--plot", default=None, metavar="PATH",
                        help="also draw the plan (mesh and bytes per device by part) to PATH (.png, .svg); "
                             "needs matplotlib")
    args = parser.parse_args(argv)
    try:
        devices = None if args.devices is None else [int(n) for n in args.devices.split(",")]
    except ValueError:
        parser.error(f"--devices {args.devices!r}: give comma-separated integers, e.g. 8,64")
    options = {name: value for name, value in (("min_weight_size", args.min_weight_size), ("split", args.split))
               if value is not None}
    try:
        strategies = [s if s == "auto" else parse_strategy(s) for s in args.strategies.split(",") if s]
        with_fsdp = [s != "auto" and any(part.gathers_params for part in s.parts) for s in strategies]
        strategies = [with_options(s, **options) if fsdp else s for s, fsdp in zip(strategies, with_fsdp)]
        if options and not any(with_fsdp):
            raise ValueError(f"--{next(iter(options)).replace('_', '-')} is an FSDP option, and none of the strategies "
                             f"{args.strategies!r} has an FSDP part (add fsdp, e.g. --strategies dp,fsdp).")
        remat = tuple(name for name in (args.remat or "").split(",") if name)
        if args.remat_policy and not remat:
            raise ValueError("--remat-policy applies to the module classes named by --remat (e.g. --remat Block).")
        step_options = {"offload": args.offload, "remat": remat + ((named_policy(args.remat_policy),)
                                                                    if args.remat_policy else ())}
        if args.compile:
            step_options["compile"] = args.compile
        report = plan(args.model, args.optimizer, args.batch, loss_fn=args.loss, strategies=strategies, devices=devices,
                      memory_budget=None if args.budget is None else args.budget.split(","), target=args.target,
                      hardware=args.hardware, **step_options)
    except ValueError as err:
        print(f"python -m parallax.plan: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:  # a planning subprocess that died: why, and what to try
        print(f"python -m parallax.plan: {err}", file=sys.stderr)
        return 1
    print(json.dumps(report.as_dict(), indent=1) if args.json else report)
    if args.plot:
        try:
            report.figure(args.plot)
        except (ImportError, ValueError) as err:
            print(f"python -m parallax.plan: --plot {args.plot}: {err}", file=sys.stderr)
            return 2
        print(f"figure: {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
