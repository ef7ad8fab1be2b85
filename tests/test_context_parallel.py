"""Context parallelism (``--mesh cp=N``, ``jaxmem.step.context``): the balanced layout, the
one-device losses for a GPT and a Llama block (naive and fused attention) under ``cp=2`` and
``fsdp=2,cp=2`` on CPU devices, FSDP's shards over data x context, a bit-identical resume, per
device records, a lost process ending the survivor in one line, and bad meshes refused in one
line before anything compiles."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxmem.compare.tolerances import tolerance
from jaxmem.config import PRESETS, ConfigError
from jaxmem.parallel import ParallelConfig, parse_mesh
from jaxmem.policy import POLICIES
from tests.test_cli_contract import run_cli

WORKER = os.path.join(os.path.dirname(__file__), "parallel_worker.py")
CASES = [
    {"policy": "full", "precision": "fp32", "steps": 3, "cp": 2, "cp_alone": True},
    {  # RoPE following the permuted positions, grouped-query keys gathered, the fused kernel
        "preset": "tiny-llama",
        "attention": "fused",
        "policy": "selective",
        "precision": "fp32",
        "accum": 2,
        "steps": 3,
        "cp": 2,
        "cp_alone": True,
        "ring": True,
    },
    {  # a tensor axis too: fsdp=1,cp=2,tp=2 (heads over tensor, sequence over context)
        "preset": "tiny-llama",
        "attention": "fused",
        "policy": "full",
        "precision": "fp32",
        "steps": 3,
        "cp": 2,
        "tp": 2,
        "ring": True,
    },
]
for case in CASES:
    case["strategies"] = ["fsdp"]


@pytest.fixture(scope="module")
def runs():
    proc = subprocess.run(
        [sys.executable, WORKER, json.dumps(CASES)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_context_parallel_steps_train_as_one_device(runs):
    """cp=2 alone and fsdp=2 x cp=2, for tiny (naive attention) and tiny-llama (fused), and
    fsdp=1 x cp=2 x tp=2 for tiny-llama, the latter two meshes with keys and values all-gathered
    and round a ring (``+ring``): the one-device losses within the data-parallel tolerance (the
    gradients' reductions add in their own order)."""
    tol = tolerance("float32", "data_parallel_loss")
    ran = [sorted(set(row) - {"case"}) for row in runs]
    ring = ["fsdp+ring"]
    assert ran == [["cp", "fsdp", "one_device"], ["cp", "fsdp", *ring, "one_device"]] + [
        ["fsdp", *ring, "one_device"]
    ]
    for row in runs:
        for name in [n for n in ("cp", "fsdp", "fsdp+ring") if n in row]:
            np.testing.assert_allclose(
                row[name]["losses"], row["one_device"]["losses"], **tol.kwargs()
            )


@pytest.mark.slow
def test_fsdp_shards_over_the_data_and_context_devices_together(runs):
    """fsdp=2,cp=2, and fsdp=1,cp=2,tp=2 (FSDP over the 2 context devices, Megatron's split
    over the 2 tensor ones): each of the 4 devices holds about a quarter of the parameters and
    optimizer state (leaves too small to split stay whole); cp=2 alone (dp) holds them whole."""
    for row in runs:
        one = row["one_device"]
        for key in ("params_bytes", "opt_state_bytes"):
            assert row["fsdp"][key] < one[key] / 3, key
            if "cp" in row:
                assert row["cp"][key] == one[key], key


def test_the_balanced_layout_gives_every_device_the_same_causal_work():
    from jaxmem.step.context import balanced_order

    order = balanced_order(16, 4)
    assert sorted(order.tolist()) == list(range(16))
    per_device = order.reshape(4, 4)  # device i holds chunks i and 7 - i of 8
    assert per_device[0].tolist() == [0, 1, 14, 15] and per_device[3].tolist() == [6, 7, 8, 9]
    work = (per_device + 1).sum(axis=1)  # keys each device's queries attend to
    assert len(set(work.tolist())) == 1


@pytest.mark.parametrize("kv_heads", [2])
def test_fused_attention_by_position_equals_the_naive_core_on_a_devices_share(kv_heads):
    """One context device's queries (positions in the balanced order) against every key: the
    blockwise kernel causal by position equals the naive core with the positions' mask, output
    and gradients, in float64 (grouped-query keys too)."""
    import jax
    import jax.numpy as jnp

    from jaxmem.model.decoder import naive_attention
    from jaxmem.model.flash import flash_attention_at
    from jaxmem.step.context import balanced_order

    with jax.enable_x64(True):
        keys = jax.random.split(jax.random.key(0), 3)
        q = jax.random.normal(keys[0], (2, 8, 4, 8), jnp.float64)  # device 1 of cp=2
        k, v = (jax.random.normal(x, (2, 16, kv_heads, 8), jnp.float64) for x in keys[1:])
        q_pos, k_pos = jnp.asarray(balanced_order(16, 2)[8:]), jnp.arange(16)
        grouped = q.reshape(2, 8, kv_heads, 4 // kv_heads, 8) if kv_heads < 4 else q

        def fused(q, k, v):
            return jnp.sum(jnp.sin(flash_attention_at(q, k, v, q_pos, k_pos, 4)))

        def naive(q, k, v):
            g = q.reshape(grouped.shape)
            return jnp.sum(jnp.sin(naive_attention(g, k, v, q_pos[:, None] >= k_pos[None])))

        tol = tolerance("float64", "fused_vs_naive").kwargs()
        for a, b in zip(
            jax.grad(fused, (0, 1, 2))(q, k, v), jax.grad(naive, (0, 1, 2))(q, k, v), strict=True
        ):
            np.testing.assert_allclose(a, b, **tol)
        np.testing.assert_allclose(fused(q, k, v), naive(q, k, v), **tol)


@pytest.fixture(scope="module")
def ring_runs():
    worker = os.path.join(os.path.dirname(__file__), "ring_worker.py")
    proc = subprocess.run([sys.executable, worker], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_ring_and_gathered_attention_equal_the_naive_core_on_the_whole_row(ring_runs):
    """Over 2 and 4 CPU devices in the balanced layout, float64: the ring (keys and values
    passed device to device, each step's work static) and the all-gathered form give the naive
    core's loss and the queries', keys' and values' gradients, elementwise within the table's
    fused-vs-naive tolerance (grouped-query keys; a block that does not divide a chunk)."""
    cases = [row for row in ring_runs if row["case"] != "per_device"]
    assert [row["case"][0] for row in cases] == [2, 4, 4]
    for row in cases:
        for how in ("gather", "ring"):
            assert row[how]["within"] == [True] * 4, (row["case"], how, row[how]["max_error"])


@pytest.mark.slow
def test_the_ring_computes_only_the_blocks_a_causal_mask_leaves_and_never_gathers(ring_runs):
    """cp=4, S=4096, blocks of 256 (jaxpr matmul FLOPs per device, and XLA:CPU's compiled
    temporaries of the gradient): the ring asks for 2 cp + 1 chunk products per device where the
    gathered form computes all 4 cp (9/16 of its FLOPs), and holds one device's keys and values
    at a time instead of the row's (under 60 % of its temporaries)."""
    row = next(row for row in ring_runs if row["case"] == "per_device")
    gather, ring = row["gather"], row["ring"]
    assert ring["flops"] * 16 == gather["flops"] * 9
    assert ring["temp_bytes"] < 0.6 * gather["temp_bytes"], (ring, gather)


def test_a_mesh_with_a_context_axis_reads_and_prints_back():
    assert parse_mesh("cp=2") == ParallelConfig(devices=2, cp=2)
    assert parse_mesh("fsdp=2,cp=2") == ParallelConfig(strategy="fsdp", devices=4, cp=2)
    assert parse_mesh("fsdp=1,cp=2,tp=2") == ParallelConfig(strategy="fsdp", devices=4, tp=2, cp=2)
    for text in ("cp=2", "fsdp=2,cp=2", "fsdp=1,cp=8", "zero1=2,cp=4", "fsdp=2,cp=2,tp=2"):
        assert parse_mesh(text).mesh_text() == text
    assert parse_mesh("fsdp=1,cp=8").shards_params  # FSDP over the context devices alone


@pytest.mark.parametrize(
    "make, fragment",
    [
        (
            lambda: parse_mesh("fsdp=1,cp=2,tp=4").check_model(PRESETS["tiny"], 12),
            "sequence parallelism splits the 12 positions over tp=4 within each of cp=2 shares",
        ),
        (
            lambda: parse_mesh("fsdp=1,cp=2,tp=4").check_model(PRESETS["tiny-llama"], 16),
            "context-parallel attention splits whole key/value heads over the tensor axis",
        ),
        (lambda: parse_mesh("cp=0"), "cp=0 must be a positive device count"),
        (lambda: ParallelConfig(devices=3, cp=2), "devices=3 is not a multiple of tp=1 x cp=2"),
        (lambda: ParallelConfig(cp_attention="ring"), "--cp-attention ring (parallel"),
        (
            lambda: ParallelConfig(devices=2, cp=2, cp_attention="rng"),
            "'rng' (parallel.cp_attention) is not one of gather, ring",
        ),
        (
            lambda: ParallelConfig(devices=2, cp=2, cp_attention="ring").check_model(
                PRESETS["tiny"], 16
            ),
            "--cp-attention ring merges each device's partial softmax",
        ),
    ],
)
def test_bad_context_meshes_are_refused_naming_the_value(make, fragment):
    with pytest.raises(ConfigError) as exc:
        make()
    assert fragment in str(exc.value)


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--seq-len", "30"], "cuts the 30 positions into 2 x cp = 4 equal chunks"),
        (["--stream"], "(context parallelism) with --stream"),
        (["--lora-rank", "4", "--lora-dropout", "0.1"], "with adapter dropout 0.1"),
        (["--mesh", "fsdp=64,cp=2"], "--mesh asks for 128 CPU devices"),
        (["--cp-attention", "ring"], "the model's attention is 'naive': add --attention fused"),
        (["--mesh", "fsdp=2", "--cp-attention", "ring"], "(e.g. --mesh fsdp=2,cp=2)"),
        (
            ["--mesh", "cp=2,tp=2", "--framework", "torch"],
            "use --mesh zero1=1,cp=2,tp=2 or fsdp=1,cp=2,tp=2 (FSDP2)",
        ),
        (
            ["--attention", "fused", "--cp-attention", "ring", "--policy", "mlp"]
            + ["--framework", "torch"],
            "--policy mlp keeps attn_context, attn_lse under --cp-attention ring: torch_ref's "
            "ring attention is one autograd function",
        ),
    ],
)
def test_train_refuses_what_context_parallelism_cannot_run_in_one_line(tmp_path, args, fragment):
    """One line naming the value, exit 2, nothing written, before anything compiles."""
    out = tmp_path / "run"
    base = ["train", "--preset", "tiny", "--batch-size", "4", "--seq-len", "32"]
    mesh = [] if "--mesh" in args else ["--mesh", "cp=2"]
    proc = run_cli(*base, *mesh, *args, "--steps", "1", "--out", str(out), timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and fragment in lines[0], proc.stderr[-2000:]
    assert "compiling" not in proc.stdout and not out.exists()


@pytest.mark.parametrize(
    "args, fragment",
    [
        (
            ["plan", "--budget", "1GiB", "--mesh", "cp=2", "--cp", "4"],
            "--cp 4: [4] do not divide the mesh's 2 device(s)",
        ),
        (
            ["memory", "--frameworks", "jax,torch", "--mesh", "cp=2,tp=2"],
            "torch_ref has no dp (the strategy of a mesh naming none) over a tensor axis "
            "(PyTorch's DDP does not take DTensor parameters); use --mesh zero1=1,cp=2,tp=2 or "
            "fsdp=1,cp=2,tp=2 (FSDP2)",
        ),
    ],
)
def test_commands_refuse_a_context_axis_they_do_not_run_in_one_line(args, fragment):
    """Before anything compiles: one line, exit 2."""
    proc = run_cli(*args, "--preset", "tiny-llama", "--seq-len", "32", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and fragment in lines[0], proc.stderr[-2000:]
    assert "measuring" not in proc.stdout and "compile" not in proc.stdout


def test_torch_runs_a_context_axis_beside_data_and_tensor_axes_not_under_dp_with_tp():
    """torch_ref takes a context axis beside a data axis and beside a tensor axis (FSDP2 over
    the data and context ranks); DDP cannot take a tensor axis's DTensor parameters."""
    from jaxmem.job import torch_mesh_refusal

    cfg = PRESETS["tiny-llama"]
    for mesh in ("cp=2", "fsdp=1,cp=2", "fsdp=2,cp=2", "fsdp=1,cp=2,tp=2", "zero1=2,cp=2,tp=2"):
        assert torch_mesh_refusal(parse_mesh(mesh), cfg) is None, mesh
    line = torch_mesh_refusal(parse_mesh("dp=2,cp=2,tp=2"), cfg)
    assert "use --mesh zero1=2,cp=2,tp=2 or fsdp=2,cp=2,tp=2 (FSDP2)" in line


def test_torch_refuses_a_policy_keeping_attentions_output_under_its_ring_only():
    """What the torch job, its printed command in a plan and its per-rank rows check: a policy
    keeping ``attn_context``/``attn_lse`` is refused under the ring, not under the gather, and
    a policy keeping other tags runs under both."""
    import dataclasses

    from jaxmem.job import (
        JobConfig,
        RunConfig,
        torch_ring_policy_refusal,
        torch_tensor_parallel_refusal,
    )

    cfg = PRESETS["tiny-llama"].replace(attention="fused")
    ring = dataclasses.replace(parse_mesh("cp=2"), cp_attention="ring")
    for mesh, policy, refused in (
        (ring, "mlp", True),
        (ring, "selective", False),
        (ring, "full", False),
        (parse_mesh("cp=2"), "mlp", False),
    ):
        run = RunConfig(batch_size=2, seq_len=32)
        job = JobConfig(
            preset="tiny-llama", model=cfg, parallel=mesh, memory=POLICIES[policy], run=run
        )
        said = torch_tensor_parallel_refusal(job)
        assert said == torch_ring_policy_refusal(mesh, POLICIES[policy])
        assert (said is not None) == refused, (policy, mesh, said)
    assert "--policy mlp keeps attn_context, attn_lse under --cp-attention ring" in (
        torch_ring_policy_refusal(ring, POLICIES["mlp"])
    )


CP_RUN = ["--preset", "tiny-llama", "--batch-size", "2", "--seq-len", "32", "--policy", "full"]


@pytest.mark.slow
def test_a_context_parallel_run_resumes_bit_identically(tmp_path):
    """fsdp=2,cp=2 on 4 CPU devices: 2 steps, then --resume to 4, logs exactly what 4
    uninterrupted steps log."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    args = [*CP_RUN, "--mesh", "fsdp=2,cp=2", "--checkpoint-every", "2"]

    def train(out, *more):
        cmd = [sys.executable, "-m", "jaxmem.cli", "train", "--out", str(out), *more]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [
            json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
        ]

    whole = train(tmp_path / "whole", *args, "--steps", "4")
    train(tmp_path / "halves", *args, "--steps", "2")
    assert train(tmp_path / "halves", "--resume", "--steps", "4") == whole


@pytest.mark.slow
def test_memory_command_plans_context_parallel_records_per_device(tmp_path):
    """``jaxmem memory --mesh cp=2``: the saved activations and FLOPs per device are half the
    one-device step's, and the compiled plan per device is smaller."""
    args = ["memory", *CP_RUN[:6], "--seq-len", "64", "--policies", "none", "--frameworks", "jax"]
    recs = []
    for mesh in ([], ["--mesh", "cp=2"]):
        out = tmp_path / f"{len(mesh)}.json"
        proc = run_cli(*args, *mesh, "--json", str(out), timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        (rec,) = json.loads(out.read_text())
        recs.append(rec)
    one, cp = recs
    assert cp["per_device"] is True and cp["mesh"] == "cp=2"
    assert cp["saved_activation_bytes_device"] == one["saved_activation_bytes_device"] // 2
    assert cp["flops"] == one["flops"] // 2
    assert cp["planned_peak_bytes"] < one["planned_peak_bytes"]
    assert "the sequence split over cp=2" in cp["saved_source"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_lost_process_ends_the_context_parallel_survivor_in_one_line(tmp_path):
    """A 2-process --mesh cp=2 run (one CPU device each: the context axis spans the processes)
    whose process 1 is SIGKILLed after a checkpoint: process 0 exits 1 within seconds in one
    line naming process 1 and the checkpoint, leaving no process behind."""
    from tests.test_parallel import _lose_one, _lost_line, processes_running

    run = tmp_path / "lost"
    args = (*CP_RUN[:4], "--seq-len", "32", "--mesh", "cp=2", "--checkpoint-every", "2")
    survivor, err, took = _lose_one(run, 1, worker=True, args=(*args, "--steps", "200"))
    assert survivor.returncode == 1, err[-3000:]
    assert took < 30, took
    _lost_line(err, 0, "process 1", run)
    assert "Traceback" not in err and not processes_running(str(run))


@pytest.mark.slow
def test_the_long_sequence_composition_trains_as_one_device(tmp_path):
    """cp=2 with every long-sequence tool at once: block inputs in host memory (full-host), the
    MLP and the loss in sequence tiles; 3 steps log the one-device untiled run's losses."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    tools = ["--policy", "full-host", "--mlp-tile-tokens", "8", "--loss-tile-tokens", "16"]

    def train(out, *more):
        cmd = [sys.executable, "-m", "jaxmem.cli", "train", "--out", str(out), *CP_RUN[:6]]
        cmd += ["--steps", "3", *more]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = (out / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line)["loss"] for line in lines]

    one = train(tmp_path / "one", "--policy", "full")
    tol = tolerance("float32", "data_parallel_loss")
    np.testing.assert_allclose(
        train(tmp_path / "cp", *tools, "--mesh", "cp=2"), one, rtol=tol.rtol, atol=tol.atol
    )


_PROGRAM_FACTS = """
import json, os, re, sys
from jaxmem.config import PRESETS
from jaxmem.parallel import ParallelConfig
from jaxmem.policy import POLICIES, LossPolicy
from jaxmem.step.build import build_step
from jaxmem.step.spec import StepSpec

cfg = PRESETS["tiny-llama"].replace(attention="fused", attention_block=16)
out = {}
for name, tiles in {"whole": 0, "tiled": 8}.items():
    policy = POLICIES["full"].replace(mlp_tile_tokens=tiles, loss=LossPolicy(tile_tokens=tiles))
    cp = ParallelConfig(strategy="dp", devices=2, cp=2)
    built, params = build_step(StepSpec(model=cfg, policy=policy, batch=1, seq_len=64, parallel=cp))
    text = built.lower(params).compile().as_text()
    out[name] = {
        "gathers": sorted(re.findall(r"= (\\S+) all-gather\\(", text)),
        "stacked_masks": sorted(set(re.findall(r"pred\\[\\d+(?:,\\d+){4}\\]", text))),
        "mlp_rows": sorted(set(re.findall(r"f32\\[(\\d+),160\\]", text))),
    }
print(json.dumps(out))
"""


@pytest.mark.slow
def test_context_parallel_tiles_and_attention_stay_on_each_devices_share():
    """cp=2 on 2 CPU devices, compiled: the MLP and loss tiles loop over each device's own
    columns (no all-gather beyond the keys' and values', every MLP matmul of a tile's 8 local
    rows, not 2 x 8 gathered ones), and the blockwise attention keeps no per-block stack of
    position masks."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, "-c", _PROGRAM_FACTS], capture_output=True, text=True, env=env,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert facts["tiled"]["gathers"] == facts["whole"]["gathers"]  # the keys and values only
    rows = facts["tiled"]["mlp_rows"]  # ([64, 160]: the weight gradients' shape)
    assert "8" in rows and "16" not in rows and "32" in facts["whole"]["mlp_rows"]
    assert facts["whole"]["stacked_masks"] == facts["tiled"]["stacked_masks"] == []


def test_records_name_the_attention_kernel_a_context_axis_runs():
    """Under a context axis the blockwise kernel runs whatever the model's (cuDNN on a GPU):
    by position on all-gathered keys, or per chunk round a ring."""
    from jaxmem.planner.records import _kernel_label
    from jaxmem.step.spec import StepSpec

    cfg = PRESETS["tiny-llama"].replace(attention="fused")
    spec = StepSpec(
        model=cfg, policy=POLICIES["full"], batch=2, seq_len=32, parallel=parse_mesh("cp=2")
    )
    assert _kernel_label(spec, "cudnn").startswith("blockwise (jaxmem.model.flash) by position")
    ring = spec.replace(parallel=ParallelConfig(devices=2, cp=2, cp_attention="ring"))
    assert _kernel_label(ring, "cudnn").startswith("blockwise (jaxmem.model.flash) per chunk")
    assert _kernel_label(spec.replace(parallel=ParallelConfig()), "cudnn").startswith("cuDNN")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_cuda_ring_kernels_merge_and_differentiate_a_share_of_any_even_length(dtype):
    """torch_ref's ring on CUDA (no GPU here: meta tensors, shapes only): a rank's 2 x 20
    positions (not a multiple of the memory-efficient kernel's 32-row log-sum-exp) through
    PyTorch's merge of a whole step and a partial one (the second half of the queries), then
    each step's backward, grouped-query keys: every shape is the queries', keys' and values'."""
    import torch
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    from torch_ref.context import ring_kernel

    kernel = ring_kernel(torch.device("cuda"), getattr(torch, dtype))
    meta = {"device": "meta", "dtype": getattr(torch, dtype)}
    q = torch.empty(1, 4, 40, 8, **meta)
    kv_heads = 4 if kernel.repeat_kv else 2
    k = v = torch.empty(1, kv_heads, 40, 8, **meta)
    merger = cp._SDPAMerger(True, seq_dim=2)
    steps = [(q, False, True), (q.chunk(2, dim=2)[1], True, False)]  # (queries, partial, causal)
    rests = []
    for queries, partial, causal in steps:
        out, lse, *rest = kernel.forward(queries, k, v, is_causal=causal, **kernel.forward_kwargs)
        merger.step(out, lse, partial)
        rests.append(dict(zip(kernel.rest, rest, strict=False)))
    out, lse = merger.results()
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    for (queries, partial, causal), rest in zip(steps, rests, strict=True):
        half = (lambda t: t.chunk(2, dim=2)[1]) if partial else (lambda t: t)
        grads = kernel.backward(
            query=queries, key=k, value=v, out=half(out), logsumexp=half(lse).contiguous(),
            is_causal=causal, **{kernel.grad_out_name: half(out)}, **kernel.backward_kwargs,
            **rest,
        )  # fmt: skip
        assert [g.shape for g in grads[:3]] == [queries.shape, k.shape, v.shape]


def _ring_steps_of_rank_one(q, k, v, dout, kernel):
    """Rank 1 of a 2-rank ring on one device, as PyTorch's templates step it: queries chunks 1
    and 2 of 4, their own keys causally, then rank 0's first chunk (load balance), merged by
    log-sum-exp; each step's backward from the merged output. Returns out, dq, dk, dv."""
    import torch
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    chunks = lambda t: t.chunk(4, dim=2)  # noqa: E731
    mine = lambda t: torch.cat(chunks(t)[1:3], dim=2)  # noqa: E731
    steps = [(mine(k), mine(v), True), (chunks(k)[0], chunks(v)[0], False)]
    merger, rests = cp._SDPAMerger(q.dtype != torch.float64, seq_dim=2), []
    for ks, vs, causal in steps:
        out, lse, *rest = kernel.forward(mine(q), ks, vs, is_causal=causal, **kernel.forward_kwargs)
        merger.step(out, lse, False)
        rests.append(dict(zip(kernel.rest, rest, strict=False)))
    out, lse = merger.results()
    dq, dk, dv = 0, torch.zeros_like(k), torch.zeros_like(v)
    for (ks, vs, causal), rest, at in zip(steps, rests, ((1, 3), (0, 1)), strict=True):
        g = kernel.backward(
            query=mine(q), key=ks, value=vs, out=out, logsumexp=lse, is_causal=causal,
            **{kernel.grad_out_name: mine(dout)}, **kernel.backward_kwargs, **rest,
        )  # fmt: skip
        n = k.shape[2] // 4
        dq = dq + g[0]
        dk[:, :, at[0] * n : at[1] * n] += g[1]
        dv[:, :, at[0] * n : at[1] * n] += g[2]
    return out, dq, dk, dv


@pytest.mark.parametrize(
    "device, dtype",
    [
        ("cpu", "float64"),
        pytest.param("cuda", "float32", marks=pytest.mark.gpu),
        pytest.param("cuda", "bfloat16", marks=pytest.mark.gpu),
    ],
)
def test_the_rings_kernel_steps_merge_to_whole_sequence_attention(device, dtype):
    """The kernel torch_ref's ring runs on ``device`` (CPU flash; on a GPU, flash for bf16 and
    memory-efficient for fp32), stepped and merged as PyTorch's ring does for one rank, gives
    whole-sequence SDPA's output and gradients at that rank's positions (20 each: not a
    multiple of the memory-efficient kernel's 32-row log-sum-exp), in the same dtype on the
    same device: float64 and fp32 within the table's fused-vs-naive tolerance, bf16 through
    their errors against float64 (the fused kernel's error bound)."""
    import torch
    import torch.nn.functional as F

    from torch_ref.context import ring_kernel

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("GPU-only: PyTorch sees no CUDA device")
    torch_dtype = getattr(torch, dtype)
    kernel = ring_kernel(torch.device(device), torch_dtype)
    gen = torch.Generator().manual_seed(0)
    kv_heads = 4 if kernel.repeat_kv else 2
    shapes = ((1, 4, 80, 16), (1, kv_heads, 80, 16), (1, kv_heads, 80, 16), (1, 4, 80, 16))
    exact = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]

    def whole(q, k, v, dout):
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        mask = torch.zeros_like(dout)
        mask[:, :, 20:60] = 1  # the loss reads rank 1's rows only
        out.backward(dout * mask)
        return out.detach()[:, :, 20:60], q.grad[:, :, 20:60], k.grad, v.grad

    inputs = [t.to(device, torch_dtype) for t in exact]
    got = [t.double().cpu() for t in _ring_steps_of_rank_one(*inputs, kernel)]
    fused = [t.double().cpu() for t in whole(*inputs)]  # one kernel over the whole sequence
    if dtype != "bfloat16":  # two summation orders of the same softmax
        tol = tolerance(dtype, "fused_vs_naive").kwargs()
        for a, b in zip(got, fused, strict=True):
            np.testing.assert_allclose(a, b, **tol)
        return
    reference = whole(*exact)
    tol = tolerance("bfloat16", "fused_vs_naive_error")
    for a, f, b in zip(got, fused, reference, strict=True):
        err, bound = (float((x - b).norm() / b.norm()) for x in (a, f))
        assert err <= bound * (1 + tol.rtol) + tol.atol, (err, bound)
