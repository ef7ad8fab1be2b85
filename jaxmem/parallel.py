"""Data-parallel strategies as data, like memory policies (``jaxmem.policy``): what each device
holds when a step runs on N devices. Pure data (no JAX, no PyTorch); ``jaxmem.sharding`` turns a
``ParallelConfig`` into JAX shardings, applied to the step from outside (the model never
changes).

- ``dp``: every device holds the parameters, gradients and optimizer state; the batch is split
  and gradients are all-reduced (PyTorch DDP; FSDP2 with ``NO_SHARD``-like replication).
- ``zero1``: as ``dp`` but the optimizer state is sharded (ZeRO stage 1): each device updates
  its shard and the new parameters are all-gathered.
- ``fsdp``: parameters, gradients and optimizer state sharded (ZeRO stage 3, PyTorch FSDP2's
  ``fully_shard``): each scanned block's weights are all-gathered for its forward and backward
  and its gradients reduce-scattered.

On the command line a strategy and its device count are one mesh axis: ``--mesh fsdp=4``; a
tensor axis (``tp=N``) and a context axis (``cp=N``: the sequence split over devices,
``jaxmem.step.context``) are further axes: ``--mesh fsdp=2,cp=2``.
"""

from __future__ import annotations

import dataclasses
import os

from jaxmem.config import ConfigError, ModelConfig, require

STRATEGIES: dict[str, str] = {
    "dp": "parameters, gradients and optimizer state replicated; gradients all-reduced",
    "zero1": "optimizer state sharded (ZeRO-1); parameters and gradients replicated",
    "fsdp": "parameters, gradients and optimizer state sharded (ZeRO-3, FSDP)",
}


# how context-parallel attention meets the keys of the other devices (jaxmem.step.context)
CP_ATTENTIONS: dict[str, str] = {
    "gather": "all-gather the row's keys and values (one collective; the default)",
    "ring": "pass keys and values device to device: never whole on one device (fused attention)",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How a step is spread over devices: a data-parallel axis (``strategy``) and, optionally, a
    tensor-parallel one (``tp``: Megatron's layout, ``jaxmem.sharding.TENSOR``).

    Attributes:
      strategy: one of ``STRATEGIES`` (the data-parallel axis).
      devices: how many devices the whole mesh spans (1: a single device, no sharding at all,
        whatever the strategy); the data-parallel axis has ``devices // tp`` of them.
      tp: the tensor-parallel axis: each block's attention heads and MLP columns split over
        ``tp`` devices (q/k/v/gate/up column-parallel, out/down row-parallel); 1: none.
      sequence_parallel: with ``tp > 1``, the residual stream, norms and the blocks' inputs and
        outputs are split by sequence over the ``tp`` devices between the attention and MLP
        regions (Korthikanti et al., 2022) instead of replicated on each.
      cp: the context-parallel axis: each row's sequence split over ``cp`` devices in ``2 cp``
        chunks (device i holds chunks i and 2 cp - 1 - i: the same causal work on each), keys
        and values all-gathered over it for attention or passed round it (``cp_attention``;
        ``jaxmem.step.context``); 1: none. The
        data-parallel strategy's shards span the data and context devices together (FSDP over
        both, as torchtitan does), the batch's rows only the data devices.
      cp_attention: how attention meets the other context devices' keys and values, one of
        ``CP_ATTENTIONS``: ``"gather"`` (``jaxmem.step.context``) or ``"ring"``
        (``jaxmem.step.ring``: ``--attention fused`` only).
    """

    strategy: str = "dp"
    devices: int = 1
    tp: int = 1
    sequence_parallel: bool = True
    cp: int = 1
    cp_attention: str = "gather"

    def __post_init__(self) -> None:
        require(
            self.strategy in STRATEGIES,
            f"parallel strategy={self.strategy!r} is not one of {', '.join(STRATEGIES)}",
        )
        for name in ("devices", "tp", "cp"):
            value = getattr(self, name)
            require(
                isinstance(value, int) and not isinstance(value, bool) and value > 0,
                f"parallel {name}={value!r} must be a positive integer",
            )
        require(
            self.devices % (self.tp * self.cp) == 0,
            f"parallel devices={self.devices} is not a multiple of tp={self.tp} x cp={self.cp}: "
            "the mesh is data x tensor x context devices",
        )
        require(
            self.cp_attention in CP_ATTENTIONS,
            f"--cp-attention {self.cp_attention!r} (parallel.cp_attention) is not one of "
            f"{', '.join(CP_ATTENTIONS)}",
        )
        if self.cp_attention != "gather" and self.cp == 1:  # the example built only when said
            raise ConfigError(
                f"--cp-attention {self.cp_attention} (parallel.cp_attention) needs a context "
                f"axis: add cp=N to --mesh (e.g. --mesh {self._with_context()})"
            )
        require(
            isinstance(self.sequence_parallel, bool),
            f"parallel sequence_parallel={self.sequence_parallel!r} must be true or false",
        )

    def _with_context(self) -> str:
        """This mesh with a context axis of 2 beside its axes (for a refusal's example)."""
        two = dataclasses.replace(self, devices=2 * self.devices, cp=2, cp_attention="gather")
        return two.mesh_text()

    @property
    def data(self) -> int:
        """Devices on the data-parallel axis (the batch splits over these)."""
        return self.devices // (self.tp * self.cp)

    @property
    def context_parallel(self) -> bool:
        return self.cp > 1

    @property
    def state_shards(self) -> int:
        """Devices the strategy shards parameters or optimizer state over: the data and the
        context axis together (each context device holds the same parameters)."""
        return self.data * self.cp

    @property
    def sharded(self) -> bool:
        """Runs on more than one device."""
        return self.devices > 1

    @property
    def tensor_parallel(self) -> bool:
        return self.tp > 1

    @property
    def shards_params(self) -> bool:
        return self.state_shards > 1 and self.strategy == "fsdp"

    @property
    def shards_opt_state(self) -> bool:
        return self.state_shards > 1 and self.strategy in ("zero1", "fsdp")

    def mesh_text(self) -> str:
        if self.tp == 1 and self.cp == 1:
            return f"{self.strategy}={self.devices}"
        if self.cp > 1:  # fsdp=1,cp=8: the state sharded over the context devices alone
            named = self.data > 1 or self.strategy != "dp"
            tensor = f",tp={self.tp}" if self.tp > 1 else ""
            return (f"{self.strategy}={self.data}," if named else "") + f"cp={self.cp}{tensor}"
        data = f"{self.strategy}={self.data}," if self.data > 1 else ""
        return f"{data}tp={self.tp}"

    def check_batch(self, batch_size: int, accum_steps: int = 1) -> None:
        """Every microbatch must split evenly over the data-parallel devices."""
        micro = batch_size // accum_steps
        require(
            micro % self.data == 0,
            f"microbatch size {micro} (batch {batch_size} / accum {accum_steps}) does not split "
            f"over --mesh {self.mesh_text()}: use a batch size that is a multiple of "
            f"{self.data * accum_steps}",
        )

    def check_model(self, cfg: ModelConfig, seq_len: int) -> None:
        """Tensor parallelism splits whole attention heads (in the layout the attention runs:
        under grouped-query attention either the key/value heads or each one's group of query
        heads), the MLP's columns and, with sequence parallelism, the sequence evenly over
        ``tp`` devices; context parallelism cuts the sequence into ``2 cp`` equal chunks."""
        mesh = f"--mesh {self.mesh_text()}"
        require(
            self.cp == 1 or seq_len % (2 * self.cp) == 0,
            f"{mesh}: context parallelism cuts the {seq_len} positions into 2 x cp = "
            f"{2 * self.cp} equal chunks; use a --seq-len that is a multiple of {2 * self.cp}",
        )
        require(
            self.cp_attention != "ring" or cfg.attention == "fused",
            f"{mesh} --cp-attention ring merges each device's partial softmax, which the "
            f"fused attention does; the model's attention is {cfg.attention!r}: add "
            "--attention fused",
        )
        if self.tp == 1:
            return
        require(
            cfg.n_heads % self.tp == 0,
            f"{mesh}: the model's {cfg.n_heads} query heads do not split over tp={self.tp}; use "
            f"a tp that divides {cfg.n_heads}",
        )
        require(
            cfg.d_ff % self.tp == 0,
            f"{mesh}: the model's MLP width d_ff={cfg.d_ff} does not split over tp={self.tp}; "
            f"use a tp that divides {cfg.d_ff}",
        )
        groups = cfg.n_heads // cfg.kv_heads
        require(
            self.cp == 1 or cfg.kv_heads % self.tp == 0,
            f"{mesh}: context-parallel attention splits whole key/value heads over the tensor "
            f"axis; the model's {cfg.kv_heads} do not split over tp={self.tp}: use a tp that "
            f"divides {cfg.kv_heads}",
        )
        require(
            not grouped_heads(cfg) or cfg.kv_heads % self.tp == 0 or groups % self.tp == 0,
            f"{mesh}: grouped-query attention runs {cfg.kv_heads} key/value heads of {groups} "
            f"query heads each; neither splits over tp={self.tp}: use a tp that divides "
            f"{cfg.kv_heads} or {groups}",
        )
        require(
            not self.sequence_parallel or seq_len % (self.tp * self.cp) == 0,
            f"{mesh}: sequence parallelism splits the {seq_len} positions over tp={self.tp}"
            + (f" within each of cp={self.cp} shares" if self.cp > 1 else "")
            + f"; use a --seq-len that is a multiple of {self.tp * self.cp} or set "
            "parallel.sequence_parallel=false",
        )


def balanced_order(seq_len: int, cp: int) -> list[int]:
    """The positions in the order a context axis of ``cp`` devices holds them, device ``i``
    the ``i``-th ``S / cp`` of it: chunks ``i`` and ``2 cp - 1 - i`` of ``2 cp`` equal chunks
    (every device as many early as late queries: the same causal work on each)."""
    n = seq_len // (2 * cp)
    chunks = [list(range(c * n, (c + 1) * n)) for c in range(2 * cp)]
    return [p for i in range(cp) for p in chunks[i] + chunks[2 * cp - 1 - i]]


def context_refusal(
    parallel: ParallelConfig, *, stream: bool, adapter_dropout: float
) -> str | None:
    """The one line saying why a context axis cannot run with what the job asks (None: it
    can). Every flag named is the one to drop."""
    if not parallel.context_parallel:
        return None
    mesh = f"--mesh {parallel.mesh_text()}"
    if stream:
        return f"{mesh} (context parallelism) with --stream: not built yet; drop --stream"
    if adapter_dropout:
        return (
            f"{mesh} (context parallelism) with adapter dropout {adapter_dropout}: the masks "
            "are drawn per row in position order, not in the split order; set the adapters' "
            "dropout to 0"
        )
    return None


# Megatron's layout of a block's tagged activations over ``tp`` devices, by tag (the same layout
# ``jaxmem.sharding.tag_spec`` constrains the step to, here as the share of each tensor one
# device holds): heads and MLP columns split; the residual stream and what the row-parallel
# matmuls return split by sequence with sequence parallelism, whole without.
QUERY_TAGS = ("query_proj", "query_rope")  # [B, S, H, K] (grouped: [B, S, Hkv, G, K])
SCORE_TAGS = ("attn_scores", "attn_probs", "attn_lse")  # [B, H, S, S] (grouped [B, Hkv, G, S, S])
HEAD_TAGS = QUERY_TAGS + SCORE_TAGS
KV_TAGS = ("key_proj", "value_proj", "key_rope")
COLUMN_TAGS = ("attn_context", "mlp_up", "mlp_gate", "mlp_act")
STREAM_TAGS = (
    "block_input",
    "norm1_out",
    "attn_out",
    "attn_residual",
    "norm2_out",
    "mlp_down",
    "mlp_residual",
    "<layer input>",  # what residual accounting calls a scanned block's untagged input
    "<stack output>",
)


def grouped_heads(cfg: ModelConfig) -> bool:
    """The naive attention core runs grouped-query attention as [Hkv, G] heads."""
    return cfg.kv_heads < cfg.n_heads and cfg.attention != "fused"


def tensor_share(name: str | None, cfg: ModelConfig, parallel: ParallelConfig) -> int:
    """How many of a tagged activation's parts one device's holds one of: ``tp`` where the
    layout splits it, 1 where each tensor device holds it whole (a tag the layout does not name,
    or an untagged residual: an upper bound)."""
    tp = parallel.tp
    if tp == 1 or name is None:
        return 1
    if name in HEAD_TAGS:
        return tp  # check_model: the query heads split in the attention's layout
    if name in KV_TAGS:
        return tp if cfg.kv_heads % tp == 0 else 1
    if name in COLUMN_TAGS:
        return tp
    if name in STREAM_TAGS:
        return tp if parallel.sequence_parallel else 1
    return 1


def max_local_devices() -> int:
    """The most CPU devices (JAX) or processes (torchrun) one command starts on this machine:
    4 per usable core, at least 8. Each costs threads and memory; thousands make the machine
    unusable and measure nothing a GPU mesh would show."""
    return max(8, 4 * len(os.sched_getaffinity(0)))


def check_cpu_mesh(devices: int, what: str = "CPU devices") -> None:
    """Refuse a mesh of more local CPU devices (or processes) than ``max_local_devices``."""
    limit = max_local_devices()
    require(
        devices <= limit,
        f"--mesh asks for {devices} {what} on this machine ({len(os.sched_getaffinity(0))} "
        f"cores): use at most {limit}, or plan a GPU mesh from shapes with --target h100",
    )


def parse_mesh(text: str) -> ParallelConfig:
    """``"fsdp=4"`` -> ``ParallelConfig(strategy="fsdp", devices=4)``; ``"fsdp=2,tp=2"`` ->
    ``ParallelConfig(strategy="fsdp", devices=4, tp=2)`` (a 2 x 2 mesh); ``"tp=2"``: tensor
    parallelism alone; ``"cp=2"``, ``"fsdp=2,cp=2"``: context parallelism. At most one
    data-parallel axis, one ``tp`` and one ``cp`` (``fsdp=1,cp=2,tp=2``: all three)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    usage = (
        f"--mesh {text!r} must be STRATEGY=N, tp=N, or both, with cp=N in place of tp=N for "
        f"context parallelism (e.g. fsdp=4, tp=2, fsdp=2,tp=2, fsdp=2,cp=2; strategies: "
        f"{', '.join(STRATEGIES)})"
    )
    if not parts or len(parts) > 3 or any("=" not in p for p in parts):
        raise ConfigError(usage)
    axes: dict[str, int] = {}
    extra = ("tp", "cp")
    for part in parts:
        name, _, count = part.partition("=")
        name = name.strip()
        try:
            value = int(count)
        except ValueError:
            raise ConfigError(f"--mesh {text!r}: {count!r} is not a device count") from None
        if name in axes or (name not in extra and any(a not in extra for a in axes)):
            raise ConfigError(usage)
        axes[name] = value
    tp, cp = axes.pop("tp", 1), axes.pop("cp", 1)
    strategy, data = next(iter(axes.items()), ("dp", 1))
    for name, value in (("tp", tp), ("cp", cp), (strategy, data)):
        if value < 1:
            raise ConfigError(f"--mesh {text!r}: {name}={value} must be a positive device count")
    return ParallelConfig(strategy=strategy, devices=data * tp * cp, tp=tp, cp=cp)


def shard_dim(shape: tuple[int, ...], n: int, stacked: bool = False) -> int | None:
    """The dimension a sharded array is split on over ``n`` devices: its largest one divisible
    by ``n`` (the later on a tie), never the stacked layer axis (dimension 0 of the blocks'
    parameters: ``lax.scan`` takes one layer per iteration); None: it is replicated."""
    first = 1 if stacked and len(shape) > 1 else 0
    dims = [d for d in range(first, len(shape)) if shape[d] >= n and shape[d] % n == 0]
    return max(dims, key=lambda d: (shape[d], d)) if dims else None


def shard_elements(shape: tuple[int, ...], n: int, stacked: bool = False) -> int:
    """Elements of one device's shard of a sharded array of ``shape`` over ``n`` devices."""
    total = 1
    for d in shape:
        total *= d
    return total // n if shard_dim(shape, n, stacked) is not None else total
