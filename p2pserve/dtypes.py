"""The one table of tensor dtypes, by the name they carry on the wire and in a ``ModelSpec``.

Pure data (no torch, no numpy): torch's dtype of a name is ``getattr(torch, name)``, which the
torch-side tables (``transport/frames.py``, ``model/shard.py``) derive from these names.
"""

from __future__ import annotations

#: Bytes per element of every dtype a tensor payload may have.
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4}

#: The dtypes a model's weights and hidden states may have (a subset of ``DTYPE_SIZES``).
MODEL_DTYPES = ("float32", "float16", "bfloat16")

#: The exponent bits of each float dtype, read as an unsigned integer of its width in bytes: a
#: value is inf or NaN exactly when they are all set.
EXPONENT_MASKS = {"float32": (4, 0x7F800000), "float16": (2, 0x7C00), "bfloat16": (2, 0x7F80)}
