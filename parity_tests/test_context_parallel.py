"""torch_ref's context parallelism (``torch_ref.context``: the extension; PyTorch's stock
``context_parallel`` does not run on CPU, see its docstring) under torchrun on gloo: each context
rank holds chunks i and 2 cp - 1 - i of a row's 2 cp, keys and values all-gathered over its
context group. ``cp=2`` (2 ranks, DDP over both) and ``fsdp=2,cp=2`` (4 ranks, FSDP2 over a
2 x 2 data x context mesh: each data rank's rows split over its 2 context ranks) train as one
device does for a GPT block (naive attention, learned positions) and a Llama block (RoPE at the
permuted positions, grouped-query keys, SDPA with a positional mask); ``jaxmem train --framework
torch`` over ``cp=2`` and ``fsdp=2,cp=2`` logs JAX's losses and resumes bit for bit, and ends in
one line when a rank is lost.

And JAX's step over the same meshes from the same initial weights on the same batches logs the
same losses (bound ``adamw_loss``, as the sharded parity suite compares the frameworks).

Run by pytest, this file launches itself under torchrun once per rank count; under torchrun
(``__main__``, the meshes as arguments), every rank trains the one-device baseline by itself,
then the same initial weights over each mesh on the same batches, and rank 0 prints one JSON
line ``{preset: {"one_device": [losses], mesh: [losses], ...}}``. Run as ``python FILE jax``
(4 CPU devices), it trains JAX's step over each mesh from the same weights and prints
``{preset: {mesh: [losses]}}``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from jaxmem.compare.tolerances import tolerance
from jaxmem.parallel import parse_mesh

PRESETS_RUN = ("tiny", "tiny-llama")
BATCH, SEQ, STEPS = 4, 32, 4
# the context axis over every rank (2 torchrun ranks: DDP), beside a data axis (4: FSDP2) and
# beside a tensor axis (4: FSDP2 over the context ranks); "ring": --cp-attention ring (fused
# attention: tiny-llama's runs only)
LAUNCHES = {
    2: ("cp=2", "cp=2 ring"),
    4: ("fsdp=2,cp=2", "fsdp=2,cp=2 ring", "fsdp=1,cp=2,tp=2", "fsdp=1,cp=2,tp=2 ring"),
}
MESHES = tuple(m for meshes in LAUNCHES.values() for m in meshes)
RANKS = max(LAUNCHES)


def _parallel(mesh: str):
    """``--mesh`` text, ``" ring"`` after it for ``--cp-attention ring``."""
    import dataclasses

    text, _, form = mesh.partition(" ")
    return dataclasses.replace(parse_mesh(text), cp_attention=form or "gather")


def _meshes(name: str) -> tuple[str, ...]:
    """The meshes preset ``name`` runs (the ring only where its attention is fused)."""
    fused = _config(name).attention == "fused"
    return tuple(m for m in MESHES if fused or not m.endswith(" ring"))


@pytest.fixture(scope="module")
def runs():
    from parity_tests.test_sharded_parity import torchrun

    out = {}
    for ranks, meshes in LAUNCHES.items():
        proc = torchrun(os.path.abspath(__file__), *meshes, nproc=ranks)
        for name, row in json.loads(proc.stdout.strip().splitlines()[-1]).items():
            out.setdefault(name, {}).update(row)
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_torch_context_parallelism_trains_as_one_device(runs):
    """cp=2 over 2 torchrun ranks and fsdp=2,cp=2 over 4 (keys and values gathered over each
    context group, and for tiny-llama's fused attention passed round PyTorch's ring): the
    one-device losses within the data-parallel tolerance, for tiny and tiny-llama."""
    tol = tolerance("float32", "data_parallel_loss")
    assert set(runs) == set(PRESETS_RUN)
    assert set(runs["tiny-llama"]) == {"one_device", *MESHES}
    for name, row in runs.items():
        for mesh in _meshes(name):
            assert len(row[mesh]) == STEPS
            np.testing.assert_allclose(
                row[mesh], row["one_device"], err_msg=f"{name} {mesh}", **tol.kwargs()
            )


@pytest.fixture(scope="module")
def jax_runs():
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={RANKS}"}
    cmd = [sys.executable, os.path.abspath(__file__), "jax"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_torch_context_parallelism_logs_jax_context_parallel_losses(runs, jax_runs):
    """The same initial weights and batches: torch_ref's losses over each mesh are JAX's."""
    tol = tolerance("float32", "adamw_loss")
    for name, row in runs.items():
        for mesh in _meshes(name):
            np.testing.assert_allclose(
                row[mesh], jax_runs[name][mesh], err_msg=f"{name} {mesh}", **tol.kwargs()
            )


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("mesh", ["cp=2", "fsdp=2,cp=2", "fsdp=1,cp=2,tp=2"])
def test_torch_context_parallel_job_logs_jax_losses_and_resumes(tmp_path, mesh):
    """``jaxmem train --framework torch --mesh cp=2 --cp-attention ring`` (2 torchrun ranks,
    DDP; PyTorch's ring, JAX's ring), ``--mesh fsdp=2,cp=2`` (4, FSDP2; keys gathered; with
    the block inputs in host memory and the MLP and loss in tiles) and ``--mesh
    fsdp=1,cp=2,tp=2`` (4: tensor parallelism, each rank's heads gathered over its context
    group, FSDP2 over the context ranks) log the losses of ``jaxmem train``'s same run over 10
    steps (``adamw_loss``). ``cp=2`` and ``fsdp=1,cp=2,tp=2``: cut back to the step-5
    checkpoint and resumed, the run logs the uninterrupted run's losses and gradient norms bit
    for bit. ``fsdp=2,cp=2``: rank 3 (in the other data rank's context group) SIGKILLed after
    checkpoint 5 ends the run in one line from the first survivor to see it, within seconds,
    nothing is left running, and the resumed run logs the uninterrupted run's losses and
    gradient norms bit for bit."""
    from parity_tests.test_sharded_parity import (
        _jaxmem,
        _lose_rank,
        _metrics,
        _torch_logs_jax_losses,
        torchrun,
    )
    from tests.test_parallel import processes_running

    ranks = 2 if mesh == "cp=2" else RANKS
    common = ["--preset", "tiny-llama", "--mesh", mesh, "--batch-size", "4", "--seq-len", "32"]
    if mesh == "cp=2":  # PyTorch's ring beside JAX's
        common += ["--policy", "full", "--attention", "fused", "--cp-attention", "ring"]
    elif mesh == "fsdp=2,cp=2":  # every long-sequence tool: inputs in host memory, tiles
        common += ["--policy", "full-host", "--mlp-tile-tokens", "8", "--loss-tile-tokens", "16"]
    else:
        common += ["--policy", "full"]
    common += ["--steps", "10", "--checkpoint-every", "5", "--eval-every", "5"]
    common += ["--sample-tokens", "8"]
    out, t = _torch_logs_jax_losses(tmp_path, common, nproc=ranks)
    said = " ".join(out.stdout.split())
    assert "each sequence split over cp=2 ranks" in said
    form = "passed round them by PyTorch's ring" if mesh == "cp=2" else "all-gathered over them"
    assert form in said, said
    if "tp=2" in mesh:
        assert "DTensor tensor parallelism over tp=2" in said
        assert "then FSDP2 fully_shard per block" in said and "over 1 x 2 data and context" in said
    resumed = tmp_path / "resumed"
    if mesh != "fsdp=2,cp=2":
        shutil.copytree(tmp_path / "torch", resumed)
        shutil.rmtree(resumed / "checkpoints" / "10")
    else:
        assert "over 2 x 2 ranks" in said
        agent, err, took = _lose_rank(resumed, common, 3, nproc=ranks)
        assert agent.returncode != 0 and took < 60, (took, err[-3000:])
        lines = [ln for ln in err.splitlines() if ln.startswith("jaxmem train:")]
        assert len(lines) == 1, err[-3000:]
        # the first survivor to see the lost collective says it; torchrun then ends the others
        pattern = r"jaxmem train: rank [012] of 4: another rank is gone"
        assert re.match(pattern, lines[0]), lines[0]
        assert f"last verified checkpoint: step 5 in {resumed}/checkpoints" in lines[0]
        assert not processes_running(str(resumed))
    torchrun("--no-python", *_jaxmem("train", "--out", str(resumed), "--resume"), nproc=ranks)
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in _metrics(resumed)] == [
        (r["step"], r["loss"], r["grad_norm"]) for r in t
    ]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_torch_per_rank_records_of_a_context_axis():
    """``torch_ref.mesh_memory`` over fsdp=2,cp=2 (4 torchrun ranks; what ``jaxmem memory
    --frameworks torch --mesh fsdp=2,cp=2`` runs): each rank holds a quarter of the parameters
    and saves under half of one device's activations for the backward (its rows' share of the
    tokens, and the gathered keys and values whole where a block keeps them); over
    fsdp=1,cp=2,tp=2 between a quarter and a half of the parameters, and under half the
    activations."""
    from jaxmem.compare.records import torch_rank_records

    kw = {"attention": "fused", "batch": 4, "seq_len": 64}
    (one,) = torch_rank_records("tiny-llama", "none", parse_mesh("dp=1"), **kw)
    ranks = torch_rank_records("tiny-llama", "none", parse_mesh("fsdp=2,cp=2"), **kw)
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    for r in ranks:
        assert "each sequence split over cp=2 ranks" in r["strategy"]
        assert r["params_bytes"] <= one["params_bytes"] / 4 + 1024
        saved = r["saved_activation_bytes_device"]
        assert one["saved_activation_bytes_device"] / 8 < saved
        assert saved < one["saved_activation_bytes_device"] / 2
    # beside a tensor axis: the blocks a quarter (tp x FSDP2 over cp), the embeddings and head
    # halved (whole on each tensor rank); each rank's heads of its half of the tokens
    ranks = torch_rank_records("tiny-llama", "none", parse_mesh("fsdp=1,cp=2,tp=2"), **kw)
    for r in ranks:
        assert "tensor parallelism over tp=2" in r["strategy"], r["strategy"]
        assert one["params_bytes"] / 4 < r["params_bytes"] < one["params_bytes"] / 2
        assert r["saved_activation_bytes_device"] < one["saved_activation_bytes_device"] / 2


def _config(name: str):
    import dataclasses

    from jaxmem.config import PRESETS

    cfg = PRESETS[name]  # the Llama block with the fused core (SDPA here, flash in JAX)
    return dataclasses.replace(cfg, attention="fused") if name == "tiny-llama" else cfg


def _batches(cfg) -> list:
    import torch

    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        t = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=gen)
        out.append({"inputs": t[:, :-1], "targets": t[:, 1:]})
    return out


def _initial(cfg):
    import torch

    import torch_ref

    torch.manual_seed(0)
    return torch_ref.Decoder(cfg)


def jax_main() -> None:
    """JAX's step over cp=2 from ``_initial``'s weights, on ``_batches``: one JSON line."""
    import jax

    from jaxmem.compare.weights import load_torch_state_dict
    from jaxmem.model import make_model
    from jaxmem.policy import get_policy
    from jaxmem.precision import PRECISIONS
    from jaxmem.step.build import build_step
    from jaxmem.step.spec import StepSpec

    out = {}
    for name in PRESETS_RUN:
        cfg, fp32 = _config(name), PRECISIONS["fp32"]
        out[name] = {}
        for mesh in _meshes(name):
            model = make_model(cfg, fp32)
            load_torch_state_dict(model, _initial(cfg).state_dict())
            spec = StepSpec(
                model=cfg,
                policy=get_policy("full"),
                precision=fp32,
                batch=BATCH,
                seq_len=SEQ,
                parallel=_parallel(mesh),
            )
            built, params = build_step(spec, model)
            params, opt_state = built.state(params)
            losses = []
            for batch in _batches(cfg):
                b = {k: v.numpy() for k, v in batch.items()}
                b = jax.device_put(b, built.shardings.batch)
                params, opt_state, _, metrics = built.step(params, opt_state, None, b)
                losses.append(float(metrics["loss"]))
            out[name][mesh] = losses
    print(json.dumps(out))


def _train(cfg, model, launch, mesh: str | None) -> list[float]:
    import torch_ref.distributed as tdist
    from jaxmem.config import OptimizerConfig
    from jaxmem.policy import get_policy
    from jaxmem.precision import PRECISIONS
    from torch_ref.context import apply_to_rank, gathered_attention, rank_batch, ring_attention
    from torch_ref.remat import apply_memory_policy
    from torch_ref.train import accumulate_grads, make_optimizer

    parallel = _parallel(mesh) if mesh else None
    if parallel:  # ranks data x context (x tensor): its rows, and its columns of them
        rows = launch.rows(BATCH, parallel.cp * parallel.tp)
        apply_to_rank(model, parallel, launch, SEQ)
        forms = {"gather": gathered_attention, "ring": ring_attention}  # the one the mesh asks
        assert model.blocks.layers[0].self_attn.core.func is forms[parallel.cp_attention]
    apply_memory_policy(model.blocks, get_policy("full"))
    if parallel:
        model = tdist.shard(model, parallel, launch)
    opt = make_optimizer(model, OptimizerConfig())
    divisor = tdist.token_divisor(parallel, launch) if parallel else None
    losses = []
    for batch in _batches(cfg):
        if parallel:
            if rows is not None:
                batch = {k: v[rows] for k, v in batch.items()}
            batch = rank_batch(batch, parallel, launch)
        opt.zero_grad(set_to_none=True)
        fp32 = PRECISIONS["fp32"]
        loss_sum, n = accumulate_grads(model, batch, precision=fp32, divisor=divisor)
        tdist.reduce_partial_grads(model.parameters())  # sequence-parallel norms' (as the job)
        opt.step()
        if parallel:  # the data and context ranks hold distinct tokens
            loss_sum, n = (
                tdist.data_sum(loss_sum, parallel, launch),
                tdist.data_sum(n, parallel, launch),
            )
        losses.append(float(loss_sum / n))
    return losses


def main() -> None:
    import copy

    import torch

    import torch_ref.distributed as tdist

    sys.path.insert(0, os.path.dirname(__file__))
    from torch_parallel_worker import finish  # isort: skip

    torch.set_num_threads(1)
    launch = tdist.from_environment()
    tdist.initialize(launch)
    out = {}
    for name in PRESETS_RUN:
        cfg = _config(name)
        initial = _initial(cfg)
        out[name] = {"one_device": _train(cfg, copy.deepcopy(initial), launch, None)}
        for mesh in (m for m in sys.argv[1:] if m in _meshes(name)):
            out[name][mesh] = _train(cfg, copy.deepcopy(initial), launch, mesh)
    finish(out, launch)


def stock_main() -> None:
    """PyTorch's own ``context_parallel`` on 2 gloo ranks, causal SDPA on float64 q/k/v
    ``[1, 2, 16, 8]``, under the default CPU kernel and under the math backend: rank 0 prints
    ``{backend: "ran" | "ExceptionType: first line"}``."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import torch_ref.distributed as tdist

    launch = tdist.from_environment()
    tdist.initialize(launch)
    mesh = init_device_mesh("cpu", (launch.world_size,), mesh_dim_names=("context",))
    out = {}
    for name, backends in (("default", None), ("math", [SDPBackend.MATH])):
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, 2, 16, 8, dtype=torch.float64) for _ in range(3))
        kernel = sdpa_kernel(backends) if backends else contextlib.nullcontext()
        try:
            with kernel, context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
                F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out[name] = "ran"
        except Exception as e:  # what the stock API says on CPU
            out[name] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    dist.barrier()
    sys.path.insert(0, os.path.dirname(__file__))
    from torch_parallel_worker import finish  # isort: skip

    finish(out, launch)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_pytorchs_stock_context_parallel_does_not_run_on_cpu():
    """Why torch_ref's context parallelism is an extension: the stock API fails on CPU ranks
    under the default kernel (no sharding rule for the CPU flash kernel) and under the math
    backend (its causal mask stays a plain tensor beside DTensors). When this fails, PyTorch
    runs it on CPU: make it torch_ref's path and test it against the extension."""
    from parity_tests.test_sharded_parity import torchrun

    proc = torchrun(os.path.abspath(__file__), "stock", nproc=2)
    said = json.loads(proc.stdout.strip().splitlines()[-1])
    assert said["default"].startswith("NotImplementedError: Operator aten._scaled_dot_product_")
    assert "does not have a sharding strategy registered" in said["default"]
    assert said["math"].startswith("RuntimeError: "), said["math"]
    assert "mixed torch.Tensor and DTensor" in said["math"], said["math"]


def attention_main() -> None:
    """torch_ref's context-parallel attention cores on float64 rows against whole-row SDPA, on 4
    gloo ranks: over every rank (cp=4) and over two groups of 2 (cp=2, each group its own row:
    the ``fsdp=2,cp=2`` layout). Each rank compares its outputs and the gradients of ``sum(sin(
    out))`` over every rank's outputs at its positions; rank 0 prints ``[{case, form, rank,
    errors: [out, dq, dk, dv] max abs, within: [each elementwise within the float64
    fused-vs-naive tolerance]}]``."""
    import functools

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import torch_ref.distributed as tdist
    from torch_ref.context import gathered_attention, rank_positions, ring_attention

    launch = tdist.from_environment()
    tdist.initialize(launch)
    r = launch.rank
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    b, s, h, kv, hd = 2, 16, 4, 2, 8
    tol = tolerance("float64", "fused_vs_naive").kwargs()
    rows = []
    for cp, group, seed in ((4, None, 0), (2, pairs[r // 2], 1 + r // 2)):
        crank = r % cp
        gen = torch.Generator().manual_seed(seed)
        whole = [torch.randn(b, s, n, hd, generator=gen, dtype=torch.float64) for n in (h, kv, kv)]
        ref = [t.clone().requires_grad_() for t in whole]
        qh, kh, vh = (t.transpose(1, 2) for t in ref)
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
        out = out.transpose(1, 2).reshape(b, s, -1)
        torch.sin(out).sum().backward()
        mine = rank_positions(s, cp, crank)
        restore = torch.argsort(torch.cat([rank_positions(s, cp, i) for i in range(cp)]))
        forms = {
            "ring": functools.partial(ring_attention, group=group),
            "gather": functools.partial(
                gathered_attention, q_pos=mine, restore=restore, fused=True, group=group
            ),
        }
        for form, core in forms.items():
            local = [t[:, mine].clone().requires_grad_() for t in whole]
            got = core(*local)
            torch.sin(got).sum().backward()
            pairs_ = [(got, out[:, mine])] + [
                (a.grad, x.grad[:, mine]) for a, x in zip(local, ref, strict=True)
            ]
            within = [torch.allclose(a, e, **tol) for a, e in pairs_]
            errors = [float((a - e).abs().max()) for a, e in pairs_]
            row = {"case": f"cp={cp}", "form": form, "rank": r, "within": within}
            rows.append({**row, "errors": errors})
    gathered = [None] * launch.world_size
    dist.all_gather_object(gathered, rows)
    sys.path.insert(0, os.path.dirname(__file__))
    from torch_parallel_worker import finish  # isort: skip

    finish([row for part in gathered for row in part], launch)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_torch_context_attention_equals_whole_row_sdpa_in_float64():
    """PyTorch's ring (torch_ref's CPU kernel and autograd around it) and the all-gather form,
    over 4 ranks and over two groups of 2 beside each other, grouped-query keys: each rank's
    outputs and its shares of the queries', keys' and values' gradients are whole-row SDPA's
    elementwise within the float64 fused-vs-naive tolerance."""
    from parity_tests.test_sharded_parity import torchrun

    proc = torchrun(os.path.abspath(__file__), "attention", nproc=4)
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(rows) == 16  # 4 ranks x (cp=4, cp=2) x (ring, gather)
    assert {(row["case"], row["form"]) for row in rows} == {
        (c, f) for c in ("cp=4", "cp=2") for f in ("ring", "gather")
    }
    for row in rows:
        assert row["within"] == [True] * 4, row


def policy_main() -> None:
    """tiny-llama (fused attention, float64) over cp=2 on 2 gloo ranks, a policy keeping
    ``norm2_out`` and ``mlp_act`` under each translation, keys gathered and round the ring:
    rank 0 prints ``{form: {translation: {"kept": [[layer, names, shape]], "grads": {name:
    [values]}}, "saved_by_name": {name: bytes}}}`` (the last: what autograd saves with no
    remat, by the op that made it)."""
    import dataclasses

    import torch

    import torch_ref
    import torch_ref.distributed as tdist
    from jaxmem.policy import BlockPolicy, MemoryPolicy, get_policy
    from torch_ref.context import apply_context_parallel, local_batch
    from torch_ref.forward_memory import forward_live_bytes
    from torch_ref.remat import apply_memory_policy

    launch = tdist.from_environment()
    tdist.initialize(launch)
    cfg = dataclasses.replace(_config("tiny-llama"), n_layers=2)
    policy = MemoryPolicy.of(BlockPolicy(save=("norm2_out", "mlp_act")), name="mlp-in")
    batch = local_batch(_batches(cfg)[0], 2, launch.rank)
    out: dict = {}
    for form in ("gather", "ring"):
        for translation in ("stock", "lean"):
            torch.manual_seed(0)
            model = torch_ref.Decoder(cfg).double()
            apply_context_parallel(model, seq_len=SEQ, cp=2, rank=launch.rank, attention=form)
            runner = apply_memory_policy(model.blocks, policy, translation)
            loss_sum, _ = model(batch["inputs"], batch["targets"])
            loss_sum.backward()
            kept = [[k.layer, list(k.names), list(k.shape)] for k in runner.kept]
            grads = {n: p.grad.flatten().tolist() for n, p in model.named_parameters()}
            out.setdefault(form, {})[translation] = {"kept": kept, "grads": grads}
        # no remat: what autograd saves, by the name of the op that made it
        apply_memory_policy(model.blocks, get_policy("none"))
        _, live = forward_live_bytes(
            lambda m=model: m(batch["inputs"], batch["targets"]), stack=model.blocks
        )
        out[form]["saved_by_name"] = live.by_name
    sys.path.insert(0, os.path.dirname(__file__))
    from torch_parallel_worker import finish  # isort: skip

    finish(out, launch)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_named_policy_keeps_the_same_tensors_under_the_ring_as_under_the_gather():
    """PyTorch's ring runs dozens of ops a block's op names would count (its merge's multiplies
    among them): to a memory policy it is one function, so a policy keeping ``norm2_out`` and
    ``mlp_act`` keeps the same tensors (``[B, S/cp, D]`` and ``[B, S/cp, d_ff]`` per layer) under
    the ring as under the gather, stock and lean, and the float64 gradients agree (each rank's
    share of its parameters' gradients, within the fused-vs-naive tolerance); with no remat the
    per-rank records name what autograd saves the same way (the ring's own tensors as one)."""
    from parity_tests.test_sharded_parity import torchrun

    proc = torchrun(os.path.abspath(__file__), "policy", nproc=2)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    cfg = _config("tiny-llama")
    per_layer = [[["norm2_out"], [BATCH, SEQ // 2, cfg.d_model]],
                 [["mlp_act"], [BATCH, SEQ // 2, cfg.d_ff]]]  # fmt: skip
    tol = tolerance("float64", "fused_vs_naive").kwargs()
    for translation in ("stock", "lean"):
        gather, ring = out["gather"][translation], out["ring"][translation]
        assert sorted(ring["kept"]) == sorted(gather["kept"]), translation
        assert sorted(ring["kept"]) == sorted([i, *k] for i in range(2) for k in per_layer)
        for name, values in gather["grads"].items():
            np.testing.assert_allclose(ring["grads"][name], values, err_msg=name, **tol)
    # the per-rank records' names: every tag outside attention saves the same bytes
    gather, ring = out["gather"]["saved_by_name"], out["ring"]["saved_by_name"]
    tags = ("norm1_out", "attn_residual", "norm2_out", "mlp_gate", "mlp_up", "mlp_act")
    for name in tags:
        assert ring.get(name) == gather.get(name) and gather.get(name), (name, ring, gather)
    assert "<ring attention>" in ring, ring  # its own copies of q, k, v, its output and lse


if __name__ == "__main__":
    if sys.argv[1:] == ["jax"]:
        jax_main()
    elif sys.argv[1:] == ["stock"]:
        stock_main()
    elif sys.argv[1:] == ["attention"]:
        attention_main()
    elif sys.argv[1:] == ["policy"]:
        policy_main()
    else:
        main()
