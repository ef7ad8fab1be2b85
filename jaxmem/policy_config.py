"""A memory policy at the file and command-line boundary: the ``[memory]`` section of a run
config (``policy_to_dict`` / ``policy_from_dict``) and the ``--policy`` notation (a preset's
name or ``HEAD:K+REST``, ``parse_policy``). Names exist only here; everything past this module
holds ``MemoryPolicy`` objects (``jaxmem.policy``). Pure: imports neither framework.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxmem.config import require
from jaxmem.policy import (
    BLOCKS,
    BlockPolicy,
    EmbeddingReplay,
    LayerSelection,
    LossPolicy,
    MemoryPolicy,
    StackPart,
    base_preset_name,
    check_names,
    get_policy,
    is_preset,
    mixed_name,
    mixed_policy,
    rest_block,
)

MIXED_NOTATION = "HEAD:K+REST"


def parse_policy(text: str) -> MemoryPolicy:
    """A policy as it is written on the command line, in config files and in ``jaxmem plan``'s
    output: a preset name (``selective``), or ``HEAD:K+REST`` (``none:2+selective``: the first
    K blocks under preset HEAD, the others under preset REST)."""
    head, colon, tail = text.partition(":")
    if not colon:
        return get_policy(text)
    k, plus, rest = tail.partition("+")
    require(
        bool(plus) and k.isdigit() and int(k) > 0,
        f"policy {text!r} is neither a preset nor {MIXED_NOTATION} (e.g. none:2+selective: the "
        "first 2 blocks under none, the rest under selective)",
    )
    for name in (head, rest):
        get_policy(name)  # an unknown preset is named with the valid ones
    return mixed_policy(head, int(k), rest)


LAYER_FIELDS = {"layers_every": "every", "layers_first": "first", "layers": "layers"}


def policy_to_dict(policy: MemoryPolicy) -> dict[str, Any]:
    """The ``[memory]`` section of a run config: a preset by name (with its layer selection and
    checkpoint mode), or ``policy = "custom"`` with the tag lists; a second part as ``rest``
    (a preset's name, or ``"custom"`` with ``rest_save``/``rest_offload``). ``policy_from_dict``
    inverts it exactly."""
    head = policy.parts[0]
    layers = {key: getattr(head.layers, attr) for key, attr in LAYER_FIELDS.items()}
    layers = {k: (list(v) if isinstance(v, tuple) else v) for k, v in layers.items()}
    modes: dict[str, Any] = {"use_reentrant": policy.use_reentrant, "unroll": policy.unroll}
    require(
        len(policy.parts) <= 2,
        f"policy {policy.name!r} has {len(policy.parts)} stack parts: a run config writes at "
        f"most two ({MIXED_NOTATION})",
    )
    if len(policy.parts) == 2:
        modes |= _rest_to_dict(policy, policy.parts[1].block)
    if policy.embedding.replay:
        modes["replay_embedding"] = True
    if policy.loss.chunks:
        modes["loss_chunks"] = policy.loss.chunks
    if policy.loss.tile_tokens:
        modes["loss_tile_tokens"] = policy.loss.tile_tokens
    if policy.mlp_tile_tokens:
        modes["mlp_tile_tokens"] = policy.mlp_tile_tokens
    if is_preset(policy):
        return {"policy": base_preset_name(policy), **layers, **modes}
    return {"policy": "custom", **_tags_to_dict(policy, head.block, ""), **layers, **modes}


def _rest_to_dict(policy: MemoryPolicy, rest: BlockPolicy) -> dict[str, Any]:
    if rest.label in BLOCKS:
        return {"rest": rest.label}
    return {"rest": "custom", **_tags_to_dict(policy, rest, "rest_")}


def _tags_to_dict(policy: MemoryPolicy, block: BlockPolicy, prefix: str) -> dict[str, list]:
    require(
        not (block.save_dots or policy.nested) and block.remat,
        f"policy {policy.name!r} (save_dots/nested/no remat, not a preset) cannot be written to a "
        "run config; use a preset or save/offload tag lists",
    )
    return {f"{prefix}save": list(block.save), f"{prefix}offload": list(block.offload)}


MEMORY_KEYS = (
    "policy",
    "save",
    "offload",
    "use_reentrant",
    "unroll",
    "rest",
    "rest_save",
    "rest_offload",
    "replay_embedding",
    "loss_chunks",
    "loss_tile_tokens",
    "mlp_tile_tokens",
    *LAYER_FIELDS,
)


def policy_from_dict(section: Mapping[str, Any]) -> MemoryPolicy:
    """A ``MemoryPolicy`` from a ``[memory]`` section (see ``policy_to_dict``); bad names, a tag
    both saved and offloaded and bad layer selections raise ``ConfigError``."""
    unknown = sorted(set(section) - set(MEMORY_KEYS))
    require(
        not unknown, f"unknown setting(s) {unknown} in [memory]; valid: {', '.join(MEMORY_KEYS)}"
    )
    name = section.get("policy", "none")
    require(isinstance(name, str), f"memory policy={name!r} must be a name")
    save, offload = tuple(section.get("save") or ()), tuple(section.get("offload") or ())
    if name != "custom":
        require(
            not (save or offload),
            f"save/offload lists define a custom policy: set policy = 'custom' (not {name!r}) "
            "or drop them",
        )
    layers = {}
    for key, attr in LAYER_FIELDS.items():
        value = section.get(key)
        layers[attr] = tuple(value) if isinstance(value, list) else value
    selection = LayerSelection(**layers)
    rest = section.get("rest")
    fields = {
        "use_reentrant": section.get("use_reentrant", False),
        "unroll": section.get("unroll", False),
        "loss": LossPolicy(section.get("loss_chunks", 0), section.get("loss_tile_tokens", 0)),
        "embedding": EmbeddingReplay(section.get("replay_embedding", False)),
        "mlp_tile_tokens": section.get("mlp_tile_tokens", 0),
    }
    if ":" in name:  # HEAD:K+REST, as the command line writes it
        require(
            selection.is_all and rest is None,
            f"memory policy={name!r} already says which layers run under which preset: drop "
            "layers_every/layers_first/layers/rest",
        )
        return parse_policy(name).replace(**fields)
    first = MemoryPolicy.of(BlockPolicy(save=save, offload=offload)) if name == "custom" else None
    first = first or get_policy(name)
    parts = (StackPart(layers=selection, block=first.head),)
    if rest is not None or section.get("rest_save") or section.get("rest_offload"):
        parts += (StackPart(block=_rest_from_dict(section)),)
    policy = first.replace(parts=parts, **fields)
    return policy.replace(name=mixed_name(parts)) if len(parts) > 1 else policy


def _rest_from_dict(section: Mapping[str, Any]) -> BlockPolicy:
    rest = section.get("rest")
    save, offload = section.get("rest_save") or (), section.get("rest_offload") or ()
    require(
        rest == "custom" or not (save or offload),
        f"rest_save/rest_offload name the tags of a custom rest: set rest='custom' (not "
        f"{rest!r}) or drop them",
    )
    if rest != "custom":
        return rest_block(rest)
    save, offload = tuple(save), tuple(offload)
    for field, value in (("rest_save", save), ("rest_offload", offload)):
        check_names(field, value)
    both = sorted(set(save) & set(offload))
    require(not both, f"{both} are both saved and offloaded in the rest; choose one place")
    return BlockPolicy(save=save, offload=offload)
