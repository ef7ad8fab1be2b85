"""``torch_ref.module_memory`` on models it has never seen: the saved bytes of a stack of MLP
blocks equal the sums written out by hand under each mode, fake tensors give the real figures,
FLOPs move by exactly the recomputed matmuls, the CPU step peak equals a hand count and
PyTorch's own ``MemTracker``, the figures on torch_ref's decoder equal
``torch_ref.forward_memory``'s, and a Hugging Face model runs under every mode."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import set_checkpoint_early_stop

import torch_ref
from jaxmem.config import PRESETS, ConfigError
from jaxmem.policy import POLICIES
from torch_ref.forward_memory import forward_live_bytes, saved_tensor_bytes
from torch_ref.loss import cross_entropy_sum
from torch_ref.module_memory import (
    CheckpointPlan,
    ModelError,
    applied,
    saved_activations,
    step_peak,
)
from torch_ref.remat import apply_memory_policy

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "hf_torch_memory.py"
HF_MISSING = "transformers is the hf extra (pip install 'jaxmem[hf]'; make test installs it)"
B, D, H, L = 4, 8, 16, 3  # batch, width, hidden width, blocks
F32 = 4  # bytes


class Block(nn.Module):
    """``x + fc2(gelu(fc1(x)))``: two matmuls (``addmm``, with bias) per block."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(D, H), nn.GELU(), nn.Linear(H, D)

    def forward(self, x_bd: torch.Tensor) -> torch.Tensor:
        return x_bd + self.fc2(self.act(self.fc1(x_bd)))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(L))

    def forward(self, x_bd: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x_bd = layer(x_bd)
        return x_bd


def plan(mode: str) -> CheckpointPlan:
    return CheckpointPlan(mode=mode, units="layers.*" if mode != "none" else ())


# By hand, for the stack above and the default loss (the output's sum, whose backward reads
# nothing). Autograd saves, per block: fc1's input (x, block 0's is the batch: an argument),
# GELU's input (fc1's output, [B, H]) and fc2's input (GELU's output, [B, H]); the residual add
# saves nothing. Non-reentrant checkpoint keeps each unit's input. Selective checkpointing
# caches every matmul output: fc1's [B, H] and fc2's [B, D].
UNIT_INPUTS = (L - 1) * B * D * F32
HAND_BYTES = {
    "none": UNIT_INPUTS + L * 2 * B * H * F32,
    "full": UNIT_INPUTS,
    "selective": UNIT_INPUTS + L * (B * H + B * D) * F32,
}
MATMUL = 2 * B * D * H  # FLOPs of one [B, D] x [D, H] matmul
FORWARD = L * 2 * MATMUL
# the backward runs two matmuls per forward one, but block 0's fc1 needs no input gradient
BACKWARD = 2 * FORWARD - MATMUL


@pytest.fixture
def stack() -> Stack:
    return Stack()


@pytest.fixture
def batch() -> torch.Tensor:
    return torch.randn(B, D)


@pytest.mark.parametrize("mode", ["none", "full", "selective"])
def test_saved_bytes_equal_the_hand_count_under_each_mode(stack, batch, mode):
    saved = saved_activations(stack, batch, policy=plan(mode))
    assert saved.activation_bytes == HAND_BYTES[mode]
    assert saved.forward_live_bytes == HAND_BYTES[mode]  # nothing else holds a tensor
    assert saved.units == (() if mode == "none" else ("layers.0", "layers.1", "layers.2"))


def test_the_saved_bytes_are_labelled_by_op_and_by_module(stack, batch):
    none = saved_activations(stack, batch)
    assert none.by_op == {
        "aten.addmm": L * B * H * F32,
        "aten.gelu": L * B * H * F32,
        "aten.add": UNIT_INPUTS,
    }
    assert none.by_module == {
        **{f"layers.{i}.fc1": B * H * F32 for i in range(L)},
        **{f"layers.{i}.act": B * H * F32 for i in range(L)},
        **{f"layers.{i}": B * D * F32 for i in range(L - 1)},  # the residual add's output
    }
    # parameters apart: every weight but block 0's fc1 (its input needs no gradient), the batch
    weights = (2 * L - 1) * D * H * F32
    assert none.argument_bytes == weights + B * D * F32
    selective = saved_activations(stack, batch, policy=plan("selective"))
    assert selective.by_op == {"aten.addmm": L * (B * H + B * D) * F32, "aten.add": UNIT_INPUTS}
    # the matmul outputs are held by selective checkpointing's cache, which hooks do not see
    assert selective.kept_by_checkpoint_bytes == L * (B * H + B * D) * F32


@pytest.mark.parametrize("mode", ["none", "full", "selective"])
def test_the_figures_equal_an_independent_live_tensor_count(stack, batch, mode):
    """``torch_ref.forward_memory.forward_live_bytes`` counts every storage the forward left alive,
    whoever holds it: selective checkpointing's cache included."""
    saved = saved_activations(stack, batch, policy=plan(mode), fake=False)
    with applied(stack, plan(mode)):
        _, live = forward_live_bytes(lambda: stack(batch).sum())
    assert saved.activation_bytes == live.device_bytes


@pytest.mark.parametrize("mode", ["none", "full", "selective"])
def test_fake_real_and_meta_tensors_give_the_same_figures(batch, mode):
    torch.manual_seed(0)
    real_stack = Stack()
    with torch.device("meta"):
        meta_stack = Stack()
    real = saved_activations(real_stack, batch, policy=plan(mode), fake=False)
    fake = saved_activations(real_stack, batch, policy=plan(mode), fake=True)
    meta = saved_activations(meta_stack, torch.empty(B, D, device="meta"), policy=plan(mode))
    for other in (fake, meta):
        assert other.by_op == real.by_op
        assert other.by_module == real.by_module
        assert (other.argument_bytes, other.flops) == (real.argument_bytes, real.flops)
    assert fake.fake and not real.fake


def test_measuring_leaves_the_model_as_it_was(stack, batch):
    before = {k: v.clone() for k, v in stack.state_dict().items()}
    saved_activations(stack, batch, policy=plan("selective"))
    saved_activations(stack, batch, policy=plan("full"), fake=False)
    assert all(p.grad is None for p in stack.parameters())
    assert all(not isinstance(p, torch._subclasses.FakeTensor) for p in stack.parameters())
    assert all(torch.equal(v, before[k]) for k, v in stack.state_dict().items())
    assert all("forward" not in m.__dict__ for m in stack.modules())


def test_flops_move_by_exactly_the_recomputed_matmuls(stack, batch):
    """Selective keeps every matmul output: no matmul runs again. Full replays each unit's
    forward; PyTorch's non-reentrant checkpoint stops the replay once every tensor the backward
    reads is back (early stop, on by default), so fc2, whose product nothing reads, is replayed
    only with early stop off."""
    flops = {m: saved_activations(stack, batch, policy=plan(m)).flops for m in HAND_BYTES}
    assert flops["none"] == FORWARD + BACKWARD
    assert flops["selective"] == flops["none"]
    assert flops["full"] == flops["none"] + L * MATMUL  # fc1 of each unit
    with set_checkpoint_early_stop(False):
        no_early_stop = saved_activations(stack, batch, policy=plan("full")).flops
    assert no_early_stop == flops["none"] + FORWARD  # exactly one forward of the units
    assert saved_activations(stack, batch).forward_flops == FORWARD


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_gradients_under_a_plan_equal_the_plain_ones(stack, batch, mode):
    def grads() -> list[torch.Tensor]:
        stack.zero_grad(set_to_none=True)
        stack(batch).square().sum().backward()
        return [p.grad.clone() for p in stack.parameters()]

    plain = grads()
    with applied(stack, plan(mode)) as units:
        checkpointed = grads()
    assert units == ("layers.0", "layers.1", "layers.2")
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed, strict=True))


def test_a_star_picks_the_children_of_a_sequential_not_the_model():
    blocks = nn.Sequential(*(Block() for _ in range(L)))
    saved = saved_activations(
        blocks, torch.randn(B, D), policy=CheckpointPlan(mode="full", units="*")
    )
    assert saved.units == ("0", "1", "2")
    assert saved.activation_bytes == HAND_BYTES["full"]


def test_units_by_class_and_nested_matches_keep_the_outermost(stack, batch):
    by_class = CheckpointPlan(mode="full", units=Block)
    nested = CheckpointPlan(mode="full", units=("layers.*", "layers.**"))
    for policy in (by_class, nested):
        saved = saved_activations(stack, batch, policy=policy)
        assert saved.units == ("layers.0", "layers.1", "layers.2")
        assert saved.activation_bytes == HAND_BYTES["full"]


# ----------------------------------------------------------------------- torch_ref's decoder
@pytest.mark.parametrize("mode", ["none", "full"])
def test_the_figures_on_torch_refs_decoder_equal_torch_ref_memory(mode):
    cfg = PRESETS["tiny"].replace(n_layers=2)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    targets = torch.randint(0, cfg.vocab_size, (2, 16))

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        total, n = cross_entropy_sum(logits, targets)
        return total / n

    torch.manual_seed(0)
    ours = torch_ref.Decoder(cfg)
    policy = CheckpointPlan(mode=mode, units="blocks.layers.*" if mode == "full" else ())
    real = saved_activations(ours, tokens, policy=policy, loss_fn=loss_fn, fake=False)
    fake = saved_activations(ours, tokens, policy=policy, loss_fn=loss_fn)
    theirs = torch_ref.Decoder(cfg)
    apply_memory_policy(theirs.blocks, POLICIES[mode])
    arguments = [*theirs.parameters(), tokens, targets]
    _, reference = saved_tensor_bytes(lambda: loss_fn(theirs(tokens)), arguments)
    assert real.activation_bytes == reference.activation_bytes_device
    assert fake.activation_bytes == reference.activation_bytes_device
    assert real.argument_bytes == reference.argument_bytes


# ---------------------------------------------------------------------------------- step peak
def test_the_cpu_step_peak_of_one_linear_equals_the_hand_count():
    """``loss = (x W^T).sum()``, plain SGD (updates in place). Resident: W and x. The forward
    peaks at the product and the loss; the backward at the loss, its seed gradient (``ones``)
    and W's gradient, the product freed: the larger is the peak."""
    n_in, n_out = 8, 16
    linear = nn.Linear(n_in, n_out, bias=False)
    x = torch.randn(B, n_in)
    peak = step_peak(linear, x, optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.1))
    resident = (n_out * n_in + B * n_in) * F32
    forward = B * n_out * F32 + F32
    backward = F32 + F32 + n_out * n_in * F32
    assert peak.peak_bytes == resident + max(forward, backward)
    assert peak.first_step_peak_bytes == peak.steady_step_peak_bytes
    assert (peak.parameter_bytes, peak.gradient_bytes) == (n_out * n_in * F32,) * 2
    assert peak.optimizer_state_bytes == 0
    assert peak.source.startswith("live-tensor accounting on CPU")
    # gradients left by the last steps are freed by the first zero_grad: the same peak
    assert step_peak(linear, x, optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.1)) == peak


def test_the_cpu_step_peak_equals_pytorchs_mem_tracker(stack, batch):
    from torch.distributed._tools.mem_tracker import MemTracker

    peak = step_peak(stack, batch)  # AdamW
    n_tensors = len(list(stack.parameters()))
    assert peak.optimizer_state_bytes == 2 * peak.parameter_bytes + n_tensors * F32  # + steps
    optimizer = torch.optim.AdamW(stack.parameters())

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        stack(batch).sum().backward()
        optimizer.step()

    step()  # the state exists, as in step_peak's second step
    optimizer.zero_grad(set_to_none=True)
    tracker = MemTracker()
    tracker.track_external(stack, optimizer, batch)
    with tracker:
        step()
    assert (
        peak.steady_step_peak_bytes == tracker.get_tracker_snapshot("peak")[batch.device]["Total"]
    )


def test_the_step_peak_grows_by_what_each_block_keeps():
    """Without checkpointing the peak comes at the start of the backward, everything saved still
    alive: each block adds its saved activations (2 x [N, H]), its output (the next block's
    input, [N, D]) and its parameters. Under full checkpointing a block adds at most its input,
    its parameters and their gradients."""
    n = 256
    x = torch.randn(n, D)
    block_params = (D * H + H + H * D + D) * F32
    sgd = {"optimizer_factory": lambda p: torch.optim.SGD(p, lr=0.1)}

    def peak(depth: int, policy: CheckpointPlan | None = None) -> int:
        model = nn.Sequential(*(Block() for _ in range(depth)))
        return step_peak(model, x, policy=policy, **sgd).peak_bytes

    full = CheckpointPlan(mode="full", units=Block)
    none_growth = peak(8) - peak(4)
    assert none_growth == 4 * ((2 * n * H + n * D) * F32 + block_params)
    assert peak(8, full) - peak(4, full) <= 4 * (n * D * F32 + 2 * block_params) < none_growth
    assert peak(8, full) < peak(8)


# ------------------------------------------------------------------------------------- errors
def one_line(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text
    return text


def test_a_bad_mode_or_op_is_a_one_line_config_error():
    with pytest.raises(ConfigError) as e:
        CheckpointPlan(mode="fulll", units="layers.*")
    assert one_line(e) == "mode='fulll' is not one of none, full, selective"
    with pytest.raises(ConfigError) as e:
        CheckpointPlan(mode="full")
    assert "needs units" in one_line(e)
    with pytest.raises(ConfigError) as e:
        CheckpointPlan(mode="selective", units="layers.*", save_ops=("aten.matmull",))
    assert "'aten.matmull' names no PyTorch op" in one_line(e)
    with pytest.raises(ConfigError) as e:
        CheckpointPlan(mode="full", units="layers.*", save_ops=("aten.mm",))
    assert "selective" in one_line(e)


def test_a_pattern_matching_nothing_names_it_and_lists_real_names(stack, batch):
    with pytest.raises(ModelError) as e:
        saved_activations(stack, batch, policy=CheckpointPlan(mode="full", units="layer.*"))
    assert one_line(e) == (
        "units pattern 'layer.*' matches no submodule in Stack; it has: "
        "layers.0, layers.1, layers.2"
    )
    with pytest.raises(ModelError) as e:
        saved_activations(stack, batch, policy=CheckpointPlan(mode="full", units=nn.Conv1d))
    assert one_line(e).startswith("units class Conv1d has no instance in Stack; it has: Stack,")


def test_inputs_the_forward_rejects_are_a_one_line_model_error(stack):
    for fake in (True, False):
        with pytest.raises(ModelError) as e:
            saved_activations(stack, torch.randn(B, D + 1), fake=fake)
        assert one_line(e).startswith(f"Stack(Tensor[{B}, {D + 1}] float32 on cpu) raised ")
    with pytest.raises(ModelError) as e:
        step_peak(stack, torch.randn(B, D + 1))
    assert one_line(e).startswith("Stack(Tensor")
    with torch.device("meta"):
        meta = Stack()
    with pytest.raises(ModelError) as e:
        saved_activations(meta, torch.randn(B, D), fake=False)
    assert "meta device" in one_line(e)
    with pytest.raises(ModelError) as e:
        saved_activations(stack, torch.randn(B, D), loss_fn=lambda out: out)
    assert one_line(e) == f"loss_fn returned Tensor[{B}, {D}], not a scalar tensor"


class ReadsValues(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x_bd: torch.Tensor) -> torch.Tensor:
        return self.fc(x_bd) if x_bd.sum() > 0 else -self.fc(x_bd)  # reads a value


def test_a_forward_that_reads_values_is_told_to_measure_real_tensors():
    with pytest.raises(ModelError) as e:
        saved_activations(ReadsValues(), torch.randn(B, D))
    assert one_line(e).endswith("which fake tensors do not have: use fake=False)")
    assert saved_activations(ReadsValues(), torch.randn(B, D), fake=False).n_storages == 0


# ------------------------------------------------------------------------------ Hugging Face
LLAMA = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped-query attention
    "max_position_embeddings": 64,
    "use_cache": False,  # training: no KV cache (checkpoint would replay its updates)
}
HF_BATCH, HF_SEQ = 2, 16


def hf_plan(mode: str) -> CheckpointPlan:
    return CheckpointPlan(mode=mode, units="model.layers.*" if mode != "none" else ())


def hf_llama(**overrides: object) -> nn.Module:
    transformers = pytest.importorskip("transformers", reason=HF_MISSING)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA, **overrides))


def hf_inputs() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, LLAMA["vocab_size"], (HF_BATCH, HF_SEQ))
    return {"input_ids": ids, "labels": ids}


def load_example():
    spec = importlib.util.spec_from_file_location("hf_torch_memory", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_hugging_face_llama_gives_the_real_figures_on_fake_tensors():
    """Eager attention takes one path whatever the tensors: fake equals real, every mode."""
    model, inputs = hf_llama(attn_implementation="eager"), hf_inputs()
    saved = {}
    for mode in ("none", "full", "selective"):
        fake = saved_activations(model, inputs, policy=hf_plan(mode))
        real = saved_activations(model, inputs, policy=hf_plan(mode), fake=False)
        assert (fake.by_op, fake.by_module) == (real.by_op, real.by_module), mode
        assert (fake.argument_bytes, fake.flops) == (real.argument_bytes, real.flops), mode
        assert fake.activation_bytes == fake.forward_live_bytes, mode
        saved[mode] = fake
    assert saved["full"].activation_bytes < saved["selective"].activation_bytes
    assert saved["selective"].activation_bytes < saved["none"].activation_bytes
    assert saved["selective"].flops == saved["none"].flops < saved["full"].flops
    assert saved["full"].units == ("model.layers.0", "model.layers.1")


def test_hugging_faces_sdpa_takes_its_tracing_path_on_fake_tensors_and_the_example_does_not():
    """On fake tensors HF's SDPA path builds the [B, 1, S, S] causal mask (it cannot rule out
    packed sequences), which each checkpointed layer holds; the example's registered attention
    (no mask, SDPA's is_causal) gives exactly the eager run of stock SDPA on real tensors."""
    example = load_example()
    stock, inputs = hf_llama(), hf_inputs()
    unpadded = hf_llama(attn_implementation=example.UNPADDED_SDPA)
    for mode in ("none", "full", "selective"):
        real = saved_activations(stock, inputs, policy=hf_plan(mode), fake=False)
        traced = saved_activations(stock, inputs, policy=hf_plan(mode))
        ours = saved_activations(unpadded, inputs, policy=hf_plan(mode))
        assert (ours.by_op, ours.by_module, ours.flops) == (real.by_op, real.by_module, real.flops)
        assert traced.flops == real.flops
        if mode != "none":
            mask = HF_BATCH * HF_SEQ * HF_SEQ  # bool
            assert traced.activation_bytes - real.activation_bytes == mask


@pytest.mark.slow
def test_the_example_prints_its_table():
    pytest.importorskip("transformers", reason=HF_MISSING)
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--small"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("policy"))
    rows = [lines[header + 2 + i].split()[0] for i in range(3)]
    assert rows == ["none", "full", "selective"]
    assert "top ops" in proc.stdout


@pytest.mark.slow
def test_the_api_pages_snippets_run_and_print_what_the_page_shows(tmp_path):
    """docs/your-model-pytorch.md: its Python blocks, run in order as one script, print exactly
    the lines the page shows."""
    import re

    page = (ROOT / "docs" / "your-model-pytorch.md").read_text()
    script = tmp_path / "snippets.py"
    script.write_text("\n".join(re.findall(r"```python\n(.*?)```", page, re.S)))
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    printed = done.stdout.strip().splitlines()
    assert len(printed) == 6
    for line in printed:
        assert line.strip() in page, line
