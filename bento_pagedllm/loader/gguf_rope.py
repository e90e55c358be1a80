"""Recover Llama-3 rope scaling parameters from a GGUF file.

llama.cpp does not write Llama-3.1's `rope_scaling` dict into GGUF metadata. Its converter instead bakes the
scaling into a `rope_freqs.weight` tensor of per-frequency divisors (1 for high frequencies, `factor` for low
ones, a smooth blend in between), and the engine's rotary embedding needs the four `RopeScaling` numbers.
This module turns such a tensor back into those numbers, or reads them from metadata when a writer did put
them there.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..config import RopeScaling

logger = logging.getLogger(__name__)

# NOTE: relative tolerance for "the recovered parameters reproduce the tensor"; the tensor is float32.
_RTOL = 1e-4


def llama3_rope_factors(
    head_dim: int, rope_theta: float, scaling: RopeScaling
) -> np.ndarray:
    """The `rope_freqs` tensor llama.cpp's `convert_hf_to_gguf.py` writes for a `rope_type: llama3` model.

    Each entry divides one rotary frequency; this mirrors transformers' `_compute_llama3_parameters`.
    """
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    orig = scaling.original_max_position_embeddings
    low_wavelen = orig / scaling.low_freq_factor
    high_wavelen = orig / scaling.high_freq_factor
    smooth = (orig / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    medium = 1.0 / ((1 - smooth) / scaling.factor + smooth)
    factors = np.where(wavelen < high_wavelen, 1.0, np.where(wavelen > low_wavelen, scaling.factor, medium))
    return factors.astype(np.float32)


def llama3_scaling_from_rope_freqs(
    rope_freqs: np.ndarray, head_dim: int, rope_theta: float
) -> RopeScaling | None:
    """Fit `RopeScaling` to a `rope_freqs` tensor; None when the tensor means "no scaling" or cannot be fit.

    In the blended band, `smooth = (orig / wavelen - low) / (high - low)` is linear in `1 / wavelen`, so two
    or more blended frequencies give its slope and intercept by least squares.

    NOTE: the three parameters are only determined up to a common scale (multiplying `orig`, `low` and
    `high` by k gives the same tensor), so `low_freq_factor` is pinned to 1, as in every Meta Llama-3.x
    release. The fit is rounded and then checked by rebuilding the tensor; a mismatch logs a warning and
    returns None rather than guessing.
    """
    freqs = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
    if freqs.shape[0] != head_dim // 2:
        logger.warning("rope_freqs has %d entries, not head_dim/2 = %d; ignored", freqs.size, head_dim // 2)
        return None
    factor = float(freqs.max())
    if math.isclose(factor, 1.0, rel_tol=_RTOL) and np.allclose(freqs, 1.0, rtol=_RTOL):
        return None
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    x = inv_freq / (2 * math.pi)  # 1 / wavelen
    blended = (freqs > 1.0 + _RTOL) & (freqs < factor * (1 - _RTOL))
    if blended.sum() < 2:
        logger.warning("rope_freqs has under two blended frequencies; cannot recover llama3 rope scaling")
        return None
    smooth = (factor / freqs[blended] - 1.0) / (factor - 1.0)
    slope, intercept = np.polyfit(x[blended], smooth, 1)
    if intercept >= 0:
        logger.warning("rope_freqs does not look like llama3 rope scaling; ignoring it")
        return None
    high = 1.0 - 1.0 / intercept
    orig = slope * (high - 1.0)
    scaling = RopeScaling(
        factor=_round_sig(factor),
        low_freq_factor=1.0,
        high_freq_factor=_round_sig(high),
        original_max_position_embeddings=int(round(orig)),
    )
    if not np.allclose(llama3_rope_factors(head_dim, rope_theta, scaling), freqs, rtol=1e-3):
        logger.warning("recovered rope scaling %s does not reproduce rope_freqs; ignoring it", scaling)
        return None
    return scaling


def llama3_scaling_from_metadata(get: Callable[[str], Any], arch: str) -> RopeScaling | None:
    """Rope scaling spelled out in metadata (`{arch}.rope.scaling.*`), as some non-llama.cpp writers do.

    `get(key)` returns a metadata value or None. Only `llama3` (and `none`) can be represented by the engine;
    anything else (linear, yarn, longrope) raises rather than silently running with the wrong positions.
    """
    rope_type = get(f"{arch}.rope.scaling.type")
    if rope_type in (None, "none", "default"):
        return None
    if rope_type != "llama3":
        raise ValueError(f"unsupported GGUF rope scaling type {rope_type!r} (only llama3 is supported)")
    needed: Sequence[str] = ("factor", "low_freq_factor", "high_freq_factor", "original_context_length")
    values = {name: get(f"{arch}.rope.scaling.{name}") for name in needed}
    missing = [name for name, value in values.items() if value is None]
    if missing:
        raise ValueError(f"GGUF llama3 rope scaling lacks {missing}")
    return RopeScaling(
        factor=float(values["factor"]),
        low_freq_factor=float(values["low_freq_factor"]),
        high_freq_factor=float(values["high_freq_factor"]),
        original_max_position_embeddings=int(values["original_context_length"]),
    )


def _round_sig(value: float, digits: int = 6) -> float:
    """Round a float32-derived value to `digits` significant digits (4.0000005 -> 4.0)."""
    return float(f"{value:.{digits}g}")
