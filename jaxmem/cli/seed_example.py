"""``jaxmem seed-example``: the write-ups' training example (one post-norm ReLU layer, MSE,
Adam) under a memory policy, in JAX or PyTorch; the example itself is
``jaxmem.compare.seed_example`` (PyTorch imported only for ``--framework torch``)."""

from __future__ import annotations

import argparse

from jaxmem.cli.common import need_jax_backend, need_torch, positive_int, usage_errors
from jaxmem.job import FRAMEWORKS
from jaxmem.policy import POLICIES
from jaxmem.policy_config import parse_policy


def add_parser(sub) -> None:
    p = sub.add_parser(
        "seed-example",
        help="the seeds' training example (one post-norm ReLU layer, MSE, Adam) in JAX or torch",
        description="The example the project grew from: one post-norm ReLU decoder layer "
        "(the `seed` preset: d_model 512, 8 heads, d_ff 2048, no causal mask) on a fixed random "
        "[32, 64, 512] input, MSE against a fixed random target, Adam at lr 1e-4, under a "
        "memory policy.",
    )
    p.add_argument("--framework", choices=FRAMEWORKS, default="jax", help="default jax")
    p.add_argument("--steps", type=positive_int, default=5, help="Adam steps (default 5)")
    p.add_argument("--policy", default="none", help=f"one of {', '.join(POLICIES)}")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    with usage_errors():
        policy = parse_policy(args.policy)
    if args.framework == "torch":
        need_torch("jaxmem seed-example --framework torch")
    else:
        need_jax_backend()
    from jaxmem.compare.seed_example import train

    losses = train(args.framework, args.steps, policy)
    for i, loss in enumerate(losses):
        print(f"step {i}: mse {loss:.6f} ({args.framework}, policy {policy.name})")
    return 0
