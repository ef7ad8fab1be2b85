"""``jaxmem train --framework torch``: the same job trained by torch_ref, in plain eager PyTorch.

Same initial weights (jaxmem's initialisation, copied through the safetensors key map), same
batches (``jaxmem.data.batch_at``: a pure function of ``(seed, step)``), same validation
batches, same memory policy, precision and accumulation, and the same run files as
``jaxmem.run``, so both loss curves land on one plot (``jaxmem plot RUN_A RUN_B``).

Checkpoints are ``checkpoints/<step>/`` directories (``state.pt``: model, optimizer and
GradScaler state dicts; ``run_config.json``; ``meta.json``), written under a temporary name and
renamed into place, so a killed save leaves nothing that looks complete; the last ``keep`` are
kept. They load with ``torch.load(weights_only=True)``: no pickled code runs.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from typing import Any

import numpy as np
import torch
from rich.console import Console

from jaxmem import data as data_lib
from jaxmem.checkpoint import CheckpointError
from jaxmem.parity import torch_model_from
from jaxmem.precision import get_precision
from jaxmem.train import make_model
from torch_ref.loss import cross_entropy_sum
from torch_ref.remat import apply_memory_policy
from torch_ref.train import TORCH_DTYPES, accumulate_grads, make_optimizer, make_scaler

_TMP = ".tmp-"


class TorchCheckpointer:
    """Atomic, keep-last-k checkpoints of a torch_ref run (see the module docstring)."""

    def __init__(self, directory: str, keep: int):
        self.directory, self.keep = directory, keep

    def all_steps(self) -> list[int]:
        if not os.path.isdir(self.directory):
            return []
        return sorted(
            int(name)
            for name in os.listdir(self.directory)
            if name.isdigit() and os.path.isfile(os.path.join(self.directory, name, "meta.json"))
        )

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def read_config(self, step: int) -> dict[str, Any]:
        try:
            with open(os.path.join(self.directory, str(step), "run_config.json")) as f:
                return json.load(f)
        except (OSError, ValueError) as e:
            raise CheckpointError(
                f"checkpoint {self.directory}/{step} has no readable run_config.json ({e}); "
                "delete that step directory to resume from an earlier one"
            ) from None

    def save(self, step: int, state: dict[str, Any], run_config: dict, extra: dict) -> None:
        os.makedirs(self.directory, exist_ok=True)
        final = os.path.join(self.directory, str(step))
        tmp = os.path.join(self.directory, f"{step}{_TMP}{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        torch.save(state, os.path.join(tmp, "state.pt"))
        with open(os.path.join(tmp, "run_config.json"), "w") as f:
            json.dump(run_config, f)
        with open(os.path.join(tmp, "meta.json"), "w") as f:  # written last: marks complete
            json.dump({"step": step, "extra": extra}, f)
        os.replace(tmp, final)
        for old in self.all_steps()[: -self.keep]:
            shutil.rmtree(os.path.join(self.directory, str(old)), ignore_errors=True)
        for name in os.listdir(self.directory):  # leftovers of killed saves
            if _TMP in name:
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    def load(self, step: int) -> dict[str, Any]:
        path = os.path.join(self.directory, str(step), "state.pt")
        try:
            return torch.load(path, weights_only=True, map_location="cpu")
        except Exception as e:  # torch raises several types for a truncated or foreign file
            raise CheckpointError(
                f"checkpoint {path} cannot be loaded ({type(e).__name__}); delete that step "
                "directory to resume from an earlier one"
            ) from None


def generate(
    model: torch.nn.Module, prompt: np.ndarray, n_new: int, *, temperature: float, seed: int
) -> np.ndarray:
    """The same fixed-buffer sampling as ``jaxmem.generate`` (no KV cache)."""
    cfg = model.cfg
    prompt = np.asarray(prompt, dtype=np.int64)[-(cfg.max_seq_len - 1) :]
    total = min(prompt.size + n_new, cfg.max_seq_len)
    device = next(model.parameters()).device
    buf = torch.full((1, total), data_lib.PAD, dtype=torch.long, device=device)
    buf[0, : prompt.size] = torch.from_numpy(prompt)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for i in range(prompt.size, total):
            logits_v = model(buf)[0, i - 1].float()
            if temperature == 0.0:
                token = logits_v.argmax()
            else:
                probs = torch.softmax(logits_v / temperature, dim=-1)
                token = torch.multinomial(probs, 1, generator=gen)[0]
            buf[0, i] = token
    return buf[0].cpu().numpy()


def run_torch_training(prepared: Any, console: Console | None = None) -> dict[str, Any]:
    """Train ``prepared.job`` (a ``jaxmem.run.PreparedJob``) with torch_ref."""
    from jaxmem.run import (
        CHECKPOINT_DIR,
        RunFailed,
        RunFiles,
        is_out_of_memory,
        out_of_memory_message,
        progress_bar,
        report,
        summarize,
        train_batch,
        val_batches,
    )

    console = console or Console()
    job = prepared.job
    cfg, r = job.model, job.run
    precision = get_precision(job.precision)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(r.seed)
    model = torch_model_from(make_model(cfg, seed=r.seed))  # jaxmem's initial weights
    model = model.to(device, TORCH_DTYPES[precision.param_dtype])
    apply_memory_policy(model.blocks, job.policy)
    opt = make_optimizer(model, job.optimizer)
    scaler = make_scaler(precision, device)
    start = prepared.resume_step or 0
    ckpt = None
    if prepared.out_dir is not None:
        ckpt = TorchCheckpointer(os.path.join(prepared.out_dir, CHECKPOINT_DIR), r.keep_checkpoints)
    if prepared.resume_step is not None:
        assert ckpt is not None
        state = ckpt.load(prepared.resume_step)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        if scaler is not None:
            scaler.load_state_dict(state["scaler"])
    files = RunFiles(prepared.out_dir, job)
    files.start(prepared.resume_step)
    make_batch = train_batch(prepared.dataset, job)

    def to_device(batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        # pinned host memory + non_blocking: the seeds' DataLoader(pin_memory=True) advice
        pin = device == "cuda"
        return {
            k: (torch.from_numpy(v).long().pin_memory() if pin else torch.from_numpy(v).long()).to(
                device, non_blocking=pin
            )
            for k, v in batch.items()
        }

    valid = [to_device(b) for b in val_batches(prepared.dataset, job)]

    def val_loss() -> float:
        model.eval()
        total, count = 0.0, 0.0
        with torch.no_grad():
            for b in valid:
                with torch.autocast(
                    device,
                    dtype=TORCH_DTYPES[precision.compute_dtype],
                    enabled=precision.is_mixed,
                ):
                    logits = model(b["inputs"])
                s, n = cross_entropy_sum(logits, b["targets"])
                total, count = total + float(s), count + float(n)
        model.train()
        return total / count

    console.print(
        f"[bold]jaxmem train --framework torch[/] preset {job.preset} "
        f"({cfg.n_params / 1e6:.2f} M params), policy {job.policy.name}, precision "
        f"{precision.name}, accum {job.accum.steps}, batch {r.batch_size} x seq {r.seq_len}, "
        f"{job.optimizer.name} lr {job.optimizer.lr}, steps {start + 1}..{r.steps} on {device}; "
        f"data: {prepared.dataset.source}"
        + (f"; resumed from step {start}" if prepared.resume_step is not None else "")
    )
    tokens_per_step = r.batch_size * r.seq_len
    skipped, last_good, steps_done = 0, start, 0
    pending: list[tuple[int, torch.Tensor, torch.Tensor, bool]] = []
    t_start = time.perf_counter()
    with (
        progress_bar(console) as progress,
        data_lib.Prefetcher(
            make_batch, start + 1, r.steps + 1, depth=r.prefetch, transfer=to_device
        ) as batches,
    ):
        task = progress.add_task(
            "train", total=r.steps, completed=start, loss=float("nan"), tps=0.0, mem=""
        )
        for step, batch in batches:
            try:
                opt.zero_grad(set_to_none=True)
                loss_sum, n = accumulate_grads(
                    model,
                    batch,
                    precision=precision,
                    accum_steps=job.accum.steps,
                    scaler=scaler,
                )
                if scaler is not None:
                    scaler.unscale_(opt)
                grad_norm = torch.linalg.vector_norm(
                    torch.stack([p.grad.float().norm() for p in model.parameters()])
                )
                if scaler is not None:
                    before = scaler.get_scale()
                    scaler.step(opt)
                    scaler.update()
                    step_skipped = scaler.get_scale() < before
                else:
                    opt.step()
                    step_skipped = False
            except RuntimeError as e:
                if is_out_of_memory(e):
                    raise RunFailed(out_of_memory_message(job, None, "while training")) from None
                raise
            # tensors until the refresh: no host sync per step (GradScaler's get_scale, fp16
            # only, is its own)
            pending.append((step, (loss_sum / n).detach(), grad_norm.detach(), step_skipped))
            steps_done += 1
            is_last = step == r.steps
            evaluate = step % r.eval_every == 0 or is_last
            save = ckpt is not None and (step % r.checkpoint_every == 0 or is_last)
            if step % r.refresh_every and not (evaluate or save):
                continue
            records = []
            for s, loss_t, norm_t, was_skipped in pending:
                rec = {"step": s, "loss": float(loss_t), "grad_norm": float(norm_t)}
                rec["tokens"] = s * tokens_per_step
                if scaler is not None:
                    rec["skipped"] = bool(was_skipped)
                    skipped += rec["skipped"]
                elif not math.isfinite(rec["loss"]):
                    files.append(records)
                    good = f"step {last_good}" if ckpt and last_good else "none"
                    raise RunFailed(
                        f"loss became {rec['loss']} at step {s}; stopped before checkpointing "
                        f"it (last good checkpoint: {good}); lower --lr, or use --precision fp32"
                    )
                records.append(rec)
            pending = []
            if evaluate:
                records[-1]["val_loss"] = val_loss()
                progress.console.print(
                    f"step {step}: train loss {records[-1]['loss']:.4f}, "
                    f"val loss {records[-1]['val_loss']:.4f}"
                )
            files.append(records)
            last_loss = records[-1]["loss"]
            if save:
                assert ckpt is not None
                state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
                if scaler is not None:
                    state["scaler"] = scaler.state_dict()
                ckpt.save(step, state, job.to_dict(), {"loss": last_loss, "skipped": skipped})
                last_good = step
            progress.update(
                task,
                completed=step,
                loss=last_loss,
                tps=steps_done * tokens_per_step / (time.perf_counter() - t_start),
            )
    wall = time.perf_counter() - t_start
    sample = None
    if r.sample_tokens:
        prompt = data_lib.encode(r.prompt) if r.prompt else np.array([data_lib.BOS])
        tokens = generate(model, prompt, r.sample_tokens, temperature=r.temperature, seed=r.seed)
        sample = data_lib.decode(tokens)
        console.rule("sample")
        console.print(sample, markup=False, highlight=False)
        console.rule()
    summary = summarize(
        job, files.records, wall, steps_done * tokens_per_step / wall, 0.0, skipped, start
    )
    summary["compile_s"] = None  # eager: nothing compiled
    summary["platform"] = device
    report(console, summary, files.finish(summary, sample), prepared.out_dir)
    return summary
