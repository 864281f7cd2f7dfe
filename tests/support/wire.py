"""Hypothesis strategies for wire headers shared by the fuzz tests."""

from __future__ import annotations

import math

from hypothesis import strategies as st

from p2pserve.protocol import DTYPE_SIZES, TensorMeta
from tests.fuzz.mutate import INT_EXTREMES

dims = st.integers(-(2**65), 2**65) | st.sampled_from(INT_EXTREMES) | st.integers(0, 64)


@st.composite
def claimed_metas(draw):
    """A tensor header and a payload length that often agree with its claimed shape, so that the
    checks after the byte count (empty tensors, strides) are reached with absurd dimensions."""
    dtype = draw(st.sampled_from(sorted(DTYPE_SIZES)) | st.text(max_size=8))
    shape = draw(st.lists(dims, max_size=6))
    consistent = math.prod(shape) * DTYPE_SIZES.get(dtype, 1)
    nbytes = draw(st.just(consistent) | dims)
    return TensorMeta(dtype=dtype, shape=shape, nbytes=nbytes), draw(st.just(nbytes) | st.integers(0, 1 << 20))
