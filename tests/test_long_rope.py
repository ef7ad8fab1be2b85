"""RoPE's tables at long sequences: built in the step from small factor tables (a constant
``[S, K]`` pair at a million positions is gigabytes of program), equal to the float64 angles."""

from __future__ import annotations

import jax
import numpy as np

from jaxmem.compare.tolerances import tolerance
from jaxmem.config import PRESETS
from jaxmem.model import sequence
from jaxmem.positions import rope_angles


def test_built_rope_tables_are_the_float64_angles_at_every_position():
    cfg = PRESETS["llama-3.1-8b"]  # llama3 scaling; head_dim 128
    seq = 5 * sequence.ROPE_STEP + 17  # several coarse rows and a partial last one
    cos, sin = rope_angles(cfg, seq)
    with jax.enable_x64(True):
        built = sequence.built_rope_tables(cfg, seq, np.float64)
    tol = tolerance("float64", "rope_tables")
    for want, got in zip((cos, sin), built, strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=tol.rtol, atol=tol.atol)
    got32 = sequence.built_rope_tables(cfg, seq, np.float32)
    tol = tolerance("float32", "rope_tables")
    for want, got in zip((cos, sin), got32, strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=tol.rtol, atol=tol.atol)


def _constant_tables(seq: int) -> list[str]:
    cfg = PRESETS["tiny-llama"]
    text = jax.jit(lambda: sequence.rope_tables(cfg, seq, np.float32)).lower().as_text()
    return [line for line in text.splitlines() if "constant" in line and f"<{seq}x" in line]


def test_a_long_step_embeds_no_position_table_as_a_constant():
    assert _constant_tables(sequence.ROPE_CONSTANT_POSITIONS)  # up to the limit: exact constants
    assert not _constant_tables(sequence.ROPE_CONSTANT_POSITIONS + sequence.ROPE_STEP)
