"""Instruction data: ``jaxmem prepare`` of JSON Lines records (prompt/completion, and messages
rendered with a chat template as transformers renders it) into token rows with a loss mask, its
refusals, and training on it: the loss is the mean over the masked-in tokens, accumulation
equals one big batch, and both frameworks agree."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmem import instruct
from jaxmem.compare.tolerances import tolerance
from jaxmem.config import PRESETS
from jaxmem.data import DataError
from jaxmem.precision import FP64
from tests.test_cli_contract import run_cli

TINY = PRESETS["tiny"]
ONE_BLOCK = dataclasses.replace(TINY, n_layers=1)  # for the float64 checks: cheap to compile
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|end|>"]
USER = "{% else %}<|user|>\n{{ m['content'] }}<|end|>\n{% endif %}{% endfor %}"
TAIL = "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
# the same conversation format with the assistant's text marked, and without (found by
# rendering the conversation prefix by prefix)
TEMPLATES = {
    "generation tags": "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "<|assistant|>\n{% generation %}{{ m['content'] }}<|end|>{% endgeneration %}\n" + USER + TAIL,
    "prefix by prefix": "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "<|assistant|>\n{{ m['content'] }}<|end|>\n" + USER + TAIL,
}
CORPUS = "the capital of france is paris. what is two plus two? four. hello there, how are you?"
CHAT = [
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "how are you?"},
    {"role": "user", "content": "the capital of france?"},
    {"role": "assistant", "content": "paris."},
]
PAIRS = [("what is two plus two?", " four."), ("the capital of france is", " paris.")]


def chat_tokenizer(directory: pathlib.Path, template: str | None) -> str:
    """A byte-level BPE tokenizer.json (a BOS before every text, as Llama's) trained on a line of
    text, and a tokenizer_config.json with its special tokens and ``template``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer)
    bos = ("<s>", tok.token_to_id("<s>"))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[bos])
    os.makedirs(directory, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return str(directory)


def write_records(path: pathlib.Path, records: list) -> str:
    path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in records))
    return str(path)


def _prepared(tmp_path, records, tokenizer_dir, seq_len=32) -> tuple[dict, object, object]:
    from jaxmem.hf.tokenizer import HFTokenizer

    tok = HFTokenizer(tokenizer_dir)
    src = write_records(tmp_path / "data.jsonl", records)
    meta = instruct.prepare_instruct(
        src, tmp_path / "out", tokenizer=tok, seq_len=seq_len, val_fraction=0.3
    )
    ds = instruct.load_instruction(tmp_path / "out", tok.vocab_size, tok)
    return meta, ds, tok


def _rows(ds) -> tuple[np.ndarray, np.ndarray]:
    width = ds.seq_len + 1
    ids = np.concatenate([ds.train, ds.val]).reshape(-1, width)
    return ids, np.concatenate([ds.train_mask, ds.val_mask]).reshape(-1, width).astype(bool)


def test_prompt_completion_rows_mask_exactly_the_completion_and_its_eos(tmp_path):
    tok_dir = chat_tokenizer(tmp_path / "tok", None)
    records = [{"prompt": p, "completion": c} for p, c in PAIRS] * 2
    meta, ds, tok = _prepared(tmp_path, records, tok_dir)
    assert meta["kind"] == "instruction" and meta["seq_len"] == 32 and ds.masked
    assert (meta["train_rows"], meta["val_rows"], meta["truncated"], meta["dropped"]) == (
        3,
        1,
        0,
        0,
    )
    ids, mask = _rows(ds)
    bos, eos, pad = (tok.token_id(t) for t in ("<s>", "</s>", "<pad>"))
    for row, counts, (prompt, completion) in zip(ids, mask, PAIRS * 2, strict=True):
        assert row[0] == bos  # the tokenizer's post-processor puts a BOS first
        assert tok.decode(row[counts]) == completion and row[counts][-1] == eos
        end = np.flatnonzero(counts)[-1] + 1
        assert tok.decode(row[:end]) == prompt + completion and set(row[end:]) == {pad}
    # a batch's targets are the row shifted by one, its mask the targets'
    b = instruct.rows_batch(ds, "train", 0, 2, seed=0)
    assert {k: v.shape for k, v in b.items()} == {k: (2, 32) for k in ("inputs", "targets", "mask")}
    np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])


@pytest.mark.parametrize("kind", sorted(TEMPLATES))
def test_messages_render_as_transformers_apply_chat_template(kind, tmp_path):
    """The text and ids equal transformers' ``apply_chat_template``; with generation tags its
    assistant mask too; found prefix by prefix, the masked-in tokens are the assistant turns and
    what the template writes after each (its end-of-turn)."""
    transformers = pytest.importorskip(
        "transformers", reason="transformers is in the dev extra (make test installs it)"
    )
    tok_dir = chat_tokenizer(tmp_path / "tok", TEMPLATES[kind])
    theirs = transformers.AutoTokenizer.from_pretrained(tok_dir)
    text = theirs.apply_chat_template(CHAT, tokenize=False)
    meta, ds, tok = _prepared(tmp_path, [{"messages": CHAT}] * 2, tok_dir, seq_len=64)
    ids, mask = _rows(ds)
    n = len(theirs(text, add_special_tokens=False)["input_ids"])
    if kind == "generation tags":
        out = theirs.apply_chat_template(
            CHAT, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert list(ids[0][:n]) == list(out["input_ids"])
        want = np.asarray(out["assistant_masks"], bool)
        want[0] = False  # the first token is never a target
        np.testing.assert_array_equal(mask[0][:n], want)
        assert "generation" in meta["assistant_tokens"]
    else:
        assert list(ids[0][:n]) == theirs.apply_chat_template(CHAT, tokenize=True)["input_ids"]
        assert "prefix by prefix" in meta["assistant_tokens"]
    spoken = theirs.decode(ids[0][mask[0]], skip_special_tokens=False)
    end = "<|end|>" if kind == "generation tags" else "<|end|>\n"
    assert spoken == "".join(m["content"] + end for m in CHAT if m["role"] == "assistant")
    assert not mask[0][n:].any()


def test_examples_longer_than_a_row_are_cut_and_those_left_without_a_completion_dropped(
    tmp_path, capsys
):
    from jaxmem import cli

    tok_dir = chat_tokenizer(tmp_path / "tok", None)
    long_prompt = "hello there, how are you? " * 8
    records = [
        {"prompt": "the capital of france is", "completion": " paris. " * 8},  # cut
        {"prompt": long_prompt, "completion": " four."},  # no completion token left: dropped
        *({"prompt": p, "completion": c} for p, c in PAIRS),
    ]
    src = write_records(tmp_path / "data.jsonl", records)
    out = tmp_path / "out"
    args = ["prepare", src, "--tokenizer", tok_dir, "--out", str(out), "--seq-len", "16"]
    assert cli.main([*args, "--val-fraction", "0.3"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "(2 rows, " in printed and "(1 row, " in printed
    assert "4 examples as rows of 16 + 1 tokens of" in printed
    assert "2 cut to fit, 1 dropped (no completion token within the row)" in printed
    assert f"train with: jaxmem train --data {out} --init-from {tok_dir} --seq-len 16" in printed
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["examples"], meta["truncated"], meta["dropped"]) == (4, 2, 1)
    _, mask = _rows(instruct.load_instruction(out, meta["vocab_size"], _tok(tok_dir)))
    assert mask[0][-1] and not mask[0].all()  # the cut row counts to its end


def _tok(directory: str):
    from jaxmem.hf.tokenizer import HFTokenizer

    return HFTokenizer(directory)


GOOD = {"prompt": "a", "completion": "b"}
# case: (records, tokenizer: "none" | "template" | "no template" | "broken template", what the
# line says)
BAD = {
    "invalid-json": ([GOOD, GOOD, '{"prompt": "a", \n'], "template", "line 3: invalid JSON"),
    "missing-key": ([GOOD, {"prompt": "a"}], "template", "line 2: missing 'completion'"),
    "wrong-type": ([{"prompt": 1, "completion": "b"}], "template", "'prompt' must be a string"),
    "empty-completion": ([{"prompt": "a", "completion": ""}], "template", '"completion" is empty'),
    "not-an-object": ([GOOD, "[1, 2]\n"], "template", "line 2: a record is a JSON object"),
    "bad-message": (
        [{"messages": [{"role": "user"}]}], "template", 'message 0 must be an object with "role"'
    ),
    "no-assistant": (
        [{"messages": [{"role": "user", "content": "a"}]}], "template", 'no message has role'
    ),
    "no-template": (
        [GOOD, {"messages": CHAT}], "no template", "line 2: a messages record is rendered with a"
    ),
    "bytes-messages": ([{"messages": CHAT}], "none", "the byte tokenizer has none"),
    "broken-template": (
        [GOOD, {"messages": CHAT}], "broken template", "line 2: the chat template of"
    ),
    "one-example": ([GOOD], "template", "gives 1 example(s)"),
}  # fmt: skip
IN_A_SUBPROCESS = ("invalid-json", "no-template")


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_record_is_one_line_naming_the_file_and_line_exit_2_nothing_written(
    case, tmp_path, capsys
):
    from jaxmem import cli

    records, tokenizer, says = BAD[case]
    src = write_records(tmp_path / "bad.jsonl", records)
    args = ["prepare", src, "--out", str(tmp_path / "out" / "data")]
    if tokenizer != "none":
        template = {"template": TEMPLATES["generation tags"], "broken template": "{% for m %}"}
        template = template.get(tokenizer)
        args += ["--tokenizer", chat_tokenizer(tmp_path / "tok", template)]
    before = sorted(tmp_path.rglob("*"))
    if case in IN_A_SUBPROCESS:
        proc = run_cli(*args)
        code, err = proc.returncode, proc.stderr
    else:
        try:
            code = cli.main(args)
        except SystemExit as e:
            code = e.code
        err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("jaxmem prepare: error: ") and src in lines[0], lines[0]
    assert says in lines[0], lines[0]
    if case == "no-template":
        assert "tokenizer_config.json or a chat_template.jinja" in lines[0]
    assert sorted(tmp_path.rglob("*")) == before


# ------------------------------------------------------------------------------ the masked loss
@pytest.fixture(scope="module")
def byte_rows(tmp_path_factory) -> object:
    """Prepared prompt/completion records in bytes (tiny's vocabulary), rows of 16 + 1."""
    tmp = tmp_path_factory.mktemp("bytes")
    records = [{"prompt": f"{i} + {i} = ", "completion": f"{2 * i}"} for i in range(1, 40, 3)]
    src = write_records(tmp / "sums.jsonl", records)
    instruct.prepare_instruct(src, tmp / "data", tokenizer=None, seq_len=16, val_fraction=0.2)
    return tmp / "data"


@pytest.fixture(scope="module")
def f64_model() -> tuple:
    """One block of tiny in float64: ``(graphdef, params)``."""
    from jaxmem.model import make_model

    with jax.enable_x64(True):
        return nnx.split(make_model(ONE_BLOCK, FP64, seed=0), nnx.Param)


def _f64_batch(byte_rows) -> dict[str, np.ndarray]:
    ds = instruct.load_instruction(byte_rows)
    b = instruct.rows_batch(ds, "train", 0, 4, seed=3)
    assert len(set(b["mask"][:2].sum(1)) | set(b["mask"][2:].sum(1))) > 1  # unequal microbatches
    return b


@pytest.mark.slow
def test_the_masked_loss_is_the_mean_over_masked_in_tokens(byte_rows, f64_model):
    """jaxmem's loss (whole logits and in chunks) on a prepared batch equals the mean, computed
    here in numpy float64, of the per-token cross-entropy over the mask's tokens."""
    from jaxmem.step.train_step import lm_loss_fn

    b = _f64_batch(byte_rows)
    graphdef, params = f64_model
    with jax.enable_x64(True):
        logits = np.asarray(jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))(params, b["inputs"]))
        jb = {k: jnp.asarray(v) for k, v in b.items()}
        whole = float(jax.jit(lm_loss_fn(graphdef))(params, jb)[0])
        chunked = float(jax.jit(lm_loss_fn(graphdef, loss_chunks=2))(params, jb)[0])
    top = logits.max(-1, keepdims=True)
    lse = (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))[..., 0]
    nll = lse - np.take_along_axis(logits, b["targets"][..., None], -1)[..., 0]
    by_hand = (nll * b["mask"]).sum() / b["mask"].sum()
    tol = tolerance("float64", "loss")
    np.testing.assert_allclose(whole, by_hand, **tol.kwargs())
    np.testing.assert_allclose(chunked, by_hand, **tol.kwargs())
    assert abs(by_hand - nll.mean()) > 1e-3  # the mask matters


@pytest.mark.slow
def test_masked_accumulation_equals_one_batch_and_torch_ref_agrees(byte_rows, f64_model):
    """Two microbatches with different numbers of masked-in tokens sum and divide once: the
    loss and gradients equal the one-batch ones, and torch_ref's (float64, same weights)."""
    torch = pytest.importorskip("torch", reason="torch is the torch extra (make test installs it)")
    import torch_ref
    from jaxmem.compare.weights import to_torch_state_dict
    from jaxmem.step.train_step import lm_loss_fn, summed_grads
    from torch_ref.train import accumulate_grads

    b = _f64_batch(byte_rows)
    graphdef, params = f64_model
    with jax.enable_x64(True):
        jb = {k: jnp.asarray(v) for k, v in b.items()}
        got = {}
        for k in (1, 2):
            g, s, n = jax.jit(
                lambda p, b, k=k: summed_grads(
                    lm_loss_fn(graphdef), p, b, accum_steps=k, accum_dtype=jnp.float64
                )
            )(params, jb)
            grads = to_torch_state_dict(nnx.merge(graphdef, jax.tree.map(lambda x, n=n: x / n, g)))
            got[k] = (float(s / n), grads)
        state = to_torch_state_dict(nnx.merge(graphdef, params))
    loss_tol, grad_tol = tolerance("float64", "loss"), tolerance("float64", "grads")
    np.testing.assert_allclose(got[2][0], got[1][0], **loss_tol.kwargs())
    for key, g in got[1][1].items():
        np.testing.assert_allclose(got[2][1][key], g, **grad_tol.kwargs(), err_msg=key)
    ref = torch_ref.Decoder(ONE_BLOCK).double()
    ref.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in state.items()})
    tb = {k: torch.from_numpy(v).long() for k, v in b.items()}
    s, n = accumulate_grads(ref, tb, precision=FP64, accum_steps=2)
    np.testing.assert_allclose(got[1][0], float(s / n), **loss_tol.kwargs())
    for key, p in ref.named_parameters():
        np.testing.assert_allclose(got[1][1][key], p.grad.numpy(), **grad_tol.kwargs(), err_msg=key)


def test_text_batches_keep_their_program_and_instruction_batches_add_a_mask():
    from jaxmem.step.build import batch_shapes
    from jaxmem.step.spec import StepSpec

    spec = StepSpec(model=TINY, policy=dataclasses.replace(_policy()), batch=2, seq_len=16)
    assert set(batch_shapes(spec)) == {"inputs", "targets"}
    masked = spec.replace(loss_mask=True)
    assert set(batch_shapes(masked)) == {"inputs", "targets", "mask"}
    assert StepSpec.from_dict(masked.to_dict()) == masked
    old = {k: v for k, v in spec.to_dict().items() if k != "loss_mask"}
    assert StepSpec.from_dict(old) == spec  # a spec written before the field reads as text


def _policy():
    from jaxmem.policy import POLICIES

    return POLICIES["none"]


# ------------------------------------------------------------------------------ the real command
@pytest.mark.slow
def test_train_on_prepared_instruction_data_logs_the_same_losses_in_both_frameworks(
    byte_rows, tmp_path
):
    """``jaxmem train --data DATA`` (3 steps, tiny) in JAX and PyTorch: equal losses within the
    table; a text-only reader still refuses the JSON Lines file, pointing at prepare; a seq-len
    other than the data's is one line."""
    pytest.importorskip("torch", reason="torch is the torch extra (make test installs it)")
    base = ["train", "--preset", "tiny", "--steps", "3", "--batch-size", "4", "--set"]
    base += ["run.eval_batches=1", "--sample-tokens", "0", "--data", str(byte_rows)]
    losses = {}
    for framework in ("jax", "torch"):
        out = tmp_path / framework
        proc = run_cli(*base, "--seq-len", "16", "--framework", framework, "--out", str(out))
        assert proc.returncode == 0, proc.stderr[-2000:]
        records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        losses[framework] = [r["loss"] for r in records] + [records[-1]["val_loss"]]
    assert len(losses["jax"]) == 4
    tol = tolerance("float32", "adamw_loss")
    np.testing.assert_allclose(losses["jax"], losses["torch"], **tol.kwargs())


def test_instruction_data_at_another_seq_len_is_refused_in_one_line(byte_rows, tmp_path, capsys):
    from jaxmem import cli

    args = ["train", "--preset", "tiny", "--steps", "1", "--data", str(byte_rows)]
    try:
        code = cli.main([*args, "--seq-len", "32", "--out", str(tmp_path / "run")])
    except SystemExit as e:
        code = e.code
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1
    assert "prepared in rows of --seq-len 16, not 32: train with --seq-len 16" in lines[0]
    assert not (tmp_path / "run").exists()


def test_reading_records_refuses_what_is_not_utf8(tmp_path):
    (tmp_path / "x.jsonl").write_bytes(b'{"prompt": "\xff"}\n')
    with pytest.raises(DataError, match=r"x.jsonl is not UTF-8 \(byte 12\)"):
        instruct.read_records(tmp_path / "x.jsonl")
