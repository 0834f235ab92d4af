"""kernels/quant_ref.py's unpacking against an independent oracle: the compressed-tensors
package's own compressor (the `dev` extra) compresses a float weight to pack-quantized
tensors, and its decompression equals ours; and the test packers' AWQ column order unpacked."""

from __future__ import annotations

import pytest
import torch

from kernels.quant_ref import AWQ_NIBBLE_OF_COLUMN, dequantize_packed, unpack_int32
from tests.quant_checkpoints import AWQ_ORDER_MAP, pack_columns


@pytest.mark.parametrize("bits,strategy,group_size", [(4, "group", 32), (4, "channel", None), (8, "group", 64)])
def test_pack_quantized_matches_the_compressed_tensors_compressor(bits, strategy, group_size):
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    w = torch.randn(24, 128, generator=torch.Generator().manual_seed(bits)) * 0.1
    groups = w.reshape(24, -1, group_size) if group_size else w.unsqueeze(1)
    scale = (groups.abs().amax(-1) / (2 ** (bits - 1) - 1)).to(torch.bfloat16)  # [out, groups]
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy=strategy, group_size=group_size)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    compressed = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
    theirs = PackedQuantizationCompressor.decompress(compressed, scheme)["weight"]
    ours = dequantize_packed(compressed["weight_packed"], compressed["weight_scale"], bits, group_size or -1)
    assert tuple(compressed["weight_shape"].tolist()) == (24, 128)
    # the same integers; their weight is ours (exact in float32) rounded to the scale's bf16
    integers = ct.compressors.pack_quantized.helpers.unpack_from_int32(compressed["weight_packed"], bits, (24, 128))
    assert torch.equal(unpack_int32(compressed["weight_packed"], bits, 1) - (1 << (bits - 1)), integers.long())
    assert torch.equal(ours.to(theirs.dtype), theirs)


def test_unpack_inverts_the_formats_packers():
    values = torch.randint(0, 16, (6, 32), generator=torch.Generator().manual_seed(0))
    awq = pack_columns(values, 4, AWQ_ORDER_MAP)
    assert torch.equal(unpack_int32(awq, 4, 1, AWQ_NIBBLE_OF_COLUMN), values)
    assert torch.equal(unpack_int32(pack_columns(values, 8), 8, 1), values)
