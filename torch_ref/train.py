"""Optimizers and the training step, mirroring ``jaxmem.step.train_step`` in plain PyTorch:
autocast + GradScaler for mixed precision, the seeds' accumulation loop corrected to normalise by
the whole batch's valid-token count, and a CPU-offloading optimizer."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from jaxmem.config import OptimizerConfig
from jaxmem.precision import Precision
from torch_ref.distributed import local, unwrap
from torch_ref.loss import cross_entropy_sum

TORCH_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def param_groups(params: Iterable[nn.Parameter], weight_decay: float) -> list[dict]:
    """Decay matrices and embedding tables (ndim >= 2); not biases or LayerNorm weights —
    the same split as ``jaxmem.step.train_step.decay_mask``."""
    params = list(params)
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def _optimizer(params: Iterable[nn.Parameter], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    groups = param_groups(params, cfg.weight_decay)
    # foreach=False: the plain per-parameter loop, the reference arithmetic order.
    if cfg.name == "adamw":
        return torch.optim.AdamW(
            groups, lr=cfg.lr, betas=(cfg.b1, cfg.b2), eps=cfg.eps, foreach=False
        )
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, foreach=False)
    if cfg.name == "adafactor":
        return torch.optim.Adafactor(groups, lr=cfg.lr, foreach=False)
    raise ValueError(f"optimizer={cfg.name!r} is not supported")


def make_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """``cfg``'s optimizer over the parameters that train: a frozen one (``requires_grad``
    off: a base under adapters) gets no state."""
    return _optimizer([p for p in model.parameters() if p.requires_grad], cfg)


def _torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The ``torch.optim`` optimizers inside ``optimizer`` (a ``HybridDeviceOptimizer`` has a
    host one and a device one)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    return [o for o in (optimizer.host, optimizer.device) if o is not None]


def make_schedulers(optimizer: Any, cfg: OptimizerConfig, done: int = 0) -> list[LambdaLR]:
    """``cfg``'s learning-rate schedule as ``torch.optim.lr_scheduler.LambdaLR`` on each torch
    optimizer of ``optimizer`` (none for a constant rate): the factor of update ``i`` is
    ``cfg.lr_at(i) / cfg.lr``, the formula of optax's stock schedules that jaxmem uses
    (LinearLR cannot start a warmup at 0, and SequentialLR's chained CosineAnnealingLR computes
    its values recursively). Step them after each ``optimizer.step()``. ``done``: updates
    already made (a resumed run): the next one gets ``cfg.lr_at(done)``."""
    if not cfg.scheduled:
        return []
    optimizers = _torch_optimizers(optimizer)
    for o in optimizers:
        for group in o.param_groups:
            group["initial_lr"] = cfg.lr  # the base the factors scale (also after a restore)
    return [LambdaLR(o, lambda i: cfg.lr_at(i) / cfg.lr, last_epoch=done - 1) for o in optimizers]


def step_schedulers(schedulers: Iterable[LambdaLR]) -> None:
    """Step each scheduler after ``optimizer.step()``, also when fp16's GradScaler skipped the
    update (an overflow): the schedule counts the step, as PyTorch users step it, so a skip
    moves torch one step ahead of optax (documented). torch's warning for exactly that case
    ("Detected call of `lr_scheduler.step()` before `optimizer.step()`") is filtered here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
        for scheduler in schedulers:
            scheduler.step()


def current_lr(optimizer: Any) -> float:
    """The learning rate the next ``optimizer.step()`` applies (every group shares it)."""
    return float(_torch_optimizers(optimizer)[0].param_groups[0]["lr"])


def clip_grads(
    params: Iterable[nn.Parameter], cfg: OptimizerConfig, total_norm: torch.Tensor | None = None
) -> None:
    """Scale the gradients down to ``cfg.clip_norm`` global L2 norm when larger (nothing when
    ``cfg`` does not clip). Call it on unscaled gradients, before ``optimizer.step()``.

    One process: ``torch.nn.utils.clip_grad_norm_``. Over several ranks, ``total_norm`` is the
    global norm already reduced over them (``torch_ref.distributed.grad_norm``, which counts
    FSDP2 shards and tensor-parallel replicated copies once each): every gradient, or this
    rank's shard of it, is scaled in place by ``min(1, clip_norm / (total_norm + 1e-6))``,
    clip_grad_norm_'s own arithmetic, with no second reduction."""
    if not cfg.clips:
        return
    if total_norm is None:
        torch.nn.utils.clip_grad_norm_(params, cfg.clip_norm, foreach=False)
        return
    scale = torch.clamp(cfg.clip_norm / (total_norm + 1e-6), max=1.0)
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                local(p.grad).mul_(scale.to(local(p.grad).device))


class HybridDeviceOptimizer:
    """Megatron-LM's HybridDeviceOptimizer idea, written plainly.

    The first ``offload_fraction`` of the parameters (by element count, in model order) get an
    fp32 master copy and their optimizer state in host memory, and are updated there by a CPU
    optimizer; their gradients go to the host before the update and the new values come back
    after. The rest is updated on the device as usual. With fraction 1.0 no optimizer state
    lives on the device.
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        cfg: OptimizerConfig,
        offload_fraction: float,
        make: Callable[
            [Iterable[nn.Parameter], OptimizerConfig], torch.optim.Optimizer
        ] = _optimizer,
    ):
        if not 0.0 <= offload_fraction <= 1.0:
            raise ValueError(f"offload_fraction={offload_fraction!r} must be in [0, 1]")
        params = [p for p in params if p.requires_grad]
        total = sum(p.numel() for p in params)
        budget, used = offload_fraction * total, 0
        self.offloaded: list[tuple[nn.Parameter, nn.Parameter]] = []  # (device param, host master)
        on_device: list[nn.Parameter] = []
        for p in params:
            if used + p.numel() <= budget:
                master = nn.Parameter(p.detach().to("cpu", torch.float32, copy=True))
                self.offloaded.append((p, master))
                used += p.numel()
            else:
                on_device.append(p)
        self.offloaded_numel = used
        self.host = make([m for _, m in self.offloaded], cfg) if self.offloaded else None
        self.device = make(on_device, cfg) if on_device else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in (self.host, self.device):
            if opt is not None:
                opt.zero_grad(set_to_none=set_to_none)
        for p, _ in self.offloaded:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for p, master in self.offloaded:
            master.grad = None if p.grad is None else p.grad.to("cpu", torch.float32)
        if self.host is not None:
            self.host.step()
        for p, master in self.offloaded:
            p.copy_(master.to(p.device, p.dtype, non_blocking=True))
        if self.device is not None:
            self.device.step()

    def state_dict(self) -> dict:
        """The fp32 masters and both optimizers' state (a checkpoint's ``optimizer`` entry)."""
        return {
            "masters": [m.detach().clone() for _, m in self.offloaded],
            "host": self.host.state_dict() if self.host is not None else None,
            "device": self.device.state_dict() if self.device is not None else None,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Inverse of ``state_dict``: the masters, their state, and the device copies of the
        offloaded parameters made from the masters (as ``step`` leaves them)."""
        masters = state["masters"]
        if len(masters) != len(self.offloaded):
            raise ValueError(
                f"the checkpoint holds {len(masters)} master parameters, this optimizer "
                f"offloads {len(self.offloaded)}: it was saved with another offload fraction"
            )
        for (p, master), saved in zip(self.offloaded, masters, strict=True):
            master.copy_(saved)
            p.copy_(master.to(p.device, p.dtype))
        for opt, key in ((self.host, "host"), (self.device, "device")):
            if opt is not None:
                opt.load_state_dict(state[key])

    def state_tensors(self) -> list[torch.Tensor]:
        return [
            t
            for opt in (self.host, self.device)
            if opt is not None
            for state in opt.state.values()
            for t in state.values()
            if isinstance(t, torch.Tensor)
        ]


def split_microbatches(batch: dict[str, torch.Tensor], k: int) -> list[dict[str, torch.Tensor]]:
    b = next(iter(batch.values())).shape[0]
    if b % k:
        raise ValueError(f"batch size {b} is not divisible by accum steps {k}")
    return [
        {key: v[i * (b // k) : (i + 1) * (b // k)] for key, v in batch.items()} for i in range(k)
    ]


def lm_loss_sum(
    model: nn.Module, batch: dict[str, torch.Tensor], precision: Precision
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_sum, n_tokens)`` of ``batch`` through ``model`` (a ``torch_ref.Decoder``, bare or
    wrapped by DDP/FSDP), the forward under autocast for mixed precision. With the decoder's
    ``loss_chunks`` set (``torch_ref.remat.apply_loss_policy``) the head and loss run inside its
    forward, in chunks; otherwise the logits come out and the loss is taken outside autocast."""
    decoder = unwrap(model)
    chunked = bool(getattr(decoder, "loss_chunks", 0) or getattr(decoder, "loss_tile_tokens", 0))
    device = batch["inputs"].device.type
    with torch.autocast(
        device, dtype=TORCH_DTYPES[precision.compute_dtype], enabled=precision.is_mixed
    ):
        if chunked:  # the loss inside the module's forward (torch_ref.Decoder.forward)
            return model(batch["inputs"], batch["targets"], batch.get("mask"))
        logits = model(batch["inputs"])
    return cross_entropy_sum(logits, batch["targets"], batch.get("mask"))


def accumulate_grads(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    *,
    precision: Precision,
    accum_steps: int = 1,
    scaler: torch.amp.GradScaler | None = None,
    divisor: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward over ``accum_steps`` microbatches, leaving the batch's mean-loss gradient in
    ``.grad`` (scaled by ``scaler`` if given). Returns ``(loss_sum, n_tokens)`` of the batch.
    ``divisor`` maps the batch's valid-token count to what each summed loss is divided by (one
    rank of a data-parallel run: ``torch_ref.distributed.local_token_divisor``).

    The seeds' loop divides each microbatch loss by ``accum_steps`` — a mean of means, wrong
    whenever microbatches hold different numbers of valid tokens. Here every microbatch's summed
    loss is divided by the whole batch's valid-token count, so the accumulated gradient is the
    big batch's mean gradient exactly.
    """
    mask = batch.get("mask")
    n_total = (
        mask.float().sum() if mask is not None else torch.tensor(float(batch["targets"].numel()))
    )
    divide_by = n_total if divisor is None else divisor(n_total)
    loss_sum_total = None  # summed on the device, in the loss's dtype
    for micro in split_microbatches(batch, accum_steps):
        loss_sum, _ = lm_loss_sum(model, micro, precision)
        loss = loss_sum / divide_by
        (scaler.scale(loss) if scaler is not None else loss).backward()
        loss_sum = loss_sum.detach()
        loss_sum_total = loss_sum if loss_sum_total is None else loss_sum_total + loss_sum
    return loss_sum_total, n_total


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | HybridDeviceOptimizer,
    batch: dict[str, torch.Tensor],
    *,
    precision: Precision,
    accum_steps: int = 1,
    scaler: torch.amp.GradScaler | None = None,
) -> dict[str, torch.Tensor]:
    """One optimizer step over ``batch`` in ``accum_steps`` microbatches (see
    ``accumulate_grads``); with a ``scaler`` a step with inf/nan gradients is skipped."""
    optimizer.zero_grad(set_to_none=True)
    loss_sum, n_tokens = accumulate_grads(
        model, batch, precision=precision, accum_steps=accum_steps, scaler=scaler
    )
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    return {"loss": loss_sum / n_tokens, "n_tokens": n_tokens}


def make_scaler(precision: Precision, device: str = "cpu") -> torch.amp.GradScaler | None:
    """GradScaler with its defaults (init 2**16, growth 2 every 2000 finite steps, backoff 0.5)
    when the precision asks for dynamic loss scaling."""
    return torch.amp.GradScaler(device) if precision.loss_scale == "dynamic" else None
