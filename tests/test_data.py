"""Data sources, .bin preparation/validation, deterministic batches and the prefetcher."""

from __future__ import annotations

import json
import os
import threading
import time

import jax
import numpy as np
import pytest

from jaxmem import data, text_sources
from jaxmem.data import DataError
from tests.test_cli_contract import run_cli

# --- text sources -------------------------------------------------------------------------------


def test_text_file_loads_raw_bytes(tmp_path):
    f = tmp_path / "a.txt"
    f.write_bytes("hé\n".encode() + b"\xff")  # invalid UTF-8 is fine: bytes are used as-is
    tokens = text_sources.load_text_tokens(f)
    assert tokens.dtype == np.uint16
    assert tokens.tolist() == list("hé\n".encode() + b"\xff")


def test_directory_loads_sorted_with_eos_and_skips_hidden_empty_and_binary(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_bytes(b"BZ")
    (tmp_path / "a.txt").write_bytes(b"A")
    (tmp_path / "c.txt").write_bytes(b"C")
    (tmp_path / ".hidden.txt").write_bytes(b"H")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "x.txt").write_bytes(b"G")
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "blob.dat").write_bytes(b"X\0Y")
    tokens = text_sources.load_text_tokens(tmp_path)
    E = data.EOS
    assert tokens.tolist() == [ord("A"), E, ord("B"), ord("Z"), E, ord("C")]


def test_text_errors(tmp_path):
    with pytest.raises(DataError, match=r"data path .*nope does not exist"):
        text_sources.load_text_tokens(tmp_path / "nope")
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(DataError, match=r"empty\.txt contains no text"):
        text_sources.load_text_tokens(tmp_path / "empty.txt")
    (tmp_path / "bin.dat").write_bytes(b"a\0b")
    with pytest.raises(DataError, match=r"bin\.dat contains NUL bytes"):
        text_sources.load_text_tokens(tmp_path / "bin.dat")
    d = tmp_path / "d"
    d.mkdir()
    (d / ".hidden").write_bytes(b"text")
    (d / "x.pyc").write_bytes(b"\0\1")
    with pytest.raises(DataError, match=r"contains no text \(1 binary file\(s\) skipped\)"):
        text_sources.load_text_tokens(d)


# --- .bin files ---------------------------------------------------------------------------------


def test_prepare_bin_round_trips_and_refuses_overwrite(tmp_path):
    src = tmp_path / "corpus.txt"
    text = b"hello world, " * 40
    src.write_bytes(text)
    out = tmp_path / "prepared"
    meta = data.prepare_bin(src, out, val_fraction=0.1)

    expected = np.frombuffer(text, dtype=np.uint8).astype(np.uint16)
    train_ref, val_ref = data.train_val_split(expected, 0.1)
    train, val = data.load_bin(out / "train.bin"), data.load_bin(out / "val.bin")
    assert isinstance(train, np.memmap) and train.dtype == np.uint16
    np.testing.assert_array_equal(train, train_ref)
    np.testing.assert_array_equal(val, val_ref)
    assert (out / "train.bin").stat().st_size == 2 * train_ref.size  # raw uint16, no header

    assert meta == json.loads((out / "meta.json").read_text())
    assert meta == {
        "format": "jaxmem-bytes-v1",
        "dtype": "uint16",
        "vocab_size": 259,
        "tokenizer": "bytes",
        "train_tokens": int(train_ref.size),
        "val_tokens": int(val_ref.size),
        "source": f"text file {src.resolve()}",
    }
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]

    with pytest.raises(
        DataError, match=r"already contains train\.bin and val\.bin; choose another"
    ):
        data.prepare_bin(src, out)
    np.testing.assert_array_equal(data.load_bin(out / "train.bin"), train_ref)  # untouched


def test_prepare_bin_failure_leaves_nothing(tmp_path, monkeypatch):
    out = tmp_path / "out" / "nested"
    with pytest.raises(DataError, match="does not exist"):
        data.prepare_bin(tmp_path / "missing.txt", out)
    assert not out.exists()

    src = tmp_path / "c.txt"
    src.write_bytes(b"some text to split")
    real_replace, calls = data.os.replace, []

    def flaky_replace(a, b):  # the second rename (val.bin) fails, e.g. disk full
        calls.append(b)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real_replace(a, b)

    monkeypatch.setattr(data.os, "replace", flaky_replace)
    with pytest.raises(DataError, match=r"cannot write .*nested: No space left on device"):
        data.prepare_bin(src, out)
    # no temp files, the renamed meta.json removed, and the directories made for them too
    assert list(tmp_path.iterdir()) == [src]


def test_load_dataset_default_is_the_stdlib_corpus():
    ds = data.load_dataset(None)
    assert ds.source == "Python stdlib sources (embedded default)"
    assert ds.train.size > 0 and ds.val.size > 0


def test_load_bin_errors(tmp_path):
    with pytest.raises(DataError, match=r"token file .*none\.bin does not exist"):
        data.load_bin(tmp_path / "none.bin")

    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(DataError, match=r"empty\.bin is empty"):
        data.load_bin(tmp_path / "empty.bin")

    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(DataError, match=r"odd\.bin is 3 bytes, not a multiple of 2.*uint16"):
        data.load_bin(tmp_path / "odd.bin")

    (tmp_path / "big.bin").write_bytes(np.array([1, 50256, 3], dtype="<u2").tobytes())
    with pytest.raises(
        DataError, match=r"token id 50256 but the model's vocab_size is 259; was it prepared"
    ):
        data.load_bin(tmp_path / "big.bin")
    assert data.load_bin(tmp_path / "big.bin", vocab_size=50257).tolist() == [1, 50256, 3]


def test_load_bin_checks_meta(tmp_path):
    np.arange(10, dtype="<u2").tofile(tmp_path / "train.bin")
    meta = {"dtype": "int8", "train_tokens": 10}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=r"says dtype 'int8'; \.bin files hold uint16 or uint32"):
        data.load_bin(tmp_path / "train.bin")
    # uint32 (a vocabulary above 65,536 ids): the same 20 bytes are 5 tokens, not 10
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint32", "train_tokens": 10}))
    with pytest.raises(DataError, match=r"train_tokens=10 but .*train\.bin holds 5 tokens"):
        data.load_bin(tmp_path / "train.bin")

    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint16", "train_tokens": 12}))
    with pytest.raises(DataError, match=r"train_tokens=12 but .*train\.bin holds 10 tokens"):
        data.load_bin(tmp_path / "train.bin")

    (tmp_path / "meta.json").write_text("{not json")
    with pytest.raises(DataError, match=r"meta\.json is not readable JSON"):
        data.load_bin(tmp_path / "train.bin")


# --- dataset selection --------------------------------------------------------------------------


def test_load_dataset_picks_the_format(tmp_path):
    txt = tmp_path / "t.txt"
    txt.write_bytes(b"0123456789" * 10)
    ds = data.load_dataset(txt, val_fraction=0.1)
    assert ds.source == f"text file {txt}" and ds.train.size == 90 and ds.val.size == 10

    out = tmp_path / "prep"
    data.prepare_bin(txt, out, val_fraction=0.2)
    ds = data.load_dataset(out)
    assert ds.source == f"nanoGPT .bin in {out}"
    assert isinstance(ds.train, np.memmap) and ds.train.size == 80 and ds.val.size == 20

    ds = data.load_dataset(out / "train.bin")
    assert ds.val.size == 20  # val.bin beside it is used

    lone = tmp_path / "lone"
    lone.mkdir()
    np.arange(100, dtype="<u2").tofile(lone / "tokens.bin")
    ds = data.load_dataset(lone / "tokens.bin", val_fraction=0.1)
    assert ds.train.tolist() == list(range(90)) and ds.val.tolist() == list(range(90, 100))

    with pytest.raises(DataError, match=r"data path .*missing does not exist"):
        data.load_dataset(tmp_path / "missing")
    with pytest.raises(DataError, match=r"token id 99 but the model's vocab_size is 50"):
        data.load_dataset(lone / "tokens.bin", vocab_size=50)


# --- deterministic batches ----------------------------------------------------------------------


def test_batch_at_is_a_pure_function_of_seed_and_step():
    tokens = np.arange(1000, dtype=np.uint16)
    x1, y1 = data.batch_at(tokens, step=5, batch=4, seq_len=16, seed=0)
    x2, y2 = data.batch_at(tokens, step=5, batch=4, seq_len=16, seed=0)
    x3, _ = data.batch_at(tokens, step=6, batch=4, seq_len=16, seed=0)
    x4, _ = data.batch_at(tokens, step=5, batch=4, seq_len=16, seed=1)
    assert x1.shape == y1.shape == (4, 16) and x1.dtype == y1.dtype == np.int32
    np.testing.assert_array_equal(x1, x2)
    np.testing.assert_array_equal(y1, y2)
    assert not np.array_equal(x1, x3) and not np.array_equal(x1, x4)
    np.testing.assert_array_equal(y1[:, :-1], x1[:, 1:])  # targets are inputs shifted by one
    np.testing.assert_array_equal(y1, x1 + 1)  # (consecutive ids in this data)


def test_batch_at_needs_enough_tokens():
    with pytest.raises(DataError, match=r"seq_len=8 needs at least 10 tokens; the val split has 9"):
        data.batch_at(np.arange(9, dtype=np.uint16), 0, 2, 8, 0, what="val")
    x, _ = data.batch_at(np.arange(10, dtype=np.uint16), 0, 2, 8, 0)  # exactly enough is fine
    assert x.shape == (2, 8)


# --- prefetcher ---------------------------------------------------------------------------------


def _make(step: int) -> dict[str, np.ndarray]:
    x, y = data.batch_at(np.arange(500, dtype=np.uint16), step, 2, 8, seed=3)
    return {"inputs": x, "targets": y}


def test_prefetcher_yields_the_same_batches_in_order():
    with data.Prefetcher(_make, 3, 9, transfer=jax.device_put, depth=2) as pf:
        got = list(pf)
    assert [step for step, _ in got] == list(range(3, 9))
    for step, batch in got:
        assert isinstance(batch["inputs"], jax.Array)
        for k, v in _make(step).items():
            np.testing.assert_array_equal(np.asarray(batch[k]), v)


def test_prefetcher_reraises_worker_errors():
    def make(step: int) -> dict[str, np.ndarray]:
        if step == 2:
            raise DataError("bad batch at step 2")
        return _make(step)

    with data.Prefetcher(make, 0, 5, transfer=jax.device_put) as pf:
        it = iter(pf)
        assert next(it)[0] == 0 and next(it)[0] == 1
        with pytest.raises(DataError, match="bad batch at step 2"):
            next(it)
        with pytest.raises(StopIteration):
            next(it)


def test_prefetcher_close_after_early_stop_is_prompt():
    before = set(threading.enumerate())
    pf = data.Prefetcher(_make, 0, 1_000_000, transfer=jax.device_put, depth=2)
    for step, _ in pf:
        if step == 1:
            break
    time.sleep(0.2)  # let the worker fill the queue and block on put
    t0 = time.perf_counter()
    pf.close()
    assert time.perf_counter() - t0 < 1.0
    assert not any(t.is_alive() for t in set(threading.enumerate()) - before)
    with pytest.raises(StopIteration):
        next(pf)


# --- what prepare and train refuse, on the real commands ------------------------------------------

INSTRUCTIONS = '{"prompt": "2 + 2 =", "completion": " 4"}\n\n{"prompt": "hi", "completion": "!"}\n'


def _short(tmp_path):
    (tmp_path / "short.txt").write_text("hello world")  # 11 bytes: 10 train, 1 validation
    return [str(tmp_path / "short.txt")]


def _json_lines(name):
    def write(tmp_path):
        (tmp_path / "corpus").mkdir()
        (tmp_path / "corpus" / "notes.txt").write_text("plain text\n" * 400)
        (tmp_path / name).write_text(INSTRUCTIONS * 200)
        return [str(tmp_path / name)]

    return write


def _corpus(tmp_path):
    (tmp_path / "corpus.txt").write_text("x = 1\n" * 1000)
    return [str(tmp_path / "corpus.txt")]


def _out_under(where):
    return lambda tmp_path: [*_corpus(tmp_path), "--out", where.format(tmp=tmp_path)]


def _only_json_in_a_directory(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "chat.jsonl").write_text(INSTRUCTIONS * 200)
    (tmp_path / "corpus" / "info.txt").write_text('{"a": 1}\n')
    return [str(tmp_path / "corpus")]


SHORT = "has 11 tokens (10 train, 1 validation); each split needs at least"
JSONL = "chat.jsonl is JSON Lines (named .jsonl): --data and a text directory read plain text"
PREPARE_FIRST = "prepare instruction records first: jaxmem prepare"
BY_CONTENT = "chat.txt is JSON Lines (its first lines are JSON objects)"
TRAIN = ["--preset", "tiny", "--steps", "1", "--batch-size", "2", "--seq-len", "32", "--data"]
# case: (command, what makes its arguments in tmp_path, what its one line says)
REFUSED = {
    "prepare-short": (
        "prepare", _short, (SHORT, "130 tokens for --seq-len 128", "2,600 tokens in all")
    ),
    "prepare-short-seq-len": (
        "prepare", lambda t: [*_short(t), "--seq-len", "9"], ("at least 11 tokens",)
    ),
    "train-short": ("train", _short, (SHORT, "34 tokens for --seq-len 32")),
    "prepare-only-json-in-a-directory": (
        "prepare", _only_json_in_a_directory, ("contains no text (2 JSON file(s) skipped (chat",)
    ),
    "train-jsonl": ("train", _json_lines("chat.jsonl"), (JSONL, PREPARE_FIRST)),
    "train-ndjson": ("train", _json_lines("chat.NDJSON"), ("is JSON Lines (named .NDJSON)",)),
    "train-by-content": ("train", _json_lines("chat.txt"), (BY_CONTENT, PREPARE_FIRST)),
    "prepare-read-only": (
        "prepare",
        _out_under("/proc/jaxmem-ro/data"),
        ("--out /proc/jaxmem-ro/data: /proc is not writable; choose another --out",),
    ),
    "prepare-under-a-file": (
        "prepare", _out_under("{tmp}/corpus.txt/data"), ("corpus.txt is a file, not a directory",)
    ),
}  # fmt: skip


# one case of each kind runs as a subprocess (the real command), its variants in this process
IN_A_SUBPROCESS = (
    "prepare-short",
    "prepare-in-a-directory",
    "train-by-content",
    "prepare-read-only",
)


def _jaxmem(in_a_subprocess: bool, capsys, *args: str) -> tuple[int, str, str]:
    """``jaxmem ARGS``: exit code, stdout, stderr."""
    if in_a_subprocess:
        proc = run_cli(*args)
        return proc.returncode, proc.stdout, proc.stderr
    from jaxmem import cli

    try:
        code = cli.main(list(args))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_prepare_and_train_refuse_in_one_line_and_write_nothing(case, tmp_path, capsys):
    """Data too short for a batch at the seq-len, JSON Lines (by name or by its first lines)
    and an --out that cannot be made: exit 2, one line naming the sizes or the file, and
    nothing written (refused before any tokenizing, training or compile)."""
    command, make, says = REFUSED[case]
    args = make(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    if "--out" not in args:
        args += ["--out", str(tmp_path / "out" / "data")]
    if command == "train":
        args = [*TRAIN, *args]
    code, _, err = _jaxmem(case in IN_A_SUBPROCESS, capsys, command, *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"jaxmem {command}: error: ")
    for text in says:
        assert text in lines[0], lines[0]
    assert sorted(tmp_path.rglob("*")) == before  # not a file, not a directory


def test_prepare_makes_the_parents_of_out_and_names_the_seq_len_to_train_with(tmp_path, capsys):
    out = tmp_path / "a" / "b"
    code, printed, err = _jaxmem(
        False, capsys, "prepare", *_corpus(tmp_path), "--out", str(out), "--seq-len", "64"
    )
    assert code == 0, err
    assert sorted(os.listdir(out)) == ["meta.json", "train.bin", "val.bin"]
    assert f"train with: jaxmem train --data {out} --seq-len 64" in printed


def test_json_lines_are_told_from_text_by_their_first_lines():
    assert text_sources._looks_like_json_lines(b'\n{"text": "a"}\n  \n{"text": "b"}\n')
    assert not text_sources._looks_like_json_lines(b'{"a": 1}')  # one record is not yet records
    assert text_sources._is_json_records(b'{"a": 1}') and text_sources._is_json_records(
        b'{\n"a": [1]\n}\n'
    )
    assert not text_sources._is_json_records(b"{ is how C begins a block\n")
    for text in (b"plain text\n", b'{"a": 1}\nthen prose\n', b"[1, 2]\n", b"{not json}\n", b""):
        assert not text_sources._looks_like_json_lines(text), text
    assert not text_sources._looks_like_json_lines(b"{\n" + b'"key": 1\n}\n')  # one JSON document


def test_a_directory_trains_on_its_text_and_says_which_json_files_it_skipped(tmp_path, capsys):
    """A stray metadata.jsonl, a one-line JSON object and a binary file beside the text: the
    text is read (the same tokens as without them), and both ``train``'s data source and
    ``prepare``'s output name what was skipped; a JSON Lines file named directly is refused."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("plain text\n" * 400)
    (corpus / "metadata.jsonl").write_text(INSTRUCTIONS)
    (corpus / "z.txt").write_text('{"a": 1}')
    (corpus / "blob.dat").write_bytes(b"X\0Y")
    dataset = data.load_dataset(corpus)
    tokens = np.concatenate([dataset.train, dataset.val])
    assert tokens.tolist() == text_sources.load_text_tokens(corpus / "a.txt").tolist()
    skipped = "1 binary file(s) skipped; 2 JSON file(s) skipped (metadata.jsonl, z.txt)"
    assert dataset.source == f"text directory {corpus} ({skipped})"
    code, printed, err = _jaxmem(
        False, capsys, "prepare", str(corpus), "--out", str(tmp_path / "d")
    )
    assert code == 0 and skipped in " ".join(printed.split()), err
    with pytest.raises(DataError, match="metadata.jsonl is JSON Lines"):
        text_sources.load_text_tokens(corpus / "metadata.jsonl")
