"""jaxmem memory policies, proved three ways: numerics (gradients equal the no-remat run),
structure (exactly the policy's names are saved, offloaded ones in host memory, and the CUDA
program places them in pinned_host), cost (matmul FLOPs move the right way)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmem.compare.tolerances import tolerance
from jaxmem.config import PRESETS, ConfigError
from jaxmem.data import lm_batch
from jaxmem.memory.flops import grad_matmul_flops
from jaxmem.memory.remat import check_backend, layers_fn
from jaxmem.memory.residuals import saved_residuals, summarize_residuals
from jaxmem.model import CHECKPOINT_NAMES, Decoder, make_model
from jaxmem.policy import (
    BLOCKS,
    POLICIES,
    BlockPolicy,
    EmbeddingReplay,
    LayerSelection,
    LossPolicy,
    MemoryPolicy,
    StackPart,
    get_policy,
    kept_tags,
    mixed_policy,
    nested_segment_size,
)
from jaxmem.policy_config import parse_policy, policy_from_dict, policy_to_dict
from jaxmem.precision import PRECISIONS
from jaxmem.step.train_step import lm_loss_fn

CFG = PRESETS["tiny"].replace(n_layers=4)
LAYER_INPUT = "<layer input>"


@pytest.fixture(scope="module")
def setup():
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    inputs, targets = lm_batch(CFG, 4, 32, seed=1)
    batch = {"inputs": jnp.asarray(inputs), "targets": jnp.asarray(targets)}
    return graphdef, params, batch


def scalar_loss(graphdef, policy, n_layers=CFG.n_layers):
    loss = lm_loss_fn(graphdef, layers_fn=layers_fn(policy, n_layers))
    return lambda p, b: loss(p, b)[0]


def named(residuals):
    """{name: memory kinds seen} over the computed residuals that carry a name."""
    out: dict[str, set] = {}
    for r in residuals:
        if r.origin == "computed" and r.name is not None and r.name != "<stack output>":
            out.setdefault(r.name, set()).add(r.memory_kind)
    return out


@pytest.fixture(scope="module")
def needed_names(setup):
    """The tags the backward pass reads: what a policy allowed to save every name saves."""
    graphdef, params, batch = setup
    everything = MemoryPolicy.of(BlockPolicy(save=CHECKPOINT_NAMES), name="all")
    return set(named(saved_residuals(scalar_loss(graphdef, everything), params, batch)))


def test_presets_exist_and_unknown_names_are_listed():
    assert set(POLICIES) == {
        *("none", "full", "selective", "mlp", "offload", "nested", "full-host", "nested-host")
    }
    with pytest.raises(ConfigError, match="unknown memory policy 'most'; choose one of: none"):
        get_policy("most")


def test_a_mixed_stack_is_written_one_way_everywhere():
    """``HEAD:K+REST``: what `jaxmem plan` prints is what --policy and config files take."""
    mixed = parse_policy("none:2+selective")
    assert mixed == mixed_policy("none", 2, "selective")
    assert mixed.name == "none:2+selective"
    assert mixed.parts == (
        StackPart(layers=LayerSelection(first=2), block=BLOCKS["none"]),
        StackPart(block=BLOCKS["selective"]),
    )
    assert parse_policy("full") == POLICIES["full"]
    assert policy_from_dict({"policy": "none:2+selective"}) == mixed
    assert policy_from_dict(policy_to_dict(mixed)) == mixed
    for bad, message in [
        ("none:two+full", "neither a preset nor HEAD:K\\+REST"),
        ("none:2", "neither a preset nor HEAD:K\\+REST"),
        ("none:0+full", "neither a preset nor HEAD:K\\+REST"),
        ("most:2+full", "unknown memory policy 'most'"),
        ("none:2+nested", "rest='nested' must name a preset"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_policy(bad)
    with pytest.raises(ConfigError, match="already says which layers"):
        policy_from_dict({"policy": "none:2+full", "layers_first": 3})


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_gradients_equal_the_no_remat_run(setup, name):
    graphdef, params, batch = setup
    base_loss, base_grads = jax.jit(jax.value_and_grad(scalar_loss(graphdef, POLICIES["none"])))(
        params, batch
    )
    loss, grads = jax.jit(jax.value_and_grad(scalar_loss(graphdef, POLICIES[name])))(params, batch)
    tol = tolerance("float32", "remat_vs_none")
    np.testing.assert_allclose(float(loss), float(base_loss), rtol=tol.rtol, atol=tol.atol)
    for a, b in zip(
        jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(base_grads), strict=True
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol.rtol, atol=tol.atol)


@pytest.mark.parametrize("name", ["full", "selective", "mlp", "offload", "nested"])
def test_saved_names_are_exactly_what_the_policy_keeps(setup, needed_names, name):
    graphdef, params, batch = setup
    policy = POLICIES[name]
    seen = named(saved_residuals(scalar_loss(graphdef, policy), params, batch))
    # what the backward needs, of what the policy stores; plus a stored source of an unstored
    # needed tag (selective stores attn_out, not attn_residual, which is recomputed from it)
    block = policy.head
    expected = needed_names & (set(block.save) | set(block.offload))
    if name in ("selective", "offload"):
        expected |= {"attn_out"}
    assert set(seen) - {LAYER_INPUT} == expected
    assert expected - {"block_input"} <= kept_tags(CFG, block)
    for n in block.offload:
        if n in expected:
            assert seen[n] == {"host"}, (n, seen[n])
    for n in block.save:
        if n in expected:
            assert seen[n] == {None}, (n, seen[n])


def test_full_remat_keeps_only_the_block_inputs(setup):
    graphdef, params, batch = setup
    residuals = saved_residuals(scalar_loss(graphdef, POLICIES["full"]), params, batch)
    inputs = [r for r in residuals if r.name == LAYER_INPUT]
    b, s = batch["inputs"].shape
    assert [r.shape for r in inputs] == [(CFG.n_layers, b, s, CFG.d_model)]


def test_nested_keeps_one_input_per_segment(setup):
    graphdef, params, batch = setup
    residuals = saved_residuals(scalar_loss(graphdef, POLICIES["nested"]), params, batch)
    k = nested_segment_size(CFG.n_layers)
    inputs = [r for r in residuals if r.name == LAYER_INPUT]
    b, s = batch["inputs"].shape
    assert [r.shape for r in inputs] == [(CFG.n_layers // k, b, s, CFG.d_model)]


def test_offload_moves_residuals_to_pinned_host_in_eager_vjp(setup):
    graphdef, params, batch = setup
    loss = scalar_loss(graphdef, POLICIES["offload"])
    _, vjp_fn = jax.vjp(lambda p: loss(p, batch), params)
    kinds = {leaf.sharding.memory_kind for leaf in jax.tree_util.tree_leaves(vjp_fn)}
    assert "pinned_host" in kinds and "device" in kinds


def test_offload_cuda_program_places_each_offloaded_name_in_pinned_host(setup, needed_names):
    graphdef, params, batch = setup
    loss = scalar_loss(graphdef, POLICIES["offload"])
    grad = jax.jit(lambda p, b: jax.grad(loss)(p, b))
    text = grad.trace(params, batch).lower(lowering_platforms=("cuda",)).as_text()
    placed = [
        line
        for line in text.splitlines()
        if "annotate_device_placement" in line and '"pinned_host"' in line
    ]
    b, s = batch["inputs"].shape
    bsd, bsf = f"{b}x{s}x{CFG.d_model}xf32", f"{b}x{s}x{CFG.d_ff}xf32"
    heads = f"{b}x{s}x{CFG.n_heads}x{CFG.head_dim}xf32"
    shapes = {
        "query_proj": heads,
        "key_proj": heads,
        "value_proj": heads,
        "mlp_up": bsf,
        "mlp_act": bsf,
    }
    # what the backward reads of the offloaded projections, plus attn_out: the source of the
    # attention residual the norm2 backward reads
    offloaded = kept_tags(CFG, BLOCKS["offload"]) - {"block_input"}
    assert offloaded == {"query_proj", "key_proj", "value_proj", "attn_out", "mlp_up"}
    assert len(placed) == len(offloaded)  # one host placement per offloaded name per layer body
    for name in offloaded:
        assert any(f"tensor<{shapes.get(name, bsd)}>" in line for line in placed), name


def test_offload_changes_device_and_host_bytes_by_the_offloaded_tensors(setup):
    graphdef, params, batch = setup
    offload = summarize_residuals(
        saved_residuals(scalar_loss(graphdef, POLICIES["offload"]), params, batch)
    )
    offload_block = BLOCKS["offload"]
    same_on_device = MemoryPolicy.of(
        BlockPolicy(save=offload_block.save + offload_block.offload), name="x"
    )
    device = summarize_residuals(
        saved_residuals(scalar_loss(graphdef, same_on_device), params, batch)
    )
    assert offload.activation_bytes_host > 0
    assert device.activation_bytes_host == 0
    assert (
        device.activation_bytes_device - offload.activation_bytes_device
        == offload.activation_bytes_host
    )


def test_flops_rise_and_saved_bytes_fall_in_order(setup):
    graphdef, params, batch = setup
    flops, device_bytes = {}, {}
    for name in ("none", "selective", "full", "nested"):
        f = scalar_loss(graphdef, POLICIES[name])
        flops[name] = grad_matmul_flops(f, params, batch)
        device_bytes[name] = summarize_residuals(
            saved_residuals(f, params, batch)
        ).activation_bytes_device
    assert flops["none"] < flops["selective"] < flops["full"] < flops["nested"]
    assert (
        device_bytes["none"]
        > device_bytes["selective"]
        > device_bytes["full"]
        > device_bytes["nested"]
    )
    # Recompute is bounded by one extra forward: forward ≈ 1/3 of fwd+bwd matmul FLOPs.
    assert flops["full"] < flops["none"] * (1 + 1 / 3) + 1


@pytest.mark.slow
def test_layer_selection_checkpoints_only_the_chosen_layers(setup):
    graphdef, params, batch = setup
    policy = MemoryPolicy.of(
        BLOCKS["full"], name="two_of_four", layers=LayerSelection(layers=(0, 2))
    )
    f = scalar_loss(graphdef, policy)
    base = scalar_loss(graphdef, POLICIES["none"])
    full = scalar_loss(graphdef, POLICIES["full"])
    flops = [grad_matmul_flops(g, params, batch) for g in (base, f, full)]
    assert flops[0] < flops[1] < flops[2]
    # Half the layers recomputed: half of full remat's extra FLOPs.
    assert flops[1] - flops[0] == (flops[2] - flops[0]) // 2
    tol = tolerance("float32", "remat_vs_none")
    g1, g0 = jax.jit(jax.grad(f))(params, batch), jax.jit(jax.grad(base))(params, batch)
    for a, b in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g0), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol.rtol, atol=tol.atol)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["none", "selective", "offload"])
def test_an_unrolled_stack_computes_and_keeps_what_the_scan_does(setup, name):
    """``unroll`` changes how XLA can free residuals, not what is computed or kept: the same
    loss, gradients, saved bytes (device and host) and matmul FLOPs as the scanned stack."""
    graphdef, params, batch = setup
    scanned, unrolled = (
        scalar_loss(graphdef, POLICIES[name].replace(unroll=u)) for u in (False, True)
    )
    tol = tolerance("float32", "remat_vs_none")
    (loss0, g0), (loss1, g1) = (
        jax.jit(jax.value_and_grad(f))(params, batch) for f in (scanned, unrolled)
    )
    np.testing.assert_allclose(float(loss1), float(loss0), rtol=tol.rtol, atol=tol.atol)
    for a, b in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g0), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol.rtol, atol=tol.atol)
    s0, s1 = (summarize_residuals(saved_residuals(f, params, batch)) for f in (scanned, unrolled))
    assert (s1.activation_bytes_device, s1.activation_bytes_host) == (
        s0.activation_bytes_device,
        s0.activation_bytes_host,
    )
    assert s1.parameter_copy_bytes == s0.parameter_copy_bytes == 0
    assert grad_matmul_flops(unrolled, params, batch) == grad_matmul_flops(scanned, params, batch)


def test_unrolled_blocks_keep_no_copy_of_their_weights_in_bf16():
    """Each unrolled block slices and casts its weights inside its checkpoint, so under bf16
    ``none`` the backward re-casts them rather than keeping a bf16 copy per block (the scanned
    stack keeps one: 2 bytes per matmul weight); what stays is the head's, as under ``full``."""
    model = make_model(CFG, PRECISIONS["bf16"])
    graphdef, params = nnx.split(model, nnx.Param)
    inputs, targets = lm_batch(CFG, 4, 32, seed=1)
    batch = {"inputs": jnp.asarray(inputs), "targets": jnp.asarray(targets)}
    copies = {
        (name, unroll): summarize_residuals(
            saved_residuals(
                scalar_loss(graphdef, POLICIES[name].replace(unroll=unroll)), params, batch
            )
        ).parameter_copy_bytes
        for name in ("none", "full")
        for unroll in (False, True)
    }
    blocks = params["blocks"]
    matmul_weights = sum(
        leaf.size
        for path, leaf in jax.tree_util.tree_leaves_with_path(blocks)
        if "kernel" in jax.tree_util.keystr(path)
    )
    assert copies["none", False] - copies["full", False] == 2 * matmul_weights
    assert copies["none", True] == copies["full", True] == copies["full", False]


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (
            lambda: BlockPolicy(save=("query_proj", "qkv")),
            "unknown tag name(s) ['qkv']; valid names: block_input",
        ),
        (
            lambda: BlockPolicy(save=("mlp_up",), offload=("mlp_up",)),
            "['mlp_up'] are both saved and offloaded",
        ),
        (
            lambda: BlockPolicy(save_dots=True, offload=("mlp_up",)),
            "save_dots cannot be combined with offload",
        ),
        (
            lambda: MemoryPolicy.of(BlockPolicy(save=("mlp_up",)), nested=True),
            "nested recomputes whole segments",
        ),
        (lambda: BlockPolicy(remat=False, save=("mlp_up",)), "remat=False keeps everything"),
        (
            lambda: MemoryPolicy.of(BLOCKS["none"], nested=True),
            "remat=False keeps everything",
        ),
        (
            lambda: MemoryPolicy.of(BLOCKS["full"], layers=LayerSelection(every=2), nested=True),
            "nested applies to the whole stack: it takes no layer selection",
        ),
        (lambda: LossPolicy(-1), "loss_chunks=-1 must be 0"),
        (lambda: EmbeddingReplay(1), "replay_embedding=1 must be True or False"),
        (lambda: MemoryPolicy(nested=True, unroll=True), "nested runs its segments under scan"),
        (lambda: MemoryPolicy.custom({"mlp_up": "disk"}), "must each be one of"),
        (lambda: LayerSelection(every=2, first=1), "takes one of every/first/layers"),
        (
            lambda: LayerSelection(layers=(0, 9)).indices(4),
            "layer indices [9] are out of range for n_layers=4",
        ),
        (lambda: LayerSelection(first=5).indices(4), "first=5 exceeds n_layers=4"),
    ],
)
def test_invalid_policies_raise_naming_the_value(make, fragment):
    with pytest.raises(ConfigError) as exc:
        make()
    assert fragment in str(exc.value)


def test_offload_on_a_backend_without_pinned_host_raises():
    class NoHostDevice:
        def addressable_memories(self):
            class M:
                kind = "device"

            return [M()]

    with pytest.raises(ConfigError, match="only has memory kinds \\['device'\\]"):
        check_backend(POLICIES["offload"], NoHostDevice())


def test_custom_policy_matches_the_equivalent_preset():
    choices = {n: "device" for n in BLOCKS["selective"].save}
    assert MemoryPolicy.custom(choices, name="selective") == POLICIES["selective"]
    mixed = MemoryPolicy.custom({"query_proj": "offload", "mlp_up": "device"}).head
    assert mixed.offload == ("query_proj",) and mixed.save == ("mlp_up",)
    assert mixed.choice("attn_probs") == "recompute"


def test_a_policy_lays_its_parts_over_the_stack():
    full, none = BLOCKS["full"], BLOCKS["none"]
    assert parse_policy("none:2+selective").runs(5) == [(2, none), (3, BLOCKS["selective"])]
    assert parse_policy("full:4+none").runs(4) == [(4, full)]
    every = MemoryPolicy.of(full, layers=LayerSelection(every=2))
    assert every.layer_blocks(3) == (full, none, full) and every.selects
    assert every.runs(3) == [(1, full), (1, none), (1, full)]
    assert POLICIES["selective"].runs(3) == [(3, BLOCKS["selective"])]
    with pytest.raises(ConfigError, match="layers first=5 exceeds n_layers=4"):
        parse_policy("none:5+full").runs(4)


def test_layer_selection_indices():
    assert LayerSelection(every=2).indices(5) == (0, 2, 4)
    assert LayerSelection(first=2).indices(3) == (0, 1)
    assert LayerSelection(layers=(2, 0)).indices(3) == (0, 2)
    assert LayerSelection().indices(3) == (0, 1, 2)


@pytest.mark.slow
@pytest.mark.parametrize("n_layers", [6, 7])
def test_nested_parameter_slices_are_counted_as_copies(n_layers):
    """When no divisor of L is near √L (7 layers: segments of 3, 3 and 1), nested slices the
    stacked parameters into a head and a tail that the backward keeps: new memory (its XLA:CPU
    plan holds 2.5 MB of temporaries more than full's for a 1.5 MB model), counted as parameter
    copies, not views. Equal segments (6 layers: 2 × 3) slice nothing."""
    cfg = PRESETS["tiny"].replace(n_layers=n_layers)
    graphdef, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    tokens = jnp.zeros((2, 16), jnp.int32)
    loss = lm_loss_fn(graphdef, layers_fn=layers_fn(POLICIES["nested"], n_layers))
    residuals = saved_residuals(
        lambda p, b: loss(p, b)[0], params, {"inputs": tokens, "targets": tokens}
    )
    summary = summarize_residuals(residuals)
    blocks = sum(a.nbytes for a in jax.tree_util.tree_leaves(params["blocks"]))
    if n_layers % 3 == 0:
        assert summary.parameter_copy_bytes == 0
    else:
        # the whole stack, sliced into a head (two 3-block segments) and a 1-block tail
        assert summary.parameter_copy_bytes == blocks
