"""Memory policies: what the backward pass keeps, recomputes or sends to host memory.

A ``MemoryPolicy`` is data (a frozen dataclass) in the vocabulary of ``CHECKPOINT_NAMES``. This
module turns it into JAX — a ``jax.checkpoint`` policy and a ``layers_fn`` for the model's block
stack — in exactly one place (``layers_fn``); ``torch_ref.remat`` translates the same object to
PyTorch. The model itself never changes.

Presets (``POLICIES``):

- ``none``: plain autodiff, every residual kept in device memory.
- ``full``: recompute the whole block; only each block's input is kept.
- ``dots``: keep the projections (the matmuls without batch dimensions: q/k/v, attention
  output, MLP up and down), recompute the rest. By name, not with
  ``dots_with_no_batch_dims_saveable``: the projections accumulate in fp32, so that policy would
  keep their fp32 results under bf16 (1.6x torch's bytes); the tags hold the compute-dtype
  values. ``MemoryPolicy(save_dots=True)`` still gives the jax.checkpoint_policies form.
- ``selective``: Megatron-style (Korthikanti et al. 2022): keep the projections and elementwise
  outputs, recompute the attention core (scores, softmax, context).
- ``mlp``: keep the attention side, recompute the MLP.
- ``offload``: ``selective`` with everything it keeps but the block input sent to host memory
  (``pinned_host``): device memory close to ``full``'s at ``selective``'s FLOPs.
- ``nested``: √L segments: checkpoint every ⌈√L⌉ blocks and fully recompute inside (the JAX
  analogue of ``torch.utils.checkpoint.checkpoint_sequential``).
- ``MemoryPolicy.custom({...})``: a per-name choice of ``device`` / ``offload`` / ``recompute``,
  like MaxText's per-tensor remat config.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal

import jax

from jaxmem.config import ConfigError
from jaxmem.model import CHECKPOINT_NAMES, LayerFn, LayersFn, scan_layers

Choice = Literal["device", "offload", "recompute"]
CHOICES: tuple[str, ...] = ("device", "offload", "recompute")
HOST_MEMORY_KIND = "pinned_host"


def _check_names(field: str, names: tuple[str, ...]) -> None:
    unknown = [n for n in names if n not in CHECKPOINT_NAMES]
    if unknown:
        raise ConfigError(
            f"{field} has unknown tag name(s) {unknown}; valid names: {', '.join(CHECKPOINT_NAMES)}"
        )
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"{field} lists {dupes} more than once")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerSelection:
    """Which layers a policy applies to; the others run without remat (everything kept).

    Exactly one of: ``every=k`` (layers 0, k, 2k, ...: Megatron's "uniform"), ``first=n``
    (layers 0..n-1: Megatron's "block"), ``layers=(i, j, ...)``; or none of them for all layers.
    """

    every: int | None = None
    first: int | None = None
    layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("every", "first", "layers") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ConfigError(f"layer selection takes one of every/first/layers, got {given}")
        for name in ("every", "first"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ConfigError(f"layers {name}={value!r} must be a positive integer")
        if self.layers is not None:
            if not isinstance(self.layers, tuple) or not self.layers:
                raise ConfigError(f"layers={self.layers!r} must be a non-empty tuple of indices")
            if len(set(self.layers)) != len(self.layers):
                raise ConfigError(f"layers={self.layers!r} lists a layer more than once")

    @property
    def is_all(self) -> bool:
        return self.every is None and self.first is None and self.layers is None

    def indices(self, n_layers: int) -> tuple[int, ...]:
        """Sorted layer indices for a stack of ``n_layers``; raises if any is out of range."""
        if self.every is not None:
            return tuple(range(0, n_layers, self.every))
        if self.first is not None:
            if self.first > n_layers:
                raise ConfigError(f"layers first={self.first} exceeds n_layers={n_layers}")
            return tuple(range(self.first))
        if self.layers is not None:
            bad = [i for i in self.layers if not (isinstance(i, int) and 0 <= i < n_layers)]
            if bad:
                raise ConfigError(
                    f"layer indices {bad} are out of range for n_layers={n_layers} "
                    f"(valid: 0..{n_layers - 1})"
                )
            return tuple(sorted(self.layers))
        return tuple(range(n_layers))


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryPolicy:
    """What the backward pass of each selected block keeps, recomputes or offloads.

    Attributes:
      name: label used in reports.
      remat: False = plain autodiff (keep every residual); True = ``jax.checkpoint`` the block
        and keep only what ``save`` / ``offload`` / ``save_dots`` name.
      save: tag names kept in device memory.
      offload: tag names moved to host memory (``pinned_host``) in the forward pass and brought
        back for the backward pass.
      save_dots: also keep matmul outputs without batch dimensions (the projections).
      nested: √L segments of fully recomputed blocks (takes no names).
      layers: which layers the policy applies to.
      use_reentrant: PyTorch only: ``torch.utils.checkpoint``'s mode (chosen explicitly, never
        left to its default).
    """

    name: str = "custom"
    remat: bool = True
    save: tuple[str, ...] = ()
    offload: tuple[str, ...] = ()
    save_dots: bool = False
    nested: bool = False
    layers: LayerSelection = LayerSelection()
    use_reentrant: bool = False

    def __post_init__(self) -> None:
        for field in ("save", "offload"):
            value = getattr(self, field)
            if not isinstance(value, tuple):
                raise ConfigError(f"{field}={value!r} must be a tuple of tag names")
            _check_names(field, value)
        both = sorted(set(self.save) & set(self.offload))
        if both:
            # jax.checkpoint_policies.save_and_offload_only_these_names silently keeps such a
            # name on device and never offloads it.
            raise ConfigError(
                f"{both} are both saved and offloaded; choose one place for each name"
            )
        if not self.remat and (self.save or self.offload or self.save_dots or self.nested):
            raise ConfigError(
                "remat=False keeps everything: it takes no save/offload/save_dots/nested"
            )
        if self.save_dots and self.offload:
            # save_from_both_policies (dots + names) raises on offloading policies.
            raise ConfigError(
                f"save_dots cannot be combined with offload={list(self.offload)}: name the "
                "projections to offload instead"
            )
        if self.nested and (self.save or self.offload or self.save_dots):
            raise ConfigError("nested recomputes whole segments: it takes no save/offload names")
        if self.nested and not self.layers.is_all:
            raise ConfigError("nested applies to the whole stack: it takes no layer selection")
        if not isinstance(self.use_reentrant, bool):
            raise ConfigError(f"use_reentrant={self.use_reentrant!r} must be True or False")

    @classmethod
    def custom(
        cls,
        choices: Mapping[str, Choice],
        *,
        layers: LayerSelection = LayerSelection(),
        name: str = "custom",
        use_reentrant: bool = False,
    ) -> MemoryPolicy:
        """Per-name choices; names not mentioned are recomputed.

        ``MemoryPolicy.custom({"query_proj": "device", "mlp_up": "offload"})``
        """
        bad = {k: v for k, v in choices.items() if v not in CHOICES}
        if bad:
            raise ConfigError(f"choices {bad} must each be one of {CHOICES}")
        _check_names("choices", tuple(choices))
        return cls(
            name=name,
            save=tuple(n for n in CHECKPOINT_NAMES if choices.get(n) == "device"),
            offload=tuple(n for n in CHECKPOINT_NAMES if choices.get(n) == "offload"),
            layers=layers,
            use_reentrant=use_reentrant,
        )

    def replace(self, **changes: Any) -> MemoryPolicy:
        return dataclasses.replace(self, **changes)

    def choice(self, name: str) -> Choice:
        """Where tag ``name`` lives under this policy (for remat layers)."""
        if not self.remat or name in self.save:
            return "device"
        return "offload" if name in self.offload else "recompute"


ATTENTION_CORE = ("attn_scores", "attn_probs", "attn_context")
PROJECTIONS = ("query_proj", "key_proj", "value_proj", "attn_out", "mlp_up", "mlp_down")
MLP_SIDE = ("mlp_up", "mlp_act", "mlp_down", "mlp_residual")

POLICIES: dict[str, MemoryPolicy] = {
    "none": MemoryPolicy(name="none", remat=False),
    "full": MemoryPolicy(name="full"),
    "dots": MemoryPolicy(name="dots", save=PROJECTIONS),
    "selective": MemoryPolicy(
        name="selective", save=tuple(n for n in CHECKPOINT_NAMES if n not in ATTENTION_CORE)
    ),
    "mlp": MemoryPolicy(name="mlp", save=tuple(n for n in CHECKPOINT_NAMES if n not in MLP_SIDE)),
    "offload": MemoryPolicy(
        name="offload",
        save=("block_input",),
        offload=tuple(n for n in CHECKPOINT_NAMES if n not in ATTENTION_CORE + ("block_input",)),
    ),
    "nested": MemoryPolicy(name="nested", nested=True),
}


def get_policy(name: str) -> MemoryPolicy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ConfigError(
            f"unknown memory policy {name!r}; choose one of: {', '.join(POLICIES)}"
        ) from None


def backend_memory_kinds(device: jax.Device | None = None) -> tuple[str, ...]:
    device = device or jax.devices()[0]
    return tuple(m.kind for m in device.addressable_memories())


def check_backend(policy: MemoryPolicy, device: jax.Device | None = None) -> None:
    """Raise if the policy needs a memory kind the backend lacks (offload needs pinned_host)."""
    if policy.offload:
        kinds = backend_memory_kinds(device)
        if HOST_MEMORY_KIND not in kinds:
            raise ConfigError(
                f"policy {policy.name!r} offloads {list(policy.offload)} to {HOST_MEMORY_KIND}, "
                f"but this backend only has memory kinds {list(kinds)}; use a policy without "
                "offload (e.g. selective)"
            )


def jax_checkpoint_policy(policy: MemoryPolicy) -> Any:
    """The ``jax.checkpoint`` policy for one remat block of ``policy``.

    Never uses ``save_anything_except_these_names``: it ignores its names in this JAX version.
    """
    cp = jax.checkpoint_policies
    if policy.offload:
        return cp.save_and_offload_only_these_names(
            names_which_can_be_saved=list(policy.save),
            names_which_can_be_offloaded=list(policy.offload),
            offload_src="device",
            offload_dst=HOST_MEMORY_KIND,
        )
    if policy.save_dots and policy.save:
        return cp.save_from_both_policies(
            cp.dots_with_no_batch_dims_saveable, cp.save_only_these_names(*policy.save)
        )
    if policy.save_dots:
        return cp.dots_with_no_batch_dims_saveable
    if policy.save:
        return cp.save_only_these_names(*policy.save)
    return cp.nothing_saveable


def nested_segment_size(n_layers: int) -> int:
    """⌈√L⌉ blocks per segment (Chen et al. 2016, "Training Deep Nets with Sublinear Memory")."""
    return math.ceil(math.sqrt(n_layers))


def _layer(stacked: Any, i: int) -> Any:
    return jax.tree_util.tree_map(lambda a: a[i], stacked)


def layers_fn(policy: MemoryPolicy, n_layers: int) -> LayersFn:
    """How the block stack runs under ``policy`` (pass as ``model(tokens, layers_fn=...)``).

    - all layers, one policy: one ``lax.scan`` over a ``jax.checkpoint``-ed body (the default
      path; XLA's compiled memory plan reflects remat only under scan);
    - nested: an outer scan over ⌈√L⌉-block segments, each segment checkpointed, each block inside
      fully recomputed; a shorter last segment when ⌈√L⌉ does not divide L;
    - a layer subset: unrolled, remat only on the selected layers.
    """
    check_backend(policy)
    if not policy.remat:
        return scan_layers
    ckpt_policy = jax_checkpoint_policy(policy)

    def remat(fn: LayerFn, *, in_scan: bool = True) -> LayerFn:
        # prevent_cse=False is safe (and faster) inside scan, which cannot CSE across iterations.
        return jax.checkpoint(fn, policy=ckpt_policy, prevent_cse=not in_scan)

    if policy.nested:
        k = nested_segment_size(n_layers)

        def run_nested(layer_fn: LayerFn, x: jax.Array, stacked: Any) -> jax.Array:
            inner = remat(layer_fn)

            def segment(x, seg_state):
                return scan_layers(inner, x, seg_state)

            segment = jax.checkpoint(segment, policy=ckpt_policy, prevent_cse=False)
            n_full = n_layers // k
            if n_full:
                # [L, ...] -> [L/k, k, ...] is a reshape (no copy) of the resident parameters; the
                # segment's slice then arrives through scan, so the backward accumulates each
                # segment's gradient into its own slice (slicing inside the checkpoint instead
                # makes XLA build full-size [L, ...] gradient buffers per segment).
                head = jax.tree_util.tree_map(
                    lambda a: a[: n_full * k].reshape(n_full, k, *a.shape[1:]), stacked
                )
                x = scan_layers(segment, x, head)
            if n_layers % k:
                tail = jax.tree_util.tree_map(lambda a: a[n_full * k :], stacked)
                x = segment(x, tail)
            return x

        return run_nested

    selected = policy.layers.indices(n_layers)
    if len(selected) == n_layers:

        def run_scanned(layer_fn: LayerFn, x: jax.Array, stacked: Any) -> jax.Array:
            return scan_layers(remat(layer_fn), x, stacked)

        return run_scanned

    def run_unrolled(layer_fn: LayerFn, x: jax.Array, stacked: Any) -> jax.Array:
        for i in range(n_layers):
            # Slice inside the checkpoint: the layer's parameters stay views, not saved copies.
            def one_layer(x, stacked, i=i):
                return layer_fn(x, _layer(stacked, i))

            x = (remat(one_layer, in_scan=False) if i in selected else one_layer)(x, stacked)
        return x

    return run_unrolled
