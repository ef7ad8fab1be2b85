"""Your own Flax NNX model, planned for an H100 by jaxmem on a machine without a GPU.

The model below is a user's, not jaxmem's decoder: a pre-norm GPT written with ``flax.nnx``,
bf16 compute and fp32 parameters, trained with optax's AdamW. Like jaxmem's own model it only
tags tensors with ``checkpoint_name`` (its own names: ``q``, ``k``, ``v``, ``proj``, ``fc1``,
``gelu``, ``fc2``); a policy is applied from outside, per block, with ``nnx.remat`` and the
``jax.checkpoint`` policy jaxmem translates from one of its presets over those names
(``TagPolicy.preset``).

    python examples/flax_own_model.py                    # H100 plans under none/selective/full
    python examples/flax_own_model.py --target cpu --n-layers 2 --d-model 128 --seq-len 128

The same step on the command line (``make_step`` is the entry point):

    jaxmem memory --fn examples/flax_own_model.py:make_step --policies none,selective --target h100
    jaxmem peak --fn examples/flax_own_model.py:make_step --policy selective --target h100
"""

from __future__ import annotations

import argparse
import dataclasses

from jaxmem.backend import contain_cuda_plugin

contain_cuda_plugin()  # before JAX starts: GPU plans compile here without a GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.ad_checkpoint import checkpoint_name  # noqa: E402

from jaxmem.figures import format_bytes  # noqa: E402
from jaxmem.memory import tools  # noqa: E402

# jaxmem's tag names -> this model's, so jaxmem's presets mean the same here
TAG_MAP = {
    "query_proj": "q",
    "key_proj": "k",
    "value_proj": "v",
    "attn_out": "proj",
    "mlp_up": "fc1",
    "mlp_act": "gelu",
    "mlp_down": "fc2",
}


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 32_000
    d_model: int = 2048
    n_heads: int = 16
    d_ff: int = 8192
    n_layers: int = 8
    seq_len: int = 2048
    batch: int = 8


class Block(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.d_ff
        kw = {"dtype": jnp.bfloat16, "param_dtype": jnp.float32, "rngs": rngs}
        self.n_heads = cfg.n_heads
        self.ln1, self.ln2 = nnx.LayerNorm(d, **kw), nnx.LayerNorm(d, **kw)
        self.qkv = nnx.Linear(d, 3 * d, **kw)
        self.proj = nnx.Linear(d, d, **kw)
        self.fc1, self.fc2 = nnx.Linear(d, f, **kw), nnx.Linear(f, d, **kw)

    def __call__(self, x):  # x: [B, S, D]
        b, s, d = x.shape
        heads = (b, s, self.n_heads, d // self.n_heads)
        q, k, v = jnp.split(self.qkv(self.ln1(x)), 3, axis=-1)
        q, k, v = (checkpoint_name(t, n).reshape(heads) for t, n in ((q, "q"), (k, "k"), (v, "v")))
        context = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, s, d)
        x = x + checkpoint_name(self.proj(context), "proj")
        h = checkpoint_name(self.fc1(self.ln2(x)), "fc1")
        h = checkpoint_name(jax.nn.gelu(h), "gelu")
        return x + checkpoint_name(self.fc2(h), "fc2")


class GPT(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, param_dtype=jnp.float32, rngs=rngs)
        self.pos = nnx.Param(jnp.zeros((cfg.seq_len, cfg.d_model), jnp.float32))
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
        self.ln_f = nnx.LayerNorm(cfg.d_model, dtype=jnp.bfloat16, rngs=rngs)


def forward(model: GPT, tokens, policy: tools.TagPolicy):
    """Logits [B, S, V] in fp32; each block under ``policy`` (``nnx.remat`` with jaxmem's
    translation of it), the model itself untouched."""
    x = (model.embed(tokens) + model.pos[: tokens.shape[1]]).astype(jnp.bfloat16)
    for block in model.blocks:
        if policy.remat:
            x = nnx.remat(lambda blk, h: blk(h), policy=policy.checkpoint_policy())(block, x)
        else:
            x = block(x)
    return model.embed.attend(model.ln_f(x)).astype(jnp.float32)


def make_step(policy: str | None = None, cfg: Config = Config()) -> tools.Step:
    """The entry point ``jaxmem memory/peak --fn`` calls: one AdamW training step of ``cfg``'s
    model under jaxmem's preset ``policy`` (default ``none``), with shape-only arguments."""
    tag_policy = tools.TagPolicy.preset(policy or "none", TAG_MAP)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: GPT(cfg, nnx.Rngs(0))))
    optimizer = optax.adamw(3e-4)
    opt_state = jax.eval_shape(optimizer.init, params)
    tokens = jax.ShapeDtypeStruct((cfg.batch, cfg.seq_len + 1), jnp.int32)

    def loss_fn(params, tokens):
        logits = forward(nnx.merge(graphdef, params), tokens[:, :-1], tag_policy)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    def train_step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return tools.Step(
        fn=train_step,
        args=(params, opt_state, tokens),
        donate_argnums=(0, 1),
        loss=loss_fn,
        loss_args=(params, tokens),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="h100")
    p.add_argument("--policies", default="none,selective,full")
    for field in dataclasses.fields(Config):
        p.add_argument("--" + field.name.replace("_", "-"), type=int, default=field.default)
    args = p.parse_args()
    cfg = Config(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Config)})
    print(f"{cfg}, AdamW, bf16 compute; plans for {args.target}")
    rows = []
    for name in args.policies.split(","):
        step = make_step(name, cfg)
        kept = tools.residuals(step.loss, *step.loss_args)
        plan = tools.plan(step.fn, *step.args, target=args.target, **step.compile_kwargs())
        rows.append((name, kept, plan))
        tags = ", ".join(f"{t} {format_bytes(n)}" for t, n in kept.by_tag.items())
        print(
            f"{name:>9}: saved {format_bytes(kept.device_bytes)} ({tags}); plan: temporaries "
            f"{format_bytes(plan.temp_bytes)}, peak {format_bytes(plan.planned_peak_bytes)}, "
            f"fits {plan.fits}"
        )
    # against the policy that keeps least: what the others' kept tensors cost, two ways
    base_name, base_kept, base_plan = min(rows, key=lambda r: r[1].device_bytes)
    for name, kept, plan in rows:
        if name == base_name:
            continue
        predicted = kept.device_bytes - base_kept.device_bytes
        compiled = plan.planned_peak_bytes - base_plan.planned_peak_bytes
        print(
            f"{name} against {base_name}: {format_bytes(predicted)} more kept (residual "
            f"accounting); the compiled plan's peak {format_bytes(compiled)} higher"
        )


if __name__ == "__main__":
    main()
