"""``jaxmem capture-target``: on a GPU machine, write its XLA target config, for
``--target FILE`` on machines without that GPU."""

from __future__ import annotations

import argparse

from jaxmem.cli.common import UsageError, check_writable, need_jax_backend, usage_errors


def add_parser(sub) -> None:
    p = sub.add_parser(
        "capture-target",
        help="on a GPU machine: write its XLA target config, for --target FILE elsewhere",
        description="Writes the GpuTargetConfig of this machine's first GPU (what XLA compiles "
        "for) as a text file; `jaxmem memory --target FILE` then plans for that GPU on any "
        "machine with jaxmem[gpu-plan]. Needs a CUDA GPU visible to JAX.",
    )
    p.add_argument("--out", required=True, metavar="FILE.txtpb", help="where to write it")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import os

    from jaxmem.files import write_atomic

    if not args.out.endswith((".txtpb", ".pbtxt", ".textproto")):
        raise UsageError(f"--out {args.out}: give a .txtpb file name")
    check_writable(args.out, "--out")
    need_jax_backend()
    from jaxmem.memory.gpu_plan import capture_target_config
    from jaxmem.memory.targets import parse_target

    with usage_errors():
        text = capture_target_config()
        target = parse_target(os.path.splitext(os.path.basename(args.out))[0], text, args.out)
    write_atomic(args.out, text)
    print(
        f"wrote {args.out}: {target.description}, {target.device_memory_bytes:,} bytes of device "
        f"memory; plan for it anywhere with --target {args.out}"
    )
    return 0
