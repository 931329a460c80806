#!/usr/bin/env python3
"""Writes the seed corpus of the fuzz target (tests/fuzz/corpus/), one file
per case, in the input layout described at the top of fuzz_validation.cpp.
The finding_* seeds are calls that once got past validation or overflowed;
the valid_* seeds start the fuzzer from calls that succeed."""
import pathlib
import struct

FWD, WORKSPACE_SIZES, PLAN_CREATE = 0, 1, 2
VARLEN, BF16_STATE, KV_LAYOUT, INITIAL, FINAL, IN_PLACE, I32_OFFSETS, PADDED = (1 << i for i in range(8))
LENIENT_EMPTY, LENIENT_UNIT_AXES = 1, 2
SLOTS = ["q", "k", "v", "g", "beta", "A_log", "dt_bias", "out", "initial_state", "final_state", "cu_seqlens"]
SCALARS = len(SLOTS)
DATA_PLUS, DATA_AT, DTYPE, RANK, SHAPE0, STRIDE0, ABSENT = 0, 1, 2, 3, 4, 10, 16
WORKSPACE_PLUS, WORKSPACE_BYTES, SCALE, STRUCT_SIZE, OFFSET_VALUE = range(5)


def raw(value):
    """A value given in full: eight bytes, little-endian."""
    return bytes([1]) + struct.pack("<q", value)


def plus(delta):
    """The current value plus a signed byte."""
    return bytes([2]) + struct.pack("<b", delta)


# The ranges of fuzz_validation.cpp's valid calls (kMax*).
MAX_HEADS, MAX_BATCH, MAX_SEQS, MAX_TOKENS, MAX_SIZING_HEADS = 2, 2, 3, 17, 4


def batched(heads, flags, lenient, B, T):
    assert 1 <= heads <= MAX_HEADS and B <= MAX_BATCH and T <= MAX_TOKENS
    return bytes([FWD, heads - 1, flags, lenient, B, T])


def varlen(heads, flags, lenient, lengths):
    assert 1 <= heads <= MAX_HEADS and 1 <= len(lengths) <= MAX_SEQS and max(lengths) <= MAX_TOKENS
    return bytes([FWD, heads - 1, flags | VARLEN, lenient, len(lengths) - 1, *lengths])


def sizes(heads, total_tokens, num_seqs, gpu_heads):
    assert 1 <= heads <= MAX_SIZING_HEADS
    return bytes([WORKSPACE_SIZES, heads - 1]) + raw(total_tokens) + raw(num_seqs) + struct.pack("<i", gpu_heads)


def fault(slot, field, value):
    return bytes([SLOTS.index(slot), field]) + value


SEEDS = {
    "valid_batched_states": batched(2, INITIAL | FINAL, 0, 2, 17),
    "valid_varlen_everything": varlen(2, 0xFF & ~VARLEN, LENIENT_UNIT_AXES, [0, 17, 7]),
    "valid_varlen_i64_offsets": varlen(1, FINAL, 0, [5, 0, 3]),
    # A stride of 2^62 on an axis longer than 1 was accepted; the offsets
    # wrapped and the CPU backend read (q, k, v, g, beta) or wrote (out) out
    # of bounds. For cu_seqlens only the wrapped offset kept it out.
    "finding_q_token_stride_2p62": batched(1, 0, 0, 1, 2) + fault("q", STRIDE0 + 1, raw(1 << 62)),
    "finding_beta_token_stride_2p62": batched(1, 0, 0, 1, 2) + fault("beta", STRIDE0 + 1, raw(1 << 62)),
    "finding_out_token_stride_2p62": batched(1, 0, 0, 1, 2) + fault("out", STRIDE0 + 1, raw(1 << 62)),
    "finding_cu_seqlens_stride_2p62": varlen(1, 0, 0, [1, 2]) + fault("cu_seqlens", STRIDE0, raw(1 << 62)),
    # Workspace sizing overflowed for huge sequence counts, also from
    # fkda_fwd through cu_seqlens' length.
    "finding_workspace_size_h3_2p62_seqs": sizes(3, 0, 1 << 62, gpu_heads=3),
    "finding_gpu_workspace_size_huge": sizes(1, (1 << 63) - 1, 1 << 61, gpu_heads=2**31 - 1),
    "finding_cu_seqlens_2p63_offsets": varlen(1, 0, 0, [3, 4]) + fault("cu_seqlens", SHAPE0, raw((1 << 63) - 1)),
    # Data one byte off was accepted and read or written misaligned.
    "finding_q_misaligned": batched(1, 0, 0, 1, 3) + fault("q", DATA_PLUS, plus(1)),
    "finding_out_misaligned": batched(1, 0, 0, 1, 3) + fault("out", DATA_PLUS, plus(1)),
    "finding_final_state_misaligned": batched(1, FINAL, 0, 1, 3) + fault("final_state", DATA_PLUS, plus(1)),
    "finding_cu_seqlens_misaligned": varlen(1, 0, 0, [2, 1]) + fault("cu_seqlens", DATA_PLUS, plus(2)),
    # Empty tensors with a broadcast axis, a last stride 0 or negative
    # strides (numpy makes the first two) were rejected; they hold nothing.
    "finding_empty_tensors_any_strides": batched(2, INITIAL | FINAL, LENIENT_EMPTY, 2, 0),
    "finding_empty_varlen_any_strides": varlen(2, INITIAL | FINAL | IN_PLACE, LENIENT_EMPTY | LENIENT_UNIT_AXES,
                                               [0, 0, 0]),
    "valid_plan_desc": bytes([PLAN_CREATE]) + plus(0) * 9 + struct.pack("<f", -2.5),
}

if __name__ == "__main__":
    corpus = pathlib.Path(__file__).resolve().parent / "corpus"
    corpus.mkdir(exist_ok=True)
    for name, data in SEEDS.items():
        (corpus / name).write_bytes(data)
