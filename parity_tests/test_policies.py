"""Every memory policy in both frameworks, PyTorch in both translations (stock PyTorch, and
torch_ref's lean extension):

- numerics, in float64 (exactness: no ReLU can flip on rounding): loss and every gradient equal
  the no-remat run and the other framework's, for the presets and for seeded random custom
  policies;
- structure: which tensors each keeps, by tag and memory kind. The block facts jaxmem's analytic
  model and the lean extension rely on (``jaxmem.policy.backward_reads``) are checked against
  both frameworks independently first;
- cost: matmul FLOPs executed, in units of the block's matmuls, including where stock PyTorch
  and JAX differ and why.
"""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from torch.utils.flop_counter import FlopCounterMode

import torch_ref
from jaxmem.compare import seed_example
from jaxmem.compare.parity import dtype_context, model_in, torch_model_from
from jaxmem.compare.tolerances import compare_state_dicts, tolerance
from jaxmem.compare.weights import load_torch_state_dict, to_torch_state_dict
from jaxmem.config import PRESETS, ConfigError
from jaxmem.data import lm_batch
from jaxmem.memory.flops import grad_matmul_flops
from jaxmem.memory.remat import PEEL_FROM, layers_fn
from jaxmem.memory.residuals import saved_residuals
from jaxmem.model import BlockStack, Decoder, make_model
from jaxmem.policy import (
    BLOCKS,
    CHECKPOINT_NAMES,
    CHOICES,
    POLICIES,
    QKV,
    BlockPolicy,
    LayerSelection,
    MemoryPolicy,
    backward_reads,
    kept_tags,
    mixed_policy,
    model_tags,
    nested_segment_size,
)
from jaxmem.precision import PRECISIONS
from jaxmem.step.train_step import lm_loss_fn
from torch_ref.forward_memory import forward_live_bytes
from torch_ref.loss import cross_entropy_sum
from torch_ref.offload import OffloadCheckpoint, offload_checkpoint_layers_fn, save_on_cpu_layers_fn
from torch_ref.remat import (
    TRANSLATIONS,
    apply_memory_policy,
    block_ops,
    op_kept_tags,
    resolve_translation,
    unread_by_backward,
    validate_for_torch,
)
from torch_ref.train import TORCH_DTYPES

F64, F32 = "float64", "float32"
HOST_INPUTS = ("full-host", "nested-host")  # the presets with their block inputs in host memory
NAMED = ("selective", "mlp", "offload")
CONFIGS = {
    "pre_causal": PRESETS["tiny"].replace(n_layers=4),
    # the 3-layer post-norm ReLU stack, where fp32 parity would depend on the rounding of one
    # pre-activation of 1.8e-7: its numerics are checked in float64
    "post_relu_bidirectional": PRESETS["tiny"].replace(
        n_layers=3, norm="post", activation="relu", causal=False, bias=False
    ),
    # fused attention (JAX: jaxmem.model.flash in 3 key blocks; PyTorch: SDPA's flash kernel)
    "pre_causal_fused": PRESETS["tiny"].replace(n_layers=3, attention="fused", attention_block=8),
    # Llama blocks: RMSNorm, RoPE, SwiGLU, 2 key/value heads for 4 query heads, no biases
    "llama_gqa": PRESETS["tiny-llama"].replace(n_layers=4),
    # Qwen2-style (q/k/v biases only) with fused attention (SDPA's enable_gqa)
    "qwen2_fused": PRESETS["tiny-llama"].replace(
        n_layers=3, qkv_bias=True, attention="fused", attention_block=8
    ),
}
B, S = 4, 24
# Configurations whose module-fixture checks run in the full suite only (`make test`): the
# inner loop already runs the Llama block through llama_gqa.
SLOW_CONFIGS = {"qwen2_fused"}
CASE_PARAMS = [
    pytest.param(name, marks=pytest.mark.slow) if name in SLOW_CONFIGS else name
    for name in sorted(CONFIGS)
]


class Case:
    """One configuration: a reference model, a batch, and each framework's runner."""

    def __init__(self, cfg, dtype: str):
        self.cfg, self.dtype = cfg, dtype
        reference = Decoder(cfg, rngs=nnx.Rngs(0))
        inputs, targets = lm_batch(cfg, B, S, seed=3)
        with dtype_context(dtype):
            model = model_in(reference, dtype)
            self.graphdef, self.params = nnx.split(model, nnx.Param)
            self.batch = {"inputs": jnp.asarray(inputs), "targets": jnp.asarray(targets)}
        self.torch_model = torch_model_from(model)
        self.x, self.y = torch.from_numpy(inputs).long(), torch.from_numpy(targets).long()

    def jax_loss(self, policy):
        loss = lm_loss_fn(self.graphdef, layers_fn=layers_fn(policy, self.cfg.n_layers))
        return lambda p, b: loss(p, b)[0]

    def jax(self, policy):
        """(loss, gradients as a PyTorch-keyed state dict, matmul FLOPs) of jaxmem (the no-remat
        run computed once per case)."""
        if policy == POLICIES["none"] and hasattr(self, "_jax_none"):
            return self._jax_none
        with dtype_context(self.dtype):
            f = self.jax_loss(policy)
            value, grads = jax.jit(jax.value_and_grad(f))(self.params, self.batch)
            grads = to_torch_state_dict(nnx.merge(self.graphdef, grads))
            out = float(value), grads, self.jax_flops(policy)
        if policy == POLICIES["none"]:
            self._jax_none = out
        return out

    def jax_flops(self, policy):
        """Matmul FLOPs of jaxmem's gradient, counted from its jaxpr (nothing runs)."""
        with dtype_context(self.dtype):
            return grad_matmul_flops(self.jax_loss(policy), self.params, self.batch)

    def torch(self, policy_or_layers_fn, translation="stock"):
        """(loss, gradients, FLOPs executed, runner, live bytes) of torch_ref."""
        if isinstance(policy_or_layers_fn, MemoryPolicy):
            runner = apply_memory_policy(self.torch_model.blocks, policy_or_layers_fn, translation)
        else:
            self.torch_model.blocks.layers_fn = runner = policy_or_layers_fn
        self.torch_model.zero_grad(set_to_none=True)

        def forward():
            loss_sum, n = cross_entropy_sum(self.torch_model(self.x), self.y)
            return loss_sum / n

        host = getattr(runner, "host_storages", None)
        names = getattr(runner, "kept_names", None)
        with FlopCounterMode(display=False) as counter:
            loss, live = forward_live_bytes(
                forward, host_storages=host, stack=self.torch_model.blocks, kept_names=names
            )
            loss.backward()
        grads = {k: p.grad.detach().numpy().copy() for k, p in self.torch_model.named_parameters()}
        return loss.item(), grads, counter.get_total_flops(), runner, live


@pytest.fixture(scope="module", params=CASE_PARAMS)
def case64(request):
    return Case(CONFIGS[request.param], F64)


@pytest.fixture(scope="module", params=CASE_PARAMS)
def case(request):
    return Case(CONFIGS[request.param], F32)


def attention_agnostic(case: Case) -> None:
    """Tests of PyTorch checkpoint modes and whole-block offload, which do not look inside the
    attention core, run on the naive configurations only (fused attention's numerics, kept
    tensors and FLOPs under every policy are tested above and below)."""
    if case.cfg.attention == "fused":
        pytest.skip(
            "checkpoint modes and whole-block offload do not depend on the attention form: "
            "checked on the naive configurations"
        )


def assert_grads(actual, expected, dtype, quantity):
    diff = compare_state_dicts(actual, expected, tolerance(dtype, quantity))
    assert diff.passed, f"{diff.failures} (max abs {diff.max_abs:.3e})"


def assert_loss(actual, expected, dtype, quantity):
    tol = tolerance(dtype, quantity)
    np.testing.assert_allclose(actual, expected, rtol=tol.rtol, atol=tol.atol)


# ------------------------------------------------------------------------------------ numerics
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policy_numerics_in_both_frameworks_and_both_translations(case64, name):
    if name in HOST_INPUTS and case64.cfg not in (CONFIGS["pre_causal"], CONFIGS["llama_gqa"]):
        pytest.skip(
            "full-host and nested-host run full's and nested's math with the block inputs in "
            "host memory (bitwise: tests/test_offloaded_inputs.py): checked on a GPT-2 and a "
            "Llama configuration"
        )
    policy = POLICIES[name]
    base_j, base_grads_j, _ = case64.jax(POLICIES["none"])
    loss_j, grads_j, _ = case64.jax(policy)
    assert_loss(loss_j, base_j, F64, "remat_vs_none")
    assert_grads(grads_j, base_grads_j, F64, "remat_vs_none")
    base_t, base_grads_t, *_ = case64.torch(POLICIES["none"])
    # where the extension runs what stock runs (full-host: stock's save_on_cpu), once
    for translation in dict.fromkeys(resolve_translation(policy, t) for t in TRANSLATIONS):
        loss_t, grads_t, *_ = case64.torch(policy, translation)
        assert_loss(loss_t, base_t, F64, "remat_vs_none")
        assert_grads(grads_t, base_grads_t, F64, "remat_vs_none")
        assert_loss(loss_j, loss_t, F64, "loss")
        assert_grads(grads_j, grads_t, F64, "grads")
    # the comparison is not vacuous: every gradient leaf carries signal
    assert all(np.abs(g).max() > 1e-6 for g in grads_j.values())


def random_custom_policy(seed: int, cfg=CONFIGS["pre_causal"]) -> MemoryPolicy:
    """A custom policy with a random choice per tag; odd seeds never offload (so that stock
    selective checkpointing can run them). q/k/v share one choice (torch_ref computes them with
    one fused matmul) and the block input is never offloaded (stock ``save_on_cpu`` moves it,
    outside the lean extension's dispatch modes: the full-host and nested-host presets cover
    it): everything else is free."""
    rng = random.Random(seed)
    options = CHOICES if seed % 2 == 0 else ("device", "recompute")
    choices = {n: rng.choice(options) for n in model_tags(cfg) if n not in QKV}
    choices.update(dict.fromkeys(QKV, rng.choice(options)))
    if cfg.attention == "fused":  # one op in torch_ref (SDPA) returns both
        choices["attn_lse"] = choices["attn_context"]
    if choices["block_input"] == "offload":
        choices["block_input"] = "device"
    return MemoryPolicy.custom(choices, name=f"random{seed}")


CUSTOM_SEEDS = (0, 1, 2, 3, 4, 5)


def test_random_custom_policies_cover_every_choice():
    policies = [random_custom_policy(s) for s in CUSTOM_SEEDS]
    assert sum(bool(p.head.offload) for p in policies) == 3  # through the extension
    assert sum(not p.head.offload for p in policies) == 3  # through stock selective checkpointing
    for name in model_tags(CONFIGS["pre_causal"]):
        seen = {p.head.choice(name) for p in policies}
        assert len(seen) >= 2, (name, seen)
    offloaded = {n for p in policies for n in p.head.offload}
    assert len(offloaded) >= 8, offloaded
    # the Llama block's own tags (RoPE's rotated q and k, the gate) get every kind of choice
    llama = [
        random_custom_policy(s, CONFIGS[c])
        for c in ("llama_gqa", "qwen2_fused")
        for s in CUSTOM_SEEDS
    ]
    for name in ("query_rope", "key_rope", "mlp_gate"):
        assert {p.head.choice(name) for p in llama} >= {"device", "recompute"}, name
    assert {"key_rope", "mlp_gate"} <= {n for p in llama for n in p.head.offload}


@pytest.mark.slow
@pytest.mark.parametrize("seed", CUSTOM_SEEDS)
def test_random_custom_policies_agree_across_frameworks(case64, seed):
    """Numerics (float64) and, against JAX's residuals, the tags the lean extension keeps with
    their memory kind; stock selective checkpointing keeps every stored op output."""
    cfg = case64.cfg
    policy = random_custom_policy(seed, cfg)
    _, base_grads_j, _ = case64.jax(POLICIES["none"])
    loss_j, grads_j, _ = case64.jax(policy)
    assert_grads(grads_j, base_grads_j, F64, "remat_vs_none")
    translations = ("lean",) if policy.head.offload else ("stock", "lean")
    for translation in translations:
        loss_t, grads_t, _, runner, _ = case64.torch(policy, translation)
        assert_loss(loss_j, loss_t, F64, "loss")
        assert_grads(grads_j, grads_t, F64, "grads")
        kept = kept_by_tag(runner)
        if translation == "lean":
            assert_lean_keeps(kept, jax_kept(case64, policy), cfg, policy)
        else:
            produced = {n for names in block_ops(cfg).values() for n in names}
            assert set(kept) == set(policy.head.save) & produced
            assert all(where == {"device"} for where in kept.values())


def kept_by_tag(runner) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for k in runner.kept:
        for n in k.names:
            out.setdefault(n, set()).add(k.memory)
    return out


def assert_lean_keeps(lean: dict, jax: dict, cfg, policy: MemoryPolicy) -> None:
    """The lean extension keeps the tags JAX keeps, each in the same memory, at torch_ref's
    granularity: an op's whole output (under RoPE, ``mlp`` keeps v and with it the q and k
    projections of the same fused matmul; ``op_kept_tags``)."""
    assert lean.keys() == op_kept_tags(cfg, policy.head) - {"block_input"}
    assert {n: lean[n] for n in jax} == jax


def jax_kept(case: Case, policy: MemoryPolicy) -> dict[str, set[str]]:
    """The tags JAX keeps (computed residuals) with their memory kind, the layer inputs aside:
    a block's input is the previous block's output, which scan keeps under whichever of its
    names it meets first (torch's checkpoint keeps its input; same tensor, same bytes)."""
    block_output = "mlp_residual" if case.cfg.norm == "pre" else "norm2_out"
    layer_inputs = {"<layer input>", "block_input", block_output, "<stack output>"}
    with dtype_context(case.dtype):
        residuals = saved_residuals(case.jax_loss(policy), case.params, case.batch)
    out: dict[str, set[str]] = {}
    for r in residuals:
        if r.origin == "computed" and r.name is not None and r.name not in layer_inputs:
            out.setdefault(r.name, set()).add("host" if r.memory_kind else "device")
    return out


# ----------------------------------------------------------------------------------- structure
def test_backward_reads_what_both_frameworks_save_without_remat(case):
    """``jaxmem.policy.backward_reads`` (used by the analytic model and the lean extension) is
    what each framework measures on its own: the tags JAX keeps when a policy may keep them all,
    and the op outputs PyTorch's autograd saves without checkpointing."""
    cfg = case.cfg
    everything = MemoryPolicy.of(BlockPolicy(save=model_tags(cfg)), name="all")
    block_output = "mlp_residual" if cfg.norm == "pre" else "norm2_out"
    jax_needed = set(jax_kept(case, everything)) | {"block_input"}
    jax_needed |= {block_output} if block_output in backward_reads(cfg) else set()
    *_, live = case.torch(POLICIES["none"])
    torch_saved = set()
    for label in live.by_name:
        names = set(label.split("/")) & set(CHECKPOINT_NAMES)
        # one op's output under several tags (the fused q/k/v matmul) is one storage, saved
        # whole when the backward reads a view of part of it (fused attention under RoPE reads
        # v, a view of it, and the rotated q and k)
        torch_saved |= (names & backward_reads(cfg)) or names
    torch_saved |= {"block_input"}  # a block's input: '<layer input>' in torch's listing
    # the block output of post-norm (norm2_out) is the next block's input and the final
    # LM head's input: read there, not by this block's backward
    torch_saved -= {block_output} - backward_reads(cfg)
    assert jax_needed == set(backward_reads(cfg)) == torch_saved


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", NAMED)
def test_lean_extension_keeps_what_jax_keeps_in_the_same_memory(case, name, precision):
    cfg = case.cfg
    policy = POLICIES[name]
    prec = PRECISIONS[precision]
    sub = Case.__new__(Case)
    sub.__dict__.update(case.__dict__)
    if prec.is_mixed:  # the same weights, computed in bf16
        model = make_model(cfg, prec)
        nnx.update(model, case.params)
        sub.graphdef, sub.params = nnx.split(model, nnx.Param)
    expected = jax_kept(sub, policy)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=prec.is_mixed):
        *_, runner, _ = case.torch(policy, "lean")
    # fp32 LayerNorm statistics / softmax output come with the norms and the probabilities;
    # torch_ref's tags sit on the fp32 results of the norms and of RoPE, before their cast back
    wide = {"norm1_out", "norm2_out", "attn_probs", "query_rope", "key_rope"}
    with_fp32 = any(set(k.names) & wide for k in runner.kept)
    assert {k.dtype for k in runner.kept} == {TORCH_DTYPES[prec.compute_dtype]} | (
        {torch.float32} if prec.is_mixed and with_fp32 else set()
    )
    assert_lean_keeps(kept_by_tag(runner), expected, cfg, policy)
    assert expected.keys() == kept_tags(cfg, policy.head) - {"block_input"}
    assert not set(kept_by_tag(runner)) & unread_by_backward(cfg, policy.head)
    per_layer = {
        i: {n for k in runner.kept if k.layer == i for n in k.names} for i in range(cfg.n_layers)
    }
    assert all(v == per_layer[0] for v in per_layer.values())


@pytest.mark.parametrize("name", ["selective", "mlp"])
def test_stock_selective_checkpointing_also_keeps_what_nothing_reads(case, name):
    """Stock ``create_selective_checkpoint_contexts`` caches every output its policy saves; JAX
    (and the lean extension) keep only what the backward reads of those, plus sources of read
    tags: the difference is exactly the stored tags nothing reads, and costs their bytes."""
    attention_agnostic(case)
    cfg = case.cfg
    policy = POLICIES[name]
    *_, stock, stock_live = case.torch(policy, "stock")
    *_, lean, lean_live = case.torch(policy, "lean")
    produced = {n for names in block_ops(cfg).values() for n in names}
    assert set(kept_by_tag(stock)) == set(policy.head.save) & produced
    extra = set(kept_by_tag(stock)) - set(kept_by_tag(lean))
    assert extra == (set(policy.head.save) & produced) - op_kept_tags(cfg, policy.head)
    assert extra <= unread_by_backward(cfg)
    # Every byte of difference is on those tags. A stored block output is also the next block's
    # input (and the last one the stack's output): one storage, which the lean run lists as
    # '<layer input>' / '<stack output>' and the stock run under its tag.
    positional = ("<layer input>", "<stack output>")
    differ = {
        k
        for k in set(stock_live.by_name) | set(lean_live.by_name)
        if stock_live.by_name.get(k, 0) != lean_live.by_name.get(k, 0)
    }
    assert differ <= extra | set(positional), differ
    relabelled = sum(lean_live.by_name.get(k, 0) - stock_live.by_name.get(k, 0) for k in positional)
    extra_bytes = sum(stock_live.by_name[t] for t in extra if t in stock_live.by_name)
    assert stock_live.device_bytes - lean_live.device_bytes == extra_bytes - relabelled
    assert (extra_bytes > relabelled) == bool(extra - {"mlp_residual", "norm2_out"})


# --------------------------------------------------------------------------------------- FLOPs
def units(cfg) -> dict[str, int]:
    """Matmul FLOPs of one block's forward, by op (batch B, sequence S). Grouped-query
    attention projects fewer keys and values; its core still scores every query head."""
    d, f = cfg.d_model, cfg.d_ff
    out = {
        "qkv": 2 * B * S * d * (d + 2 * cfg.kv_dim),
        "attention": 2 * 2 * B * S * S * d,  # q·k and probs·v
        "out": 2 * B * S * d * d,
        "up": 2 * B * S * d * f,
        "down": 2 * B * S * f * d,
    }
    if cfg.mlp == "gated":
        out["gate"] = 2 * B * S * d * f
    return out


def test_flops_in_units_of_the_blocks_matmuls(case):
    """torchtitan's test, in exact units. ``replay`` is what a non-reentrant checkpoint re-runs
    of one block: everything but mlp_down in pre-norm (no backward op of the block reads its
    product: the recompute stops early), the whole block in post-norm (norm2 reads it)."""
    cfg, L = case.cfg, case.cfg.n_layers
    u = units(cfg)
    block = sum(u.values())
    replay = block - (u["down"] if cfg.norm == "pre" else 0)
    k = nested_segment_size(L)
    n_segments = -(-L // k)
    flops = {}
    for name in ("none", "full", "selective", "offload", "nested"):
        flops[name] = {"jax": case.jax_flops(POLICIES[name])}
        for translation in ("stock", "lean"):
            flops[name][translation] = case.torch(POLICIES[name], translation)[2]
    none = flops["none"]["jax"]
    assert flops["none"] == dict.fromkeys(("jax", "stock", "lean"), none)
    assert flops["full"] == dict.fromkeys(("jax", "stock", "lean"), none + L * replay)
    # the attention core only, everywhere: out_proj and mlp_down come back from storage (stock
    # caches them; JAX and the lean extension skip the matmuls nothing reads)
    for name in ("selective", "offload"):
        assert flops[name] == dict.fromkeys(("jax", "stock", "lean"), none + L * u["attention"])
    # nested. Stock checkpoint_sequential checkpoints every segment but its last; each replays
    # its blocks, the last of them as a replay. The lean extension checkpoints every segment
    # and every block inside: a segment replays its blocks but the last (stopping early), then
    # each block again. JAX's two-level scan does the same from 3-block segments on (their last
    # block runs outside the inner scan, so the replay stops before it); a segment of 1 or 2
    # blocks replays its last block too (peeling it off costs more memory than it saves).
    checkpointed = [
        len(range(L)[i * (L // n_segments) :][: L // n_segments]) for i in range(n_segments - 1)
    ]
    assert flops["nested"]["stock"] == none + sum((n - 1) * block + replay for n in checkpointed)
    sizes = [min(k, L - i) for i in range(0, L, k)]
    assert flops["nested"]["lean"] == none + sum((n - 1) * block + n * replay for n in sizes)
    short = sum(1 for n in sizes if n < PEEL_FROM)
    assert flops["nested"]["jax"] == flops["nested"]["lean"] + block * short
    # mlp: the MLP's up (and gate) projections again (and its down projection in post-norm,
    # whose residual the norm2 backward reads). Stock selective checkpointing also replays naive
    # attention's q·kᵀ, whose product nothing reads: it caches only the ops it is told to save
    # (the scores are tagged after the scaling and mask); JAX and the lean extension skip it.
    mlp = {"jax": case.jax_flops(POLICIES["mlp"])}
    for translation in ("stock", "lean"):
        mlp[translation] = case.torch(POLICIES["mlp"], translation)[2]
    up_down = u["up"] + u.get("gate", 0) + (u["down"] if cfg.norm == "post" else 0)
    assert mlp["jax"] == mlp["lean"] == none + L * up_down
    qk = u["attention"] // 2 if cfg.attention == "naive" else 0
    assert mlp["stock"] == mlp["lean"] + L * qk


def test_reentrant_full_checkpoint_gives_the_same_gradients(case64):
    attention_agnostic(case64)
    _, base, *_ = case64.torch(POLICIES["none"])
    _, grads, flops, *_ = case64.torch(POLICIES["full"].replace(use_reentrant=True))
    _, _, full_flops, *_ = case64.torch(POLICIES["full"])
    assert_grads(grads, base, F64, "remat_vs_none")
    # Reentrant checkpoint replays the whole block; non-reentrant stops once the tensors the
    # backward needs exist. In a pre-norm block that skips the last matmul (mlp_down), as JAX
    # does; in a post-norm block norm2's backward needs mlp_down's output, so both replay it.
    cfg = case64.cfg
    skipped = cfg.n_layers * units(cfg)["down"] if cfg.norm == "pre" else 0
    assert flops == full_flops + skipped


def test_reentrant_stock_nested_gives_the_same_gradients(case64):
    attention_agnostic(case64)
    _, base, *_ = case64.torch(POLICIES["none"])
    _, grads, *_ = case64.torch(POLICIES["nested"].replace(use_reentrant=True))
    assert_grads(grads, base, F64, "remat_vs_none")


def test_layer_selection_two_of_three_like_seed_004(case64):
    attention_agnostic(case64)
    policy = MemoryPolicy.of(BLOCKS["full"], name="first_two", layers=LayerSelection(first=2))
    _, base_t, f0, *_ = case64.torch(POLICIES["none"])
    _, grads_t, f2, *_ = case64.torch(policy)
    _, _, f_full, *_ = case64.torch(POLICIES["full"])
    assert_grads(grads_t, base_t, F64, "remat_vs_none")
    per_layer = (f_full - f0) // case64.cfg.n_layers
    assert f2 - f0 == 2 * per_layer
    _, grads_j, flops_j = case64.jax(policy)
    assert_grads(grads_j, grads_t, F64, "grads")
    assert flops_j - f0 == 2 * per_layer


# ------------------------------------------------------------------------ offload, the seeds'
def test_save_on_cpu_and_offload_checkpoint_give_the_same_gradients(case64):
    attention_agnostic(case64)
    cfg = case64.cfg
    _, base, f0, *_ = case64.torch(POLICIES["none"])
    _, _, f_reentrant, *_ = case64.torch(POLICIES["full"].replace(use_reentrant=True))
    everything = LayerSelection()
    _, grads, flops, *_ = case64.torch(save_on_cpu_layers_fn(everything, cfg.n_layers))
    assert_grads(grads, base, F64, "remat_vs_none")
    assert flops == f0  # offload instead of recompute
    _, grads, flops, *_ = case64.torch(offload_checkpoint_layers_fn(everything, cfg.n_layers))
    assert_grads(grads, base, F64, "remat_vs_none")
    assert flops == f_reentrant  # replays each whole block once, like reentrant checkpoint


def _block_grads(block, run, x):
    block.zero_grad(set_to_none=True)
    run(block, x).pow(2).mean().backward()
    return {k: None if p.grad is None else p.grad.clone() for k, p in block.named_parameters()}


@pytest.mark.parametrize("input_requires_grad", [True, False])
def test_offload_checkpoint_keeps_only_its_input_in_host_memory(input_requires_grad):
    """One block, with an input that does or does not require grad (a frozen first layer, raw
    features): the parameters get their gradients either way, and the input its own."""
    cfg = PRESETS["tiny"]
    block = torch_ref.Block(cfg).double()
    x = torch.randn(2, 8, cfg.d_model, dtype=torch.float64, requires_grad=input_requires_grad)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        OffloadCheckpoint.apply(block, x, None)
    assert [(tuple(t.shape), t.device.type) for t in saved] == [((2, 8, cfg.d_model), "cpu")]
    offloaded = _block_grads(block, lambda b, t: OffloadCheckpoint.apply(b, t, None), x)
    x_grad = None if x.grad is None else x.grad.clone()
    x.grad = None
    plain = _block_grads(block, lambda b, t: b(t, None), x)
    assert all(g is not None for g in offloaded.values())
    for key, g in plain.items():
        assert_grads({key: offloaded[key].numpy()}, {key: g.numpy()}, F64, "remat_vs_none")
    if input_requires_grad:
        assert_grads({"x": x_grad.numpy()}, {"x": x.grad.numpy()}, F64, "remat_vs_none")
    else:
        assert x_grad is None


@pytest.mark.parametrize(
    "selection",
    [LayerSelection(), LayerSelection(layers=(0,)), LayerSelection(layers=(1, 2))],
    ids=["all", "first", "last_two"],
)
def test_offload_checkpoint_on_a_stack_fed_raw_features(selection):
    """A block stack whose input does not require grad, some or all layers through
    OffloadCheckpoint: every parameter gets the plain run's gradient (the seeds' version
    dropped them; a Function whose inputs need no grad never runs its backward)."""
    cfg = PRESETS["tiny"].replace(n_layers=3)
    stack = torch_ref.BlockStack(cfg).double()
    x = torch.randn(2, 8, cfg.d_model, dtype=torch.float64)

    def grads(layers_fn):
        stack.layers_fn = layers_fn
        stack.zero_grad(set_to_none=True)
        stack(x).pow(2).mean().backward()
        return {
            k: None if p.grad is None else p.grad.numpy().copy()
            for k, p in stack.named_parameters()
        }

    plain = grads(torch_ref.model.run_layers)
    offloaded = grads(offload_checkpoint_layers_fn(selection, cfg.n_layers))
    assert all(g is not None for g in offloaded.values()), [
        k for k, g in offloaded.items() if g is None
    ]
    assert_grads(offloaded, plain, F64, "remat_vs_none")


def test_torch_offload_moves_exactly_the_offloaded_bytes_to_host(case):
    """Against the same names kept on device, offload lowers device bytes and raises host bytes
    by exactly the offloaded tensors' bytes, as in jaxmem (tests/test_remat.py)."""
    attention_agnostic(case)
    offload = POLICIES["offload"]
    names = tuple(n for n in offload.head.save + offload.head.offload if n in model_tags(case.cfg))
    on_device = MemoryPolicy.of(BlockPolicy(save=names), name="on_device")
    *_, runner, off = case.torch(offload)
    offloaded_bytes = sum(k.nbytes for k in runner.kept if k.memory == "host")
    assert runner.translation == "lean"  # no stock API: the extension, and it says so
    assert "no stock API" in runner.description
    *_, dev = case.torch(on_device, "lean")
    assert offloaded_bytes > 0 and off.host_bytes == offloaded_bytes and dev.host_bytes == 0
    assert dev.device_bytes - off.device_bytes == offloaded_bytes


# ------------------------------------------------------------------------------- the op table
# post-norm RMSNorm blocks: their norms' ops come after RoPE's in the op stream
OP_TABLE_CONFIGS = CONFIGS | {
    "post_llama_bidirectional": PRESETS["tiny-llama"].replace(norm="post", causal=False)
}


@pytest.mark.parametrize("cfg_name", sorted(OP_TABLE_CONFIGS))
def test_block_op_table_matches_the_real_op_stream(cfg_name):
    """Each tagged op of ``block_ops`` produces a tensor of the JAX tag's size, and the tags on
    module boundaries are those modules' very tensors (the norms' outputs, the down
    projection's input): sizes alone would not tell a norm's output from the normalised input
    ``torch.rms_norm``'s composite makes before it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from torch_ref.remat import _op_kind

    cfg = OP_TABLE_CONFIGS[cfg_name]
    b, s = 2, 8
    sizes = {
        "query_proj": b * s * (cfg.d_model + 2 * cfg.kv_dim),  # fused q, k, v
        "key_rope": b * s * cfg.kv_dim,
        "attn_scores": b * cfg.n_heads * s * s,
        "attn_probs": b * cfg.n_heads * s * s,
        "mlp_gate": b * s * cfg.d_ff,
        "mlp_up": b * s * cfg.d_ff,
        "mlp_act": b * s * cfg.d_ff,
    }

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.ops.append((func, out if isinstance(out, torch.Tensor) else out[0]))
            return out

    block = torch_ref.Block(cfg)
    boundaries = {}
    block.norm1.register_forward_hook(lambda m, a, out: boundaries.setdefault("norm1_out", out))
    block.norm2.register_forward_hook(lambda m, a, out: boundaries.setdefault("norm2_out", out))
    down = block.ffn.down if cfg.mlp == "gated" else block.ffn[2]
    down.register_forward_pre_hook(lambda m, a: boundaries.setdefault("mlp_act", a[0]))
    mask = torch.ones(s, s, dtype=torch.bool).tril() if cfg.causal else None
    rope = torch_ref.model.rope_tables(cfg, s, torch.device("cpu"), torch.float32)
    with Record() as rec:
        block(torch.randn(b, s, cfg.d_model), mask, rope)
    counts: dict[str, int] = {}
    found = {}
    for func, out in rec.ops:
        kind = _op_kind(func)
        key = (kind, counts.get(kind, 0))
        counts[kind] = key[1] + 1
        if key in block_ops(cfg):
            found[block_ops(cfg)[key][0]] = out
    assert set(found) == {names[0] for names in block_ops(cfg).values()}
    for name, out in found.items():
        assert out.numel() == sizes.get(name, b * s * cfg.d_model), name
    for name, tensor in boundaries.items():
        assert found[name] is tensor, name


def test_torch_translation_rejects_what_it_cannot_express():
    with pytest.raises(ConfigError, match="one fused matmul"):
        validate_for_torch(MemoryPolicy.custom({"query_proj": "device", "key_proj": "offload"}))
    with pytest.raises(ConfigError, match="needs use_reentrant=False"):
        validate_for_torch(POLICIES["selective"].replace(use_reentrant=True))
    with pytest.raises(ConfigError, match="needs use_reentrant=False"):
        validate_for_torch(POLICIES["nested"].replace(use_reentrant=True), "lean")
    validate_for_torch(POLICIES["nested"].replace(use_reentrant=True))  # stock: sequential
    validate_for_torch(MemoryPolicy.custom({"block_input": "offload"}))  # save_on_cpu, stock
    with pytest.raises(ConfigError, match="translation='fast' is not one of"):
        validate_for_torch(POLICIES["full"], "fast")


def test_tags_a_model_does_not_produce_are_refused_by_name_and_ignored_by_presets():
    """A custom policy naming RoPE's or the gate's tags on a GPT-2 block is refused, as
    ``jaxmem.policy.check_policy`` refuses it, rather than keeping nothing; the presets (which
    name them for Llama blocks) run on both, and torch_ref's op table has them only where the
    block computes them."""
    gpt2, llama = CONFIGS["pre_causal"], CONFIGS["llama_gqa"]
    rope = MemoryPolicy.custom({"query_rope": "device", "mlp_up": "device"})
    with pytest.raises(ConfigError, match="query_rope and key_rope exist only with positions"):
        validate_for_torch(rope, cfg=gpt2)
    with pytest.raises(ConfigError, match="mlp_gate exists only with mlp='gated'"):
        validate_for_torch(MemoryPolicy.custom({"mlp_gate": "offload"}), cfg=gpt2)
    validate_for_torch(rope, cfg=llama)
    for name in POLICIES:
        validate_for_torch(POLICIES[name], cfg=gpt2)
    tagged = {n for names in block_ops(llama).values() for n in names}
    assert tagged == set(model_tags(llama)) - {"block_input"}
    gpt2_tagged = {n for names in block_ops(gpt2).values() for n in names}
    assert gpt2_tagged == set(model_tags(gpt2)) - {"block_input"}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_seed_example_runs_under_every_policy_in_both_frameworks(name):
    policy = POLICIES[name]
    data = seed_example.seed_example_data(batch=2, seq_len=16)
    stack = torch_ref.BlockStack(seed_example.SEED_CONFIG)
    state = {k: v.detach().clone() for k, v in stack.state_dict().items()}
    losses_t = seed_example.train_torch(2, data=data, state_dict=state, policy=policy)
    jax_stack = BlockStack(seed_example.SEED_CONFIG, rngs=nnx.Rngs(0))
    load_torch_state_dict(jax_stack, {k: v.numpy() for k, v in state.items()})
    losses_j = seed_example.train_jax(2, data=data, stack=jax_stack, policy=policy)
    tol = tolerance(F32, "adamw_loss")
    np.testing.assert_allclose(losses_j, losses_t, rtol=tol.rtol, atol=tol.atol)


@pytest.mark.slow
@pytest.mark.parametrize("head,k,rest", [("selective", 1, "full"), ("full", 2, "none")])
def test_mixed_stack_numerics_and_flops_in_both_frameworks(case64, head, k, rest):
    """``jaxmem plan``'s mixed stacks (the first k blocks under one preset, the others under
    another): the same gradients as no remat in both frameworks, and each framework's FLOPs
    are k blocks of the one preset and L - k of the other, exactly."""
    attention_agnostic(case64)
    policy = mixed_policy(head, k, rest)
    n = case64.cfg.n_layers
    _, base_t, *_ = case64.torch(POLICIES["none"])
    _, base_j, _ = case64.jax(POLICIES["none"])
    _, grads_t, f_mix_t, *_ = case64.torch(policy)
    _, grads_j, f_mix_j = case64.jax(policy)
    assert_grads(grads_t, base_t, F64, "remat_vs_none")
    assert_grads(grads_j, base_j, F64, "remat_vs_none")
    assert_grads(grads_j, grads_t, F64, "grads")
    for flops, run in ((f_mix_j, case64.jax), (f_mix_t, case64.torch)):
        f_head, f_rest = (run(POLICIES[p])[2] for p in (head, rest))
        # per-block FLOPs of each preset: uniform stacks differ by n blocks' difference
        assert (flops - f_rest) * n == k * (f_head - f_rest)


# ------------------------------------------------------------------------ per-tag policies
@pytest.fixture(scope="module", params=["pre_causal", "llama_gqa", "pre_causal_fused"])
def tag_case(request):
    """The three tag graphs (naive GPT; Llama's RoPE, GQA and SwiGLU; fused attention's one
    kernel) without the configurations that share them."""
    return Case(CONFIGS[request.param], F32)


@pytest.mark.slow
def test_the_planners_per_tag_policies_execute_their_counted_flops_in_both_frameworks(tag_case):
    """Every per-tag policy ``jaxmem plan`` may choose (one block's Pareto frontier,
    ``jaxmem.planner.tags``) executes in JAX and in torch_ref (stock selective checkpointing)
    exactly the FLOPs the frontier counted for it (torch_ref's lean extension always; stock
    checkpoint too, but for stored probabilities: its replay stops at the last tensor the
    backward needs, not before the q·kᵀ matmul whose softmax it reads from storage, one
    attention matmul per block); its first point keeps only the block input (``full``'s FLOPs)
    and its last recomputes no matmul (``none``'s)."""
    from jaxmem.planner.predict import _flops_per_row
    from jaxmem.planner.tags import frontier

    case = tag_case
    cfg, L = case.cfg, case.cfg.n_layers
    with dtype_context(case.dtype):
        points = frontier(cfg, PRECISIONS["fp32"], S, _flops_per_row)
    none = case.jax_flops(POLICIES["none"])
    top = points[-1].flops_per_block
    assert case.jax_flops(points[-1].policy) == none
    assert case.jax_flops(points[0].policy) == case.jax_flops(POLICIES["full"])
    for p in points:
        want = none + L * B * (p.flops_per_block - top)
        assert case.jax_flops(p.policy) == want, p.policy.head.save
        assert case.torch(p.policy, "lean")[2] == want, p.policy.head.save
        replay = L * 2 * B * S * S * cfg.d_model if "attn_probs" in p.policy.head.save else 0
        assert case.torch(p.policy, "stock")[2] == want + replay, p.policy.head.save
