"""Closed-form memory model of this architecture (bytes), term by term.

Activations: what one block's backward pass must read, per tag (``tag_bytes``), and which tags
that is (``jaxmem.policy.backward_reads``). For the dropout-free pre-norm GELU block with p-byte
activations, ``d_ff = 4h``, ``a`` heads, sequence ``s``, batch ``b`` and hidden ``h``, the
per-layer total is

    p·sbh · (1 norm1 input + 1 norm1_out + 3 q,k,v + 1 context + 1 attn_residual + 1 norm2_out
             + 4 mlp_up + 4 mlp_act) + p·a·s²·b (probabilities, read by probs·v)
             + 4·a·s²·b when p < 4 (softmax runs in fp32 and its backward reads its fp32 output)
    = sbh·(16p + p·a·s/h)  in fp32,    sbh·(32 + 6as/h) in 16-bit.

Korthikanti et al. (2022, eq. 1) derive sbh·(34 + 5as/h) for Megatron's GPT layer, with dropout
(two 1-byte sbh masks, an as²b mask and its 2-byte output) and a 16-bit softmax; this model has
no dropout and an fp32 softmax. Recomputing the attention core (``selective``: probabilities and
context) leaves sbh·15p, i.e. 30·sbh in 16-bit: under half of ``none`` for any as/h ≥ 1.
A ReLU block keeps 4·p·sbh less: ReLU's backward reads its output (kept for the MLP's second
matmul anyway), not its input.

Fused attention (``ModelConfig.attention="fused"``) keeps no [B, H, S, S] tensor: its backward
reads q, k, v, its output (the context) and the row log-sum-exp (4·a·s·b bytes, fp32), so

    none, fused = sbh·16p + 4·a·s·b     (32·sbh + 4·asb in 16-bit: linear in s)

i.e. the naive ``selective`` figure (15p·sbh) plus the context and the log-sum-exp: what is
kept is a little more than selective's, and the FLOPs are fewer (the fused backward recomputes
q·kᵀ once; selective re-runs q·kᵀ and p·v). What the saved-bytes figure leaves out is the
working set: naive attention materialises [B, H, S, S] fp32 scores and probabilities for one
layer at a time in the forward (and again in a recompute), the fused op one [B, H, S, block]
tile (compiled plans show it).

A Llama-family block (RMSNorm, RoPE, SwiGLU, grouped-query attention with ``Hkv`` key/value
heads) reads, per layer and with the same attention core,

    p·sbh · (1 + 1 + 1 + 2·Hkv/H + 1 + 1 + 1)    block input, norm1_out, rotated q; rotated k
                                                 and v (Hkv/H wide); context, attn_residual,
                                                 norm2_out
    + p·s·b·F · 3                                gate, up and the product act(gate)·up

RoPE's rotations are recomputed from the projections by every policy that keeps those (a
rotation costs no matmul), so ``selective`` keeps q, k, v, the output projection, gate and up
(``tag_bytes`` sizes each tensor; ``kept_tags`` says which a policy keeps).

Parameters, gradients and optimizer state are counted from the config (``jaxmem.config``'s
analytic parameter count); tests check each against real arrays.

With LoRA adapters (``jaxmem.adapters.AdapterConfig``, ``adapter_state``) the base is frozen: no
gradient, no optimizer state. Its block projections are stored as ``base`` says (``compute``:
the parameter dtype; ``int8``: one byte a weight and one fp32 absmax per output channel, as
bitsandbytes' row-wise int8; ``nf4``: half a byte a weight, per 64 weights one 8-bit absmax, per
256 of those one fp32 scale, one fp32 offset per matrix: QLoRA's double quantization), the
embeddings, LM head and norms in the parameter dtype (bitsandbytes quantizes linear layers and
Hugging Face leaves the LM head out). Trained: ``A [in, r]`` and ``B [r, out]`` per targeted
projection per layer (the fused q/k/v kernel counted per part) and the norms ``train``
unfreezes, each with its gradient and optimizer state in the parameter dtype.
"""

from __future__ import annotations

import dataclasses
import math

from jaxmem.adapters import AdapterConfig
from jaxmem.config import ModelConfig, OptimizerConfig
from jaxmem.parallel import ParallelConfig, shard_elements, tensor_share
from jaxmem.policy import (
    BLOCK_INPUT,
    CHECKPOINT_NAMES,
    MemoryPolicy,
    backward_reads,
    kept_tags,
    nested_segment_size,
    recomputed_from,
)
from jaxmem.precision import Precision
from jaxmem.quant import packed_bytes

FP32 = 4
ROPE_SOURCES = ("query_proj", "key_proj")  # RoPE rotates them: the backward reads the rotations


# What every analytic activation figure covers: the blocks. At gpt2-1.5b, batch 1 x 1024, the
# head's fp32 log-probabilities alone are 196 MiB beside full's 300 MiB of block inputs.
ANALYTIC_SOURCE = (
    "analytic model (jaxmem.memory.analytic): the block stack only; embeddings, final norm, "
    "LM head and loss excluded"
)


def tag_bytes(cfg: ModelConfig, batch: int, seq_len: int, precision: Precision) -> dict[str, int]:
    """Bytes of each tagged tensor of one block (every architecture's tags: those ``cfg`` does
    not produce are sized as if it did). Keys and values are ``kv_heads`` wide (grouped-query
    attention); scores and the fused op's log-sum-exp are fp32 (or wider); probabilities are
    cast to the compute dtype (``jaxmem.model.SelfAttention``)."""
    p = precision.compute_bytes
    bsd = batch * seq_len * cfg.d_model
    bskv = batch * seq_len * cfg.kv_dim
    bhss = batch * cfg.n_heads * seq_len * seq_len
    bsf = batch * seq_len * cfg.d_ff
    sizes = {
        "block_input": bsd * p,
        "norm1_out": bsd * p,
        "query_proj": bsd * p,
        "key_proj": bskv * p,
        "value_proj": bskv * p,
        "query_rope": bsd * p,
        "key_rope": bskv * p,
        "attn_scores": bhss * max(p, FP32),
        "attn_probs": bhss * p,
        "attn_lse": batch * cfg.n_heads * seq_len * max(p, FP32),
        "attn_context": bsd * p,
        "attn_out": bsd * p,
        "attn_residual": bsd * p,
        "norm2_out": bsd * p,
        "mlp_gate": bsf * p,
        "mlp_up": bsf * p,
        "mlp_act": bsf * p,
        "mlp_down": bsd * p,
        "mlp_residual": bsd * p,
    }
    assert set(sizes) == set(CHECKPOINT_NAMES)
    return sizes


@dataclasses.dataclass(frozen=True)
class ActivationEstimate:
    device_bytes: int
    host_bytes: int
    per_layer: tuple[int, ...]  # device + host bytes of each layer
    # of host_bytes, the block (or nested segment) inputs in host memory (``full-host``,
    # ``nested-host``, a per-tag block offloading ``block_input``): what a host-memory check
    # needs of a policy; each crosses the host link twice per step (out in the forward, back
    # for its block's recompute)
    input_host_bytes: int = 0


def saved_activation_bytes(
    cfg: ModelConfig,
    policy: MemoryPolicy,
    batch: int,
    seq_len: int,
    precision: Precision,
    parallel: ParallelConfig | None = None,
) -> ActivationEstimate:
    """What the blocks keep for the backward pass at the end of the forward, by policy.

    - no remat: every tag the backward reads;
    - remat: the block input (in host memory when the policy offloads ``block_input``:
      ``full-host``) plus the tags the policy saves (device) or offloads (host) that the
      backward reads or recomputes a read tag from (``kept_tags``; stored probabilities are the
      fp32 softmax output only, see ``_remat_kept_bytes``): ``selective`` stores the six
      projections (q/k/v, attn_out, mlp_up, mlp_down) and keeps q, k, v, mlp_up and attn_out
      (the source of attn_residual);
    - ``save_dots`` (custom policies: every matmul without batch dimensions): q, k, v and
      mlp_up;
    - nested: one input per segment (``nested_segment_size``: about √L blocks; in host memory
      under ``nested-host``);
    - several parts (``MemoryPolicy.parts``): each part's blocks under its own block policy;
    - ``EmbeddingReplay``: the first block without its input (the lookup is replayed).
    Embeddings, the LM head and the loss are outside this model. With tensor parallelism
    (``parallel.tp``) each tag is one device's share of it (``jaxmem.parallel.tensor_share``:
    Megatron's layout, with or without sequence parallelism); ``batch`` is one device's rows.
    """
    sizes = tag_bytes(cfg, batch, seq_len, precision)
    if parallel is not None and parallel.tensor_parallel:
        sizes = {n: b // tensor_share(n, cfg, parallel) for n, b in sizes.items()}
    reads = backward_reads(cfg)
    everything = sum(sizes[n] + _fp32_softmax_extra(n, sizes, precision) for n in reads)
    if policy.nested:
        k = nested_segment_size(cfg.n_layers)
        n_seg = math.ceil(cfg.n_layers / k)
        per_layer = [sizes["block_input"] if i % k == 0 else 0 for i in range(cfg.n_layers)]
        inputs = n_seg * sizes["block_input"]
        if BLOCK_INPUT in policy.head.offload:  # the segments' inputs in host memory
            return ActivationEstimate(0, inputs, tuple(per_layer), inputs)
        return ActivationEstimate(inputs, 0, tuple(per_layer))
    blocks = policy.layer_blocks(cfg.n_layers)
    device = host = inputs = 0
    per_layer = []
    for i, block in enumerate(blocks):
        if not block.remat:
            device += everything
            per_layer.append(everything)
            continue
        if block.save_dots:
            sources = {recomputed_from(cfg)[n] for n in reads if n in recomputed_from(cfg)}
            dots = {"query_proj", "key_proj", "value_proj", "mlp_gate", "mlp_up"}
            kept = dots & (reads | (sources & set(ROPE_SOURCES)))
            on_device, on_host = kept | {"block_input"}, set()
        else:
            kept = kept_tags(cfg, block) | {BLOCK_INPUT}
            on_host = set(block.offload) & kept
            on_device = kept - on_host
        if i == 0 and policy.embedding.replay:  # neither copy: the lookup is replayed
            on_device, on_host = on_device - {BLOCK_INPUT}, on_host - {BLOCK_INPUT}
        d = sum(_remat_kept_bytes(n, sizes) for n in on_device)
        h = sum(_remat_kept_bytes(n, sizes) for n in on_host)
        device += d
        host += h
        inputs += sizes[BLOCK_INPUT] if BLOCK_INPUT in on_host else 0
        per_layer.append(d + h)
    return ActivationEstimate(device, host, tuple(per_layer), inputs)


def mlp_working_bytes(
    cfg: ModelConfig, policy: MemoryPolicy, batch: int, seq_len: int, precision: Precision
) -> int:
    """The MLP's ``[B, tokens, d_ff]`` intermediates one block holds at once while it runs its
    MLP (forward, a rematerialising block's recompute, the backward's working set), the gate,
    up and activation of a gated MLP (up and activation otherwise), in the compute dtype:
    ``tokens`` is the whole sequence, or one tile's ``MemoryPolicy.mlp_tile_tokens`` under
    sequence tiling (``jaxmem.memory.remat.tiled_mlp``). A transient, not a kept residual
    (``saved_activation_bytes``), and not a bound on what tiling saves: the backward also holds
    their gradients, as the compiler schedules it (XLA:CPU, tiny with d_ff 4,096 at 4 x 256
    tokens under ``full``: 32 MiB here, 60.6 MiB off the plan with 64-token tiles; the H100
    plans in ``docs/policies.md``)."""
    tokens = policy.mlp_tile_tokens or seq_len
    tensors = 3 if cfg.mlp == "gated" else 2
    return tensors * batch * tokens * cfg.d_ff * precision.compute_bytes


def _remat_kept_bytes(name: str, sizes: dict[str, int]) -> int:
    """Bytes a rematerialised block keeps for a stored tag. ``attn_probs`` is tagged on softmax's
    fp32 (or wider) output, before the cast to the compute dtype (``ops.softmax``): a policy that
    stores it keeps that tensor only and recomputes the cast (measured: bf16 ``mlp`` on tiny keeps
    256 KiB of probabilities, not 384)."""
    return sizes["attn_scores"] if name == "attn_probs" else sizes[name]


def _fp32_softmax_extra(name: str, sizes: dict[str, int], precision: Precision) -> int:
    """Keeping the probabilities in 16-bit also keeps softmax's fp32 output (its backward reads
    it), unless the compute dtype is fp32 (or wider) and the two are one tensor."""
    if name != "attn_probs" or precision.compute_bytes >= FP32:
        return 0
    return sizes["attn_scores"]  # a [B, H, S, S] fp32 tensor


def param_bytes(cfg: ModelConfig, precision: Precision) -> int:
    return cfg.n_params * precision.param_bytes


def opt_state_bytes(cfg: ModelConfig, opt: OptimizerConfig, precision: Precision) -> int:
    """AdamW: two moments; SGD: one momentum buffer; Adafactor: row + column second-moment
    factors for matrices whose dims are both >= 128 (optax's default), a full second moment
    otherwise. Counters and scalars are ignored (a few bytes)."""
    return _state_bytes(_param_shapes(cfg), opt, precision)


def _state_bytes(shapes: list[tuple[int, ...]], opt: OptimizerConfig, precision: Precision) -> int:
    """``opt``'s state for parameters of ``shapes`` (see ``opt_state_bytes``)."""
    p = precision.param_bytes
    if opt.name == "adamw":
        return 2 * sum(map(math.prod, shapes)) * p
    if opt.name == "sgd":
        return sum(map(math.prod, shapes)) * p
    total = 0
    for shape in shapes:
        if len(shape) >= 2 and min(shape[-2:]) >= 128:
            total += (math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]) * FP32
        else:
            total += math.prod(shape) * FP32
    return total


def model_state_bytes(
    cfg: ModelConfig,
    opt: OptimizerConfig,
    precision: Precision,
    parallel: ParallelConfig,
    adapters: AdapterConfig | None = None,
) -> dict[str, int]:
    """Per device: parameters, gradients and optimizer state under a data-parallel strategy.
    ZeRO's accounting (Rajbhandari et al. 2020: with fp32 master weights and AdamW, 4 + 4 + 8 =
    16 bytes per parameter, here in the run's dtypes), divided by N for what the strategy shards
    (``zero1``: the optimizer state; ``fsdp``: all three) except the leaves with no dimension
    divisible by N, which every device holds whole (``jaxmem.parallel.shard_dim``); dp divides
    nothing. Adafactor's factors are counted whole when sharded (small; not divided here).
    With ``adapters`` enabled: ``adapter_state``'s figures (a frozen base, gradients and state
    of the trained parameters only), what the strategy shards divided by N (rounded up; a
    tensor-parallel split is not modelled there: each device counted as holding them whole)."""
    n = parallel.devices if parallel.sharded else 1
    if adapters is not None and adapters.enabled:
        state = adapter_state(cfg, adapters, opt, precision)

        def share(nbytes: int, sharded: bool) -> int:
            return -(-nbytes // n) if sharded else nbytes

        return {
            "params": share(state.params_bytes, parallel.shards_params),
            "grads": share(state.grads_bytes, parallel.shards_params),
            "opt_state": share(state.opt_state_bytes, parallel.shards_opt_state),
        }
    p = precision.param_bytes

    def held(shard: bool) -> int:
        total = 0
        for shape, stacked in _param_shapes_stacked(cfg):
            total += shard_elements(shape, n, stacked) if shard else math.prod(shape)
        return total * p

    params = held(parallel.shards_params)
    moments = {"adamw": 2, "sgd": 1}.get(opt.name)
    if moments is None:  # adafactor: factored, a small fraction of the parameters
        state = opt_state_bytes(cfg, opt, precision)
    else:
        state = moments * held(parallel.shards_opt_state)
    return {"params": params, "grads": params, "opt_state": state}


def _param_shapes_stacked(cfg: ModelConfig) -> list[tuple[tuple[int, ...], bool]]:
    """Every parameter's shape, with whether it is one of the blocks' stacked ``[L, ...]``
    parameters (sharding never splits their layer axis)."""
    d, f, L = cfg.d_model, cfg.d_ff, cfg.n_layers
    qkv = d + 2 * cfg.kv_dim
    outside = [(cfg.vocab_size, d)] + ([(cfg.max_seq_len, d)] if cfg.learned_positions else [])
    stacked = [(L, d, qkv), (L, d, d), (L, d, f), (L, f, d), (L, d), (L, d)]
    if cfg.mlp == "gated":
        stacked.append((L, d, f))
    if cfg.has_bias("qkv"):
        stacked.append((L, qkv))
    if cfg.has_bias("out"):
        stacked.append((L, d))
    if cfg.has_bias("mlp"):
        stacked += [(L, f)] * (2 if cfg.mlp == "gated" else 1) + [(L, d)]
    if cfg.has_bias("norm"):
        stacked += [(L, d), (L, d)]
    if cfg.final_norm:
        outside += [(d,)] + ([(d,)] if cfg.has_bias("norm") else [])
    if not cfg.tie_embeddings:
        outside.append((d, cfg.vocab_size))
    return [(s, False) for s in outside] + [(s, True) for s in stacked]


def _param_shapes(cfg: ModelConfig) -> list[tuple[int, ...]]:
    return [shape for shape, _ in _param_shapes_stacked(cfg)]


# ------------------------------------------------------------- adapters: LoRA on a frozen base
ADAPTER_SOURCE = (
    "analytic: from the config's shapes (jaxmem.memory.analytic.adapter_state); the frozen base "
    "has no gradient and no optimizer state"
)


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """``(in, out)`` of each block projection, by the name PEFT gives it on a Hugging Face Llama
    (jaxmem's fused q/k/v kernel counted per part; a standard MLP has no ``gate``)."""
    d, f, kv = cfg.d_model, cfg.d_ff, cfg.kv_dim
    shapes = {"q": (d, d), "k": (d, kv), "v": (d, kv), "o": (d, d), "up": (d, f), "down": (f, d)}
    if cfg.mlp == "gated":
        shapes["gate"] = (d, f)
    return shapes


def lora_shapes(cfg: ModelConfig, adapters: AdapterConfig) -> list[tuple[int, int]]:
    """``A [in, r]`` and ``B [r, out]`` of every adapter: one pair per target per layer."""
    r, shapes = adapters.rank, projection_shapes(cfg)
    pairs = [((shapes[t][0], r), (r, shapes[t][1])) for t in adapters.targets]
    return [shape for pair in pairs for shape in pair] * cfg.n_layers


def norm_shapes(cfg: ModelConfig) -> list[tuple[int, ...]]:
    """Every norm's scale (and bias): two per block, stacked ``[L, D]``, and the final norm's."""
    per_norm = 2 if cfg.has_bias("norm") else 1
    shapes: list[tuple[int, ...]] = [(cfg.n_layers, cfg.d_model)] * (2 * per_norm)
    return shapes + ([(cfg.d_model,)] * per_norm if cfg.final_norm else [])


def frozen_matrix_bytes(n_in: int, n_out: int, base: str, param_bytes: int) -> int:
    """One frozen ``[in, out]`` projection stored as ``base``: ``compute`` in the parameter dtype;
    ``int8`` one byte a weight plus one fp32 absmax per output channel (bitsandbytes'
    ``int8_vectorwise_quant``: ``CB`` and ``SCB``); ``nf4`` two weights a byte plus, per block of
    64, one 8-bit absmax, per 256 such one fp32 scale, and one fp32 offset (bitsandbytes'
    ``quantize_4bit(blocksize=64, compress_statistics=True)``: the packed weights, ``absmax``,
    ``state2.absmax`` and ``offset``; its two lookup tables, 16 and 256 fp32 values, are
    constants jaxmem keeps once, not per matrix)."""
    if base in ("int8", "nf4"):
        return packed_bytes(base, n_out, n_in)  # the packing's own count (jaxmem.quant)
    return n_in * n_out * param_bytes


@dataclasses.dataclass(frozen=True)
class AdapterState:
    """A LoRA job's parameters (counts and bytes), gradients and optimizer state (bytes)."""

    quantized_params: int  # the frozen block projections (stored as ``base``)
    quantized_bytes: int
    other_frozen_params: int  # embeddings, LM head, biases, norms left frozen (parameter dtype)
    other_frozen_bytes: int
    adapter_params: int  # every A and B
    norm_params: int  # the norms ``train`` unfreezes
    trainable_bytes: int
    grads_bytes: int
    opt_state_bytes: int

    @property
    def frozen_params(self) -> int:
        return self.quantized_params + self.other_frozen_params

    @property
    def trainable_params(self) -> int:
        return self.adapter_params + self.norm_params

    @property
    def params_bytes(self) -> int:
        return self.quantized_bytes + self.other_frozen_bytes + self.trainable_bytes

    def as_record(self) -> dict[str, int | str]:
        """Every figure, the derived totals and how they were obtained (JSON records)."""
        derived = ("frozen_params", "trainable_params", "params_bytes")
        return {
            **dataclasses.asdict(self),
            **{name: getattr(self, name) for name in derived},
            "source": ADAPTER_SOURCE,
        }


def adapter_state(
    cfg: ModelConfig, adapters: AdapterConfig, opt: OptimizerConfig, precision: Precision
) -> AdapterState:
    """What a LoRA job holds besides activations (see the module docstring): the frozen base by
    storage, the adapters and unfrozen norms, and gradients and ``opt`` state for those only."""
    p = precision.param_bytes
    matrices = list(projection_shapes(cfg).values())
    quantized = cfg.n_layers * sum(i * o for i, o in matrices)
    stored = sum(frozen_matrix_bytes(i, o, adapters.base, p) for i, o in matrices)
    norms = norm_shapes(cfg) if "norm" in adapters.train else []
    trained = lora_shapes(cfg, adapters) + norms
    norm_params = sum(map(math.prod, norms))
    trainable = sum(map(math.prod, trained))
    other_frozen = cfg.n_params - quantized - norm_params
    return AdapterState(
        quantized_params=quantized,
        quantized_bytes=cfg.n_layers * stored,
        other_frozen_params=other_frozen,
        other_frozen_bytes=other_frozen * p,
        adapter_params=trainable - norm_params,
        norm_params=norm_params,
        trainable_bytes=trainable * p,
        grads_bytes=trainable * p,
        opt_state_bytes=_state_bytes(trained, opt, precision),
    )


def context_parallel_bytes(
    cfg: ModelConfig, precision: Precision, policy: MemoryPolicy, *, rows: int, seq_len: int,
    cp: int, tp: int = 1, form: str = "gather",
) -> int:  # fmt: skip
    """Bytes per device and step over the interconnect for a context axis of ``cp`` devices,
    from shapes: each block's keys and values, ``2 [S, Hkv K]`` per row (one tensor device's
    heads), reach every device in the forward and again in a rematerialised block's recompute
    (all-gathered, or passed round the ring in ``cp - 1`` steps: ``(cp - 1) / cp`` of them
    either way); the backward returns their gradients (the gathered form reduce-scatters them
    in the compute type; the ring passes keys and values in the compute type and their fp32
    gradients ``cp`` steps round). 0 without a context axis."""
    if cp == 1:
        return 0
    kv = 2 * rows * seq_len * cfg.kv_heads * cfg.head_dim // tp  # elements of K and V, a row
    passes = 2 if policy.head.remat else 1
    forward = passes * kv * precision.compute_bytes * (cp - 1) / cp
    if form == "ring":
        backward = kv * (precision.compute_bytes + 4)  # cp steps of S / cp positions each
    else:
        backward = kv * precision.compute_bytes * (cp - 1) / cp
    return int((forward + backward) * cfg.n_layers)


def korthikanti_bytes_per_layer(cfg: ModelConfig, batch: int, seq_len: int) -> int:
    """Megatron's GPT layer in 16-bit with dropout: s·b·h·(34 + 5·a·s/h) (for reference)."""
    sbh = seq_len * batch * cfg.d_model
    return int(sbh * (34 + 5 * cfg.n_heads * seq_len / cfg.d_model))


def head_flops(cfg: ModelConfig, rows: int, seq_len: int) -> int:
    """Matmul FLOPs of the LM head in one training step: the forward's logits and the
    backward's two matmuls, 6·tokens·D·V (tensor parallelism keeps it whole on each device)."""
    return 6 * rows * seq_len * cfg.d_model * cfg.vocab_size


def frozen_base_flops(cfg: ModelConfig, adapters: AdapterConfig, batch: int, seq_len: int) -> int:
    """What a LoRA step computes less than full training, in matmul FLOPs (negative: more):
    a frozen base forms no weight gradients, 2·tokens·(L·projections + D·V) (the block
    projections and the LM head or tied table), and every adapter ``[a, b]`` adds its forward
    and both backward matmuls, 6·tokens·a·b. 0 without adapters."""
    if not adapters.enabled:
        return 0
    t = batch * seq_len
    projections = sum(i * o for i, o in projection_shapes(cfg).values())
    weight_grads = 2 * t * (cfg.n_layers * projections + cfg.d_model * cfg.vocab_size)
    return weight_grads - 6 * t * sum(map(math.prod, lora_shapes(cfg, adapters)))


def model_flops(
    cfg: ModelConfig, batch: int, seq_len: int, adapters: AdapterConfig | None = None
) -> int:
    """Matmul FLOPs of one training step without remat (forward + backward = 3 × forward):
    projections 2·tokens·(D·(D + 2·D_kv) + D² + m·D·F) per layer (D_kv = kv_heads·head_dim:
    grouped-query attention shrinks k and v; m = 2 matrices in a standard MLP, 3 in a gated
    one), attention 2·2·B·S²·D per layer (every query head scores every key), LM head
    2·tokens·D·V; fused attention adds the q·kᵀ its backward recomputes, 2·B·S²·D per layer
    (masked blocks counted, as both frameworks' counters do). With ``adapters``, less what a
    frozen base does not compute (``frozen_base_flops``)."""
    t = batch * seq_len
    d, f = cfg.d_model, cfg.d_ff
    mats = 3 if cfg.mlp == "gated" else 2
    projections = d * (d + 2 * cfg.kv_dim) + d * d + mats * d * f
    per_layer = 2 * t * projections + 4 * batch * seq_len * seq_len * d
    forward = cfg.n_layers * per_layer + 2 * t * d * cfg.vocab_size
    recomputed = 2 * batch * seq_len * seq_len * d if cfg.attention == "fused" else 0
    frozen = frozen_base_flops(cfg, adapters, batch, seq_len) if adapters else 0
    return 3 * forward + cfg.n_layers * recomputed - frozen


def mfu_flops(
    cfg: ModelConfig, batch: int, seq_len: int, adapters: AdapterConfig | None = None
) -> int:
    """The model FLOPs MFU counts: one training step's matmuls without any recompute, 3 x the
    forward (PaLM's definition; torchtitan's 6·N + 12·L·H·Q·T per token and Megatron's formula
    count the same, full S² attention included): ``model_flops`` less fused attention's
    recomputed q·kᵀ."""
    recomputed = 2 * batch * seq_len * seq_len * cfg.d_model if cfg.attention == "fused" else 0
    return model_flops(cfg, batch, seq_len, adapters) - cfg.n_layers * recomputed
