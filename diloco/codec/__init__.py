"""The wire format: int4 block quantization, sparse 2-bit blocks (``sparse``) or raw fp32,
a CRC-32C per tensor, and zstd framing into chunks. Pure: no grpc, no protos (diloco/convert.py maps specs to
``TensorHeader``).

A learner and a shard must dequantize the same bytes to bit-identical float32 values;
see ``int4`` for how the fast C kernel and the torch reference are kept identical.
"""

from diloco.codec.framing import (
    DEFAULT_LEVEL,
    DEFAULT_MAX_CHUNK_BYTES,
    Unframer,
    chunk_payload_bytes,
    frame,
    unframe,
)
from diloco.codec.int4 import (
    SCALE_DTYPES,
    dequantize_int4,
    dequantize_int4_reference,
    dequantize_payload,
    int4_scales,
    int4_nbytes,
    kernel,
    quantize_int4,
    quantize_int4_reference,
)
from diloco.codec.tensor import (
    ENCODINGS,
    EncodedTensor,
    TensorSpec,
    accumulate,
    check_payload,
    checksum,
    decode,
    dot_and_sumsq,
    encode,
    encode_quantized,
    expected_byte_length,
    norm_of,
    sparse_tensor,
    validate_spec,
    values_digest,
)

__all__ = [
    "DEFAULT_LEVEL",
    "DEFAULT_MAX_CHUNK_BYTES",
    "ENCODINGS",
    "SCALE_DTYPES",
    "EncodedTensor",
    "TensorSpec",
    "Unframer",
    "accumulate",
    "check_payload",
    "checksum",
    "chunk_payload_bytes",
    "decode",
    "dot_and_sumsq",
    "dequantize_int4",
    "dequantize_int4_reference",
    "dequantize_payload",
    "int4_scales",
    "encode",
    "encode_quantized",
    "expected_byte_length",
    "frame",
    "int4_nbytes",
    "kernel",
    "norm_of",
    "sparse_tensor",
    "quantize_int4",
    "quantize_int4_reference",
    "unframe",
    "validate_spec",
    "values_digest",
]
