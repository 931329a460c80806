#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Writes the seed corpus of the fuzz target (tests/fuzz/corpus/), one file
per case, in the input layout described at the top of fuzz_validation.cpp.
The finding_* seeds are calls that once got past validation or overflowed;
the valid_* seeds start the fuzzer from calls that succeed."""
import pathlib
import struct

FWD, WORKSPACE_SIZES, PLAN_CREATE, DECODE = 0, 1, 2, 3
VARLEN, BF16_STATE, KV_LAYOUT, INITIAL, FINAL, IN_PLACE, I32_OFFSETS, PADDED = (1 << i for i in range(8))
POOL, HAS_INITIAL, CHECKPOINTS, CHECKPOINT_SLOTS, PADDING, SHARED_STATES = 1, 2, 4, 8, 16, 32
TABLE, ACCEPTED, DECODE_PADDING = 8, 16, 32
LENIENT_EMPTY, LENIENT_UNIT_AXES = 1, 2
# The layer byte, and the shape byte after a non-zero one (W - 2 in its low bits).
CONV, BIAS, CONV_STATES, F32_WEIGHTS, F32_STATES, CHANNEL_LAST, ONE_POOL, GATE = (1 << i for i in range(8))
FULL_STATE_WIDTH, F32_NORM_WEIGHT, NO_PLAN_FLAG = 4, 8, 16
# The tensor arguments in the order each call adds them; the scalars follow.
SHARED = ["q", "k", "v", "g", "beta", "A_log", "dt_bias", "out", "cu_seqlens"]
LAYER = ["layer." + name for name in ("conv_weight_q", "conv_weight_k", "conv_weight_v", "conv_bias_q", "conv_bias_k",
                                      "conv_bias_v", "conv_state_q", "conv_state_k", "conv_state_v", "out_gate",
                                      "out_norm_weight")]
FWD_SLOTS = SHARED + ["state_pool", "state_indices", "initial_state", "final_state", "has_initial_state",
                      "checkpoint_offsets", "checkpoints", "checkpoint_slots"] + LAYER
DECODE_SLOTS = SHARED + ["state_pool", "state_indices", "num_accepted_tokens"] + LAYER
DATA_PLUS, DATA_AT, DTYPE, RANK, SHAPE0, STRIDE0, ABSENT, ALIAS = 0, 1, 2, 3, 4, 10, 16, 17
WORKSPACE_PLUS, WORKSPACE_BYTES, SCALE, STRUCT_SIZE, OFFSET_VALUE, INDEX_VALUE, STRUCT_BYTES, NORM_EPS, RESERVED = range(9)
# fuzz_validation.cpp's kContentValues.
CONTENT_VALUES = [-1, 0, 1, 2, 7, 16, 17, 32, 999, -999]
# The ranges of fuzz_validation.cpp's valid calls (kMax*).
MAX_HEADS, MAX_BATCH, MAX_SEQS, MAX_TOKENS, MAX_DECODE_TOKENS, MAX_SIZING_HEADS = 2, 2, 3, 17, 16, 4


def raw(value):
    """A value given in full: eight bytes, little-endian."""
    return bytes([1]) + struct.pack("<q", value)


def plus(delta):
    """The current value plus a signed byte."""
    return bytes([2]) + struct.pack("<b", delta)


def sizes(heads, batch=None, tokens=None, lengths=None, max_tokens=MAX_TOKENS):
    assert 1 <= heads <= MAX_HEADS
    if lengths is None:
        assert batch <= MAX_BATCH and tokens <= max_tokens
        return bytes([heads - 1, batch, tokens])
    assert 1 <= len(lengths) <= MAX_SEQS and max(lengths) <= max_tokens
    return bytes([heads - 1, len(lengths) - 1, *lengths])


def layer_bytes(layer, width, shape):
    """The layer byte, and after a non-zero one the shape byte with W = `width`."""
    assert 2 <= width <= 4
    return bytes([layer]) + (bytes([shape | (width - 2)]) if layer else b"")


def fwd(heads, flags=0, serving=0, lenient=0, batch=None, tokens=None, lengths=None, layer=0, width=2, shape=0):
    varlen = VARLEN if lengths is not None else 0
    return (bytes([FWD, flags | varlen, serving, lenient]) + layer_bytes(layer, width, shape)
            + sizes(heads, batch, tokens, lengths))


def decode(heads, flags=0, lenient=0, batch=None, tokens=None, lengths=None, layer=0, width=2, shape=0):
    varlen = VARLEN if lengths is not None else 0
    return (bytes([DECODE, flags | varlen, lenient]) + layer_bytes(layer, width, shape)
            + sizes(heads, batch, tokens, lengths, MAX_DECODE_TOKENS))


def workspace_sizes(heads, total_tokens, num_seqs, gpu_heads):
    assert 1 <= heads <= MAX_SIZING_HEADS
    return bytes([WORKSPACE_SIZES, heads - 1]) + raw(total_tokens) + raw(num_seqs) + struct.pack("<i", gpu_heads)


def plan_create(gate_mode, beta_mode):
    """A valid CPU-or-GPU description with 2 heads, then -2.5 for fkda_set_lower_bound."""
    return (bytes([PLAN_CREATE]) + plus(0) + plus(2) + plus(0) * 8 + plus(gate_mode) + plus(beta_mode)
            + struct.pack("<f", -2.5))


def fault(slots, name, field, value):
    return bytes([slots.index(name), field]) + value


def fwd_fault(name, field, value):
    return fault(FWD_SLOTS, name, field, value)


def struct_bytes(slots, size, tail_offset=None, tail_value=0):
    """struct_size `size`; a non-zero byte `tail_offset` bytes past the fields."""
    tail = bytes([0]) if tail_offset is None else bytes([1, tail_offset, tail_value])
    return bytes([len(slots), STRUCT_BYTES]) + struct.pack("<H", size) + tail


def index_value(slots, tensor, element, value):
    """Element `element` of the call's `tensor`-th index tensor set to one of CONTENT_VALUES."""
    return bytes([len(slots), INDEX_VALUE, tensor]) + struct.pack("<H", element) + bytes([1, CONTENT_VALUES.index(value)])


def alias(slots, name, buffer, offset=None):
    """`name` pointed into the call's `buffer`-th buffer: at its start, or `offset` bytes in."""
    where = bytes([1]) if offset is None else bytes([0]) + struct.pack("<H", offset)
    return bytes([slots.index(name), ALIAS, buffer]) + where


SEEDS = {
    "valid_batched_states": fwd(2, INITIAL | FINAL, batch=2, tokens=17),
    "valid_varlen_everything": fwd(2, 0xFF & ~VARLEN, lenient=LENIENT_UNIT_AXES, lengths=[0, 17, 7]),
    "valid_varlen_i64_offsets": fwd(1, FINAL, lengths=[5, 0, 3]),
    "valid_pool_checkpoint_slots": fwd(2, I32_OFFSETS | PADDED, POOL | HAS_INITIAL | CHECKPOINTS | CHECKPOINT_SLOTS,
                                       lengths=[16, 3]),
    "valid_checkpoints_tensor": fwd(1, BF16_STATE | INITIAL, HAS_INITIAL | CHECKPOINTS, batch=2, tokens=17),
    "valid_decode_batched": decode(2, KV_LAYOUT, batch=2, tokens=1),
    "valid_decode_table_no_rows": decode(2, TABLE, batch=0, tokens=11),
    "valid_decode_table": decode(1, TABLE | ACCEPTED | I32_OFFSETS, lenient=LENIENT_UNIT_AXES, lengths=[3, 0, 4]),
    # A stride of 2^62 on an axis longer than 1 was accepted; the offsets
    # wrapped and the CPU backend read (q, k, v, g, beta) or wrote (out) out
    # of bounds. For cu_seqlens only the wrapped offset kept it out.
    "finding_q_token_stride_2p62": fwd(1, batch=1, tokens=2) + fwd_fault("q", STRIDE0 + 1, raw(1 << 62)),
    "finding_beta_token_stride_2p62": fwd(1, batch=1, tokens=2) + fwd_fault("beta", STRIDE0 + 1, raw(1 << 62)),
    "finding_out_token_stride_2p62": fwd(1, batch=1, tokens=2) + fwd_fault("out", STRIDE0 + 1, raw(1 << 62)),
    "finding_cu_seqlens_stride_2p62": fwd(1, lengths=[1, 2]) + fwd_fault("cu_seqlens", STRIDE0, raw(1 << 62)),
    "finding_decode_q_token_stride_2p62": decode(1, batch=1, tokens=2)
    + fault(DECODE_SLOTS, "q", STRIDE0 + 1, raw(1 << 62)),
    # Workspace sizing overflowed for huge sequence counts, also from
    # fkda_fwd through cu_seqlens' length.
    "finding_workspace_size_h3_2p62_seqs": workspace_sizes(3, 0, 1 << 62, gpu_heads=3),
    "finding_gpu_workspace_size_huge": workspace_sizes(1, (1 << 63) - 1, 1 << 61, gpu_heads=2**31 - 1),
    "finding_cu_seqlens_2p63_offsets": fwd(1, lengths=[3, 4]) + fwd_fault("cu_seqlens", SHAPE0, raw((1 << 63) - 1)),
    # Data one byte off was accepted and read or written misaligned.
    "finding_q_misaligned": fwd(1, batch=1, tokens=3) + fwd_fault("q", DATA_PLUS, plus(1)),
    "finding_out_misaligned": fwd(1, batch=1, tokens=3) + fwd_fault("out", DATA_PLUS, plus(1)),
    "finding_final_state_misaligned": fwd(1, FINAL, batch=1, tokens=3) + fwd_fault("final_state", DATA_PLUS, plus(1)),
    "finding_cu_seqlens_misaligned": fwd(1, lengths=[2, 1]) + fwd_fault("cu_seqlens", DATA_PLUS, plus(2)),
    "finding_state_pool_misaligned": decode(1, batch=1, tokens=1) + fault(DECODE_SLOTS, "state_pool", DATA_PLUS, plus(1)),
    # Empty tensors with a broadcast axis, a last stride 0 or negative
    # strides (numpy makes the first two) were rejected; they hold nothing.
    "finding_empty_tensors_any_strides": fwd(2, INITIAL | FINAL, lenient=LENIENT_EMPTY, batch=2, tokens=0),
    "finding_empty_varlen_any_strides": fwd(2, INITIAL | FINAL | IN_PLACE, lenient=LENIENT_EMPTY | LENIENT_UNIT_AXES,
                                            lengths=[0, 0, 0]),
    "finding_empty_pool_any_strides": fwd(1, serving=POOL | CHECKPOINTS, lenient=LENIENT_EMPTY, batch=0, tokens=0),
    # Entries flashkda.h says are never read hold values that fail if read:
    # a padding sequence's checkpoints, the slot of a negative offset, a
    # zero-length sequence's slots and count, table columns past a length.
    "valid_fwd_padding_unread_entries": fwd(2, I32_OFFSETS, POOL | CHECKPOINTS | CHECKPOINT_SLOTS | PADDING,
                                            lengths=[16, 17, 0]),
    "valid_decode_padding_unread_entries": decode(2, TABLE | ACCEPTED | DECODE_PADDING, lengths=[0, 3, 5]),
    "valid_decode_padding_rows": decode(1, DECODE_PADDING, lengths=[0, 2, 1]),
    "unread_padding_checkpoint_offset": fwd(1, 0, POOL | CHECKPOINTS | CHECKPOINT_SLOTS | PADDING, lengths=[16, 16])
    + index_value(FWD_SLOTS, 1, 0, 999),
    # final_state one element into initial_state's buffer was accepted and
    # overwrote states before they were read; at its start it is in place.
    "finding_final_state_partly_over_initial": fwd(1, INITIAL | FINAL, SHARED_STATES, batch=1, tokens=16)
    + alias(FWD_SLOTS, "final_state", 8, offset=4),
    "valid_final_state_in_place_by_alias": fwd(1, INITIAL | FINAL, SHARED_STATES, batch=1, tokens=16)
    + alias(FWD_SLOTS, "final_state", 8),
    # A struct_size inside state_indices' descriptor was accepted and cut
    # its stride off; 0.1's size reads no pool field; a newer caller's
    # non-zero byte in fkda_decode_args' padding is a field unknown here.
    "finding_struct_size_1424": fwd(1, 0, POOL, lengths=[3, 5]) + struct_bytes(FWD_SLOTS, 1424),
    "struct_size_0_1_with_pool": fwd(1, 0, POOL | CHECKPOINTS | CHECKPOINT_SLOTS, lengths=[16, 3])
    + struct_bytes(FWD_SLOTS, 1248),
    "struct_size_newer_decode_padding_byte": decode(1, batch=1, tokens=1) + struct_bytes(DECODE_SLOTS, 1368, 0, 0x5A),
    # The layer step: the convolution in each form (W, Wc, dtypes, biases,
    # channel-last, the three conv states in one pool tensor), the output
    # gate, and the calls that must refuse the convolution.
    "valid_layer_conv_states": fwd(2, INITIAL | FINAL, batch=2, tokens=17, layer=CONV | BIAS | CONV_STATES, width=4),
    "valid_layer_conv_one_pool_channel_last": fwd(1, I32_OFFSETS | PADDED, POOL | HAS_INITIAL | CHECKPOINTS | CHECKPOINT_SLOTS,
                                                  lengths=[16, 3], layer=CONV | CONV_STATES | F32_STATES | CHANNEL_LAST
                                                  | ONE_POOL | GATE, width=3, shape=FULL_STATE_WIDTH),
    "valid_layer_f32_no_states_gate": fwd(2, FINAL, lengths=[5, 0, 7], layer=CONV | BIAS | F32_WEIGHTS | GATE,
                                          shape=F32_NORM_WEIGHT),
    "valid_layer_gate_only": fwd(1, batch=1, tokens=9, layer=GATE),
    "valid_layer_decode_conv_states": decode(2, PADDED, lengths=[1, 0, 3], layer=CONV | BIAS | CONV_STATES | ONE_POOL
                                             | GATE, width=4, shape=FULL_STATE_WIDTH),
    "valid_layer_decode_padding": decode(1, DECODE_PADDING, lengths=[2, 1], layer=CONV | CONV_STATES | CHANNEL_LAST
                                         | F32_WEIGHTS, width=2),
    "refused_layer_conv_plan_without_flag": fwd(1, batch=1, tokens=3, layer=CONV, shape=NO_PLAN_FLAG),
    "refused_layer_conv_slot_table": decode(1, TABLE | ACCEPTED, batch=1, tokens=2, layer=CONV | CONV_STATES),
    "layer_conv_state_over_another": fwd(1, INITIAL, batch=1, tokens=4, layer=CONV | CONV_STATES, width=3)
    + alias(FWD_SLOTS, "layer.conv_state_k", 14),
    "layer_conv_state_pool_block_moved": decode(1, batch=2, tokens=1, layer=CONV | CONV_STATES | ONE_POOL)
    + fault(DECODE_SLOTS, "layer.conv_state_v", DATA_PLUS, plus(-2)),
    "layer_out_norm_eps_zero": fwd(1, batch=1, tokens=2, layer=GATE) + bytes([len(FWD_SLOTS), NORM_EPS]) + raw(0),
    # struct_size, num_heads 2, head dims, state dtype and layout, backend,
    # lower_bound -5, null slot rule, debug checks, gate and beta modes.
    "valid_plan_desc": plan_create(0, 0),
    "valid_plan_desc_softplus_probabilities": plan_create(1, 1),
    "valid_plan_desc_log_decay": plan_create(2, 0),
}

if __name__ == "__main__":
    corpus = pathlib.Path(__file__).resolve().parent / "corpus"
    corpus.mkdir(exist_ok=True)
    for stale in corpus.iterdir():
        stale.unlink()
    for name, data in SEEDS.items():
        (corpus / name).write_bytes(data)
