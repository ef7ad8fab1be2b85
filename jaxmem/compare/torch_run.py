"""``jaxmem train --framework torch``: the same job trained by torch_ref, in plain eager PyTorch.

Same initial weights (jaxmem's initialisation, copied through the safetensors key map: the one
thing here that needs both frameworks), same batches (``jaxmem.train.loop.train_batch``: a pure
function of ``(seed, step)``), same validation batches, same memory policy (stock PyTorch
translation; name-based offload through torch_ref's extension, as ``describe`` says), precision
and accumulation, and the same step loop and run files as a JAX run
(``jaxmem.train.loop.run_job``), so both loss curves land on one plot (``jaxmem plot A B``).
Checkpoints: ``torch_ref.checkpoint.TorchCheckpointer``.

Over a mesh (``--mesh fsdp=N``) the job runs as N torchrun processes, one per device
(``torch_ref.distributed``: DDP for ``dp``, FSDP2 for ``zero1``/``fsdp``, DTensor tensor
parallelism for ``tp=T`` and FSDP2 beside it): each data rank trains on its rows of every
batch, rank 0 owns the run directory and the console, and checkpoints hold the full state
dicts gathered on rank 0 (``torch.distributed.checkpoint.state_dict``), restored by
broadcasting them from rank 0.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from rich.console import Console

import torch_ref.distributed as tdist
from jaxmem.compare.parity import torch_model_from
from jaxmem.config import ConfigError
from jaxmem.figures import Figure, format_bytes, rss_figure
from jaxmem.job import JobConfig, torch_host_memory_refusal, torch_tensor_parallel_refusal
from jaxmem.model import make_model
from jaxmem.run_layout import CHECKPOINT_DIR
from jaxmem.train.loop import RunFailed, run_job, val_batches
from jaxmem.train.prepare import PreparedJob, check_resident, host_available_bytes, prepare_job
from jaxmem.train.run_dir import last_verified
from torch_ref.checkpoint import TorchCheckpointer
from torch_ref.context import apply_to_rank, rank_batch, whole_sequence
from torch_ref.generate import generate
from torch_ref.loss import cross_entropy_sum
from torch_ref.remat import (
    apply_loss_policy,
    apply_memory_policy,
    describe_loss,
    validate_for_torch,
)
from torch_ref.train import (
    TORCH_DTYPES,
    HybridDeviceOptimizer,
    accumulate_grads,
    clip_grads,
    current_lr,
    make_optimizer,
    make_scaler,
    make_schedulers,
    step_schedulers,
)


def check_torch_backend(job: JobConfig) -> None:
    """Raise ``ConfigError`` for what torch_ref cannot express (e.g. q/k/v split choices)."""
    validate_for_torch(job.memory, cfg=job.model)
    refusal = (
        torch_tensor_parallel_refusal(job)
        or torch_host_memory_refusal(job)
        or torch_adapter_refusal(job)
    )
    if refusal is not None:
        raise ConfigError(refusal)
    _check_torch_resident(job)


def torch_adapter_refusal(job: JobConfig) -> str | None:
    """Why torch_ref cannot train ``job``'s adapters (None: it can, or there are none):
    ``torch_ref.lora`` needs PEFT, holds a packed base (``torch_ref.quant``) on one device and
    unstreamed, and does not split its per-part q/k/v adapters over a tensor axis."""
    adapters = job.adapters
    if not adapters.enabled:
        return None
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        return (
            f"adapters.rank={adapters.rank} with --framework torch needs Hugging Face PEFT, "
            "which is not installed: pip install peft (or --framework jax)"
        )
    if adapters.base != "compute" and (job.parallel.devices > 1 or job.optimizer.stream):
        where = "--stream" if job.optimizer.stream else f"--mesh {job.parallel.mesh_text()}"
        return (
            f"--quantize-base {adapters.base} with --framework torch and {where}: torch_ref "
            f"holds a packed base on one device, unstreamed; drop {where.split()[0]} or use "
            "--framework jax"
        )
    if job.parallel.tensor_parallel:
        return (
            f"adapters with --mesh {job.parallel.mesh_text()}: torch_ref does not split the "
            "q/k/v adapters over a tensor axis; drop tp from --mesh or use --framework jax"
        )
    return None


def _check_torch_resident(job: JobConfig) -> None:
    """The model's state fits where torch_ref would hold it: each rank's GPU, or this host's
    memory for the ranks it runs."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        check_resident(job, props.total_memory, f"a {props.name} holds", devices_here=1)
    else:
        here = int(os.environ.get("LOCAL_WORLD_SIZE", job.parallel.devices))
        check_resident(job, host_available_bytes(), "this host has available", here)


def launch_for(job: JobConfig) -> tdist.Launch:
    """This process's place among torchrun's, checked against the job's mesh (one process per
    device); raises ``ConfigError`` naming the torchrun command that runs the job."""
    launch = tdist.from_environment()
    tdist.check_launch(job.parallel, launch, "jaxmem train --framework torch ...")
    return launch


def prepare(
    job: JobConfig, out_dir: str | None, *, resume: bool = False, primary: bool = True
) -> PreparedJob:
    return prepare_job(
        job, out_dir, resume=resume, check_backend=check_torch_backend, primary=primary
    )


def _add_adapters(model: Any, initial: Any, job: JobConfig) -> None:
    """PEFT's LoRA layers on ``model`` (``torch_ref.lora``; the base frozen, packed first as
    ``adapters.base`` says: ``torch_ref.quant``, the same bytes jaxmem packs from the same
    weights), holding ``initial``'s adapters (jaxmem's draw, through
    ``jaxmem.compare.weights``), so both frameworks start from the same adapters."""
    from jaxmem.compare.weights import to_torch_adapter_state_dict
    from torch_ref.lora import adapter_state_dict, add_adapters
    from torch_ref.quant import quantize_base

    if job.adapters.base != "compute":
        quantize_base(model, job.adapters.base)
    add_adapters(model, job.adapters)
    ours = adapter_state_dict(model)
    with torch.no_grad():
        for key, value in to_torch_adapter_state_dict(initial).items():
            ours[key].copy_(torch.from_numpy(value))


class TorchTrainer:
    """torch_ref's side of ``jaxmem.train.loop.run_job``: an eager step, no host sync."""

    framework = "torch"
    compile_s = None  # eager: nothing compiled
    planned_bytes = None
    can_offload = True  # torch_ref's extension offloads to (pinned) host memory anywhere

    def __init__(self, prepared: PreparedJob):
        job = self.job = prepared.job
        cfg, r = job.model, job.run
        self.parallel = job.parallel
        self.launch = launch_for(job)
        tdist.initialize(self.launch, group_of_one=job.optimizer.stream)
        self.device = self.launch.device
        self.platform = self.device.split(":")[0]
        # a data-parallel rank reads only its rows of every batch (jaxmem.train.loop)
        # (the ranks of one data rank's context axis read the same rows)
        self.local_rows = self.launch.rows(r.batch_size, self.parallel.tp * self.parallel.cp)
        torch.manual_seed(r.seed)
        weights = None
        if r.init_from is not None and prepared.resume_step is None:
            from jaxmem.model.hf import load_hf_weights, read_hf_weights

            # read (every tensor checked finite) before the random init compiles anything
            weights = read_hf_weights(r.init_from, cfg, "float32")  # make_model's default
        # jaxmem's initial weights (adapters too), or a checkpoint's
        initial = make_model(cfg, seed=r.seed, adapters=job.adapters)
        if weights is not None:
            load_hf_weights(initial, r.init_from, weights)
        model = torch_model_from(initial)
        model = model.to(self.device, TORCH_DTYPES[job.precision.param_dtype])
        if job.adapters.enabled:
            _add_adapters(model, initial, job)
        if self.parallel.context_parallel:  # each rank its columns, keys gathered over its group
            apply_to_rank(model, self.parallel, self.launch, r.seq_len)
        self.runner = apply_memory_policy(model.blocks, job.memory)
        apply_loss_policy(model, job.memory)
        # FSDP2 manages the model (sharded, or streamed through host memory on one process too)
        self.streamed = job.optimizer.stream
        # ranks of a process group (one, streamed): state gathered on rank 0 for checkpoints,
        # figures from each rank's shards
        self.grouped = self.parallel.sharded or self.streamed
        self.model = tdist.shard(model, self.parallel, self.launch, stream=self.streamed)
        self.host_state = job.optimizer.state_memory != "device"
        if self.host_state:
            # Megatron's hybrid optimizer with everything offloaded: fp32 masters and state in
            # host memory, updated there by a CPU optimizer
            self.opt = HybridDeviceOptimizer(self.model.parameters(), job.optimizer, 1.0)
        else:
            self.opt = make_optimizer(self.model, job.optimizer)  # over the shards, if sharded
        self.schedulers = make_schedulers(self.opt, job.optimizer)
        self.scaler = make_scaler(job.precision, self.device.split(":")[0])
        if self.scaler is not None and (
            self.parallel.shards_opt_state or self.parallel.tensor_parallel
        ):
            # FSDP2's and tensor parallelism's gradients are shards: ranks must agree on whether
            # a step overflowed
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(self.device.split(":")[0])
        self.divisor = tdist.token_divisor(self.parallel, self.launch)
        self.ckpt = None
        if prepared.out_dir is not None:
            self.ckpt = TorchCheckpointer(
                os.path.join(prepared.out_dir, CHECKPOINT_DIR), r.keep_checkpoints
            )
        self._valid = [self.transfer(b) for b in val_batches(prepared.dataset, job)]

    def describe(self) -> str:
        text = f"memory policy {self.runner.description}{describe_loss(self.job.memory)}"
        if self.parallel.sharded:
            text += (
                f"; --mesh {self.parallel.mesh_text()} over {self.launch.world_size} torchrun "
                f"processes: {tdist.describe(self.parallel)}"
            )
        if self.streamed:
            text += (
                "; streamed: FSDP2 CPUOffloadPolicy (parameters, gradients and optimizer state "
                "in host memory, the optimizer stepping on the CPU)"
            )
        if self.host_state:
            text += (
                "; optimizer state in host memory: Megatron's hybrid optimizer, fp32 masters "
                "updated on the CPU (torch_ref.train.HybridDeviceOptimizer)"
            )
        return text

    def transfer(self, batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        # pinned host memory + non_blocking: the seeds' DataLoader(pin_memory=True) advice
        pin = self.device == "cuda"
        out = {}
        for k, v in batch.items():
            t = torch.from_numpy(v).long()
            out[k] = (t.pin_memory() if pin else t).to(self.device, non_blocking=pin)
        return out

    def restore(self, step: int) -> None:
        self._load(step)
        # the schedule continues from the step (its learning rates are a function of it)
        self.schedulers = make_schedulers(self.opt, self.job.optimizer, done=step)

    def _load(self, step: int) -> None:
        assert self.ckpt is not None
        if self.grouped:
            # rank 0 reads and verifies the checkpoint and broadcasts it; each rank keeps its
            # shards (and the GradScaler's few numbers)
            state = self._joined(self.ckpt.load(step)) if self.launch.primary else {}
            tdist.load_full_state(self.model, self.opt, state)
            if self.scaler is not None:
                self.scaler.load_state_dict(tdist.broadcast_object(state.get("scaler")))
            return
        state = self._joined(self.ckpt.load(step))
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])

    def _joined(self, state: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint's state with its ``adapters`` (saved apart from the base, which keeps
        torch_ref's own names) joined back under this model's names."""
        if self.job.adapters.enabled != ("adapters" in state):
            held = "holds adapters" if "adapters" in state else "holds no adapters"
            raise ConfigError(
                f"checkpoint {self.ckpt.directory} {held} and this job "
                f"{'asks for' if self.job.adapters.enabled else 'has none'} "
                f"({self.job.adapters.label()}): resume with the adapters it was trained with"
            )
        if "adapters" not in state:
            return state
        from torch_ref.lora import join_state

        try:
            model = join_state(tdist.unwrap(self.model), state["model"], state["adapters"])
        except KeyError as e:
            raise ConfigError(f"checkpoint {self.ckpt.directory}: {e.args[0]}") from None
        return {**{k: v for k, v in state.items() if k != "adapters"}, "model": model}

    def step(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        self.opt.zero_grad(set_to_none=True)
        if self.parallel.context_parallel:
            batch = rank_batch(batch, self.parallel, self.launch)
        loss_sum, n = accumulate_grads(
            self.model,
            batch,
            precision=self.job.precision,
            accum_steps=self.job.accum.steps,
            scaler=self.scaler,
            divisor=self.divisor,
        )
        # the whole batch's, summed over the data axis
        loss_sum = tdist.data_sum(loss_sum, self.parallel, self.launch)
        n = tdist.data_sum(n, self.parallel, self.launch)
        tdist.reduce_partial_grads(self.model.parameters())  # sequence-parallel norms' sums
        if self.scaler is not None:
            self.scaler.unscale_(self.opt)
        grad_norm = tdist.grad_norm(self.model.parameters())
        # over several ranks, clip by that global norm (clip_grad_norm_ on FSDP2/TP DTensor
        # shards would reduce again, and count tensor-parallel replicated copies per rank)
        ranks = self.launch.world_size > 1
        clip_grads(self.model.parameters(), self.job.optimizer, grad_norm if ranks else None)
        lr = current_lr(self.opt)
        if self.scaler is not None:
            self.scaler.step(self.opt)  # skips the update when a gradient is inf/nan
            self.scaler.update()
        else:
            self.opt.step()
        step_schedulers(self.schedulers)  # also after a step GradScaler skipped, unwarned
        # tensors until the loop fetches them: no host sync per step. GradScaler skips a step
        # exactly when an unscaled gradient is inf/nan, i.e. when their norm is not finite.
        return (loss_sum / n).detach(), grad_norm.detach(), ~torch.isfinite(grad_norm), lr

    def fetch(self, metrics: tuple[Any, ...]) -> dict[str, Any]:
        loss, grad_norm, skipped, lr = metrics
        out = {"loss": float(loss), "grad_norm": float(grad_norm), "lr": lr}
        if self.scaler is not None:
            out["skipped"] = bool(skipped)
        return out

    def val_loss(self) -> float:
        self.model.eval()
        total = count = 0.0
        p = self.job.precision
        with torch.no_grad(), whole_sequence(tdist.unwrap(self.model)):
            for b in self._valid:
                with torch.autocast(
                    self.device, dtype=TORCH_DTYPES[p.compute_dtype], enabled=p.is_mixed
                ):
                    logits = self.model(b["inputs"])
                s, n = cross_entropy_sum(logits, b["targets"], b.get("mask"))
                total, count = total + float(s), count + float(n)
        self.model.train()
        return total / count

    def save(self, step: int, extra: dict[str, Any]) -> None:
        assert self.ckpt is not None
        if self.grouped:  # gathered whole on rank 0 (a collective)
            state = tdist.full_state(self.model, self.opt)
        else:
            state = {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        if self.job.adapters.enabled and "model" in state:
            from torch_ref.lora import split_state

            state["model"], state["adapters"] = split_state(state["model"])
        if self.launch.primary:
            self.ckpt.save(step, state, self.job.to_dict(), extra)
        tdist.barrier()  # no rank runs ahead of a checkpoint being written

    def memory_label(self) -> str:
        if self.device == "cuda":
            return f"peak {format_bytes(torch.cuda.max_memory_allocated())}"
        return ""

    def sample(self, prompt: np.ndarray, n_new: int, temperature: float, seed: int) -> np.ndarray:
        # every rank samples the same tokens (same seed): FSDP2's forward is a collective
        model = tdist.unwrap(self.model)
        with whole_sequence(model):
            return generate(model, prompt, n_new, temperature=temperature, seed=seed)

    def figures(self) -> list[Figure]:
        def nbytes(tensors: Any) -> int:
            return sum(t.numel() * t.element_size() for t in tensors)

        if self.host_state:
            state = self.opt.state_tensors()
        else:
            state = [
                t
                for s in self.opt.state.values()
                for t in s.values()
                if isinstance(t, torch.Tensor)
            ]
        source = "counted (tensors)"
        if self.grouped:
            nbytes = tdist.local_bytes
            if self.parallel.sharded:
                source = f"counted (this rank's shards, {self.parallel.mesh_text()})"
        host = " (host memory)"
        out = [
            Figure("parameters" + host * self.streamed, nbytes(self.model.parameters()), source),
            *self._frozen_figures(nbytes, source),
            Figure(
                "optimizer state" + host * (self.streamed or self.host_state), nbytes(state), source
            ),
        ]
        if self.host_state:
            masters = [m for _, m in self.opt.offloaded]
            out.append(Figure("fp32 master parameters (host memory)", nbytes(masters), source))
        if self.device == "cuda":
            peak = torch.cuda.max_memory_allocated()
            out.append(Figure("device peak", peak, "runtime peak (max_memory_allocated)"))
        return [*out, rss_figure()]

    def _frozen_figures(self, nbytes: Any, source: str) -> list[Figure]:
        """With adapters: the parameters that train (the optimizer's) and the frozen base."""
        if not self.job.adapters.enabled:
            return []
        params = list(self.model.parameters())
        trained = [p for p in params if p.requires_grad]
        frozen = [p for p in params if not p.requires_grad]
        out = [
            Figure(f"  trainable ({self.job.adapters.label()})", nbytes(trained), source),
            Figure("  frozen (no gradient, no optimizer state)", nbytes(frozen), source),
        ]
        if self.job.adapters.base != "compute":  # buffers, not parameters
            from torch_ref.quant import QuantizedLinear

            packed = [
                getattr(m, n)
                for m in self.model.modules()
                if isinstance(m, QuantizedLinear)
                for n in m.names
            ]
            label = f"  packed {self.job.adapters.base} base (frozen buffers)"
            out.append(Figure(label, nbytes(packed), source))
        return out

    def any_process(self, flag: bool) -> bool:
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() == 1:
            return flag
        value = torch.tensor([int(flag)], device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def close(self) -> None:
        pass


# What gloo and NCCL say when a peer rank's process is gone (its sockets closed, or a
# collective timed out waiting for it)
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL")


class _Terminated(BaseException):
    """SIGTERM outside the loop's own stop handling (while a failure unwinds, or in setup)."""


def _peer_gone(e: BaseException | None) -> str | None:
    """What a lost peer made the collective say, from ``e`` or an exception it was raised
    while handling; None when no peer is gone."""
    seen = 0
    while e is not None and seen < 16:
        said = [words for words in PEER_GONE if words in str(e)]
        if said:
            return said[0]
        e, seen = e.__context__, seen + 1
    return None


def run_training(prepared: PreparedJob, console: Console | None = None) -> dict[str, Any]:
    """Train ``prepared.job`` with torch_ref; returns the run summary. Under torchrun, a
    collective that fails because another rank's process is gone ends this rank with
    ``RunFailed`` (which rank, and the checkpoint to resume from) instead of a traceback from
    the collective and another from the teardown's barrier, said by the first survivor only
    (``first_to_say``): the run ends in one line; torchrun's agent then names the rank that
    died first and ends the others.

    The agent ends the others with SIGTERM as soon as it sees the lost rank, which can land
    while this rank's failure is still unwinding (a progress bar closing, the prefetch thread
    joining), outside the loop's own signal handling: SIGTERM then raises ``_Terminated`` here,
    and when it interrupted a lost peer's failure the rank still ends in its one line. Any other
    SIGTERM ends the process as the signal's default does."""
    import signal
    import threading

    import torch.distributed as dist

    peer_gone = False
    main = threading.current_thread() is threading.main_thread()

    def terminated(number: int, frame: Any) -> None:
        raise _Terminated

    old = signal.signal(signal.SIGTERM, terminated) if main else None
    try:
        return run_job(prepared, lambda: TorchTrainer(prepared), console or Console())
    except (Exception, _Terminated) as e:
        said = _peer_gone(e)
        if dist.is_initialized() and said:
            if main:  # the report first; the agent's SIGTERM may still be on its way
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            peer_gone = True  # no teardown barrier: the lost rank would never meet it
            n = dist.get_world_size()
            launcher = f"torchrun --standalone --nproc_per_node={n} --no-python "
            good = (
                last_verified(prepared.out_dir, launcher=launcher)
                if prepared.out_dir
                else "none (no --out)"
            )
            raise RunFailed(
                f"rank {dist.get_rank()} of {n}: another rank is gone (a collective failed: "
                f"{said}; torchrun's report names the rank); last verified checkpoint: {good}",
                said=tdist.first_to_say("peer-gone"),  # one survivor's line for the run
            ) from None
        if isinstance(e, _Terminated):  # as SIGTERM's default: the process ends by the signal
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        raise
    finally:
        if main and not peer_gone:
            signal.signal(signal.SIGTERM, old)
        if not peer_gone:
            tdist.shutdown()


def restored_model(run_dir: str, step: int, job: JobConfig) -> Any:
    """A jaxmem ``Decoder`` (in the run's parameter dtype) holding the model weights of
    checkpoint ``step`` of the torch_ref run in ``run_dir``: its ``state.pt`` (a torch pickle
    of jaxmem's own writing, read with ``weights_only=True``) through the key map of
    ``jaxmem.compare.weights``. What ``jaxmem export`` writes out for a torch run; a run with
    adapters gives its merged weights (base + scale·B·A, ``torch_ref.lora.merged_state_dict``)."""
    from jaxmem.compare.weights import WeightMapError, load_torch_state_dict

    ckpt = TorchCheckpointer(os.path.join(run_dir, CHECKPOINT_DIR), job.run.keep_checkpoints)
    state = ckpt.load(step)
    model = make_model(job.model, job.precision)
    weights = state["model"]
    try:
        if "adapters" in state:  # a LoRA run: its adapters merged into the base
            weights = _merged(job, weights, state["adapters"])
        load_torch_state_dict(model, weights)
    except (WeightMapError, KeyError) as e:
        raise ConfigError(f"checkpoint {run_dir}/{CHECKPOINT_DIR}/{step}: {e}") from None
    return model


def _merged(job: JobConfig, base: dict, adapters: dict) -> dict:
    """A LoRA checkpoint's base with its adapters merged in, under torch_ref's names."""
    import torch_ref
    from torch_ref.lora import add_adapters, join_state, merged_state_dict

    dtype = next(v.dtype for v in base.values() if v.is_floating_point())
    decoder = torch_ref.Decoder(job.model).to(dtype)
    if job.adapters.base != "compute":  # the checkpoint holds the packed base
        from torch_ref.quant import quantize_base

        quantize_base(decoder, job.adapters.base)
    decoder = add_adapters(decoder, job.adapters)
    decoder.load_state_dict(join_state(decoder, base, adapters), strict=True)
    return merged_state_dict(decoder)
