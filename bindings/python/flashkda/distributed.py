# SPDX-License-Identifier: MIT
"""Context-parallel prefill over a torch.distributed process group.

The packed tokens of a call (one row, the sequences of the global cu_seqlens
one after another) are cut into contiguous slices, one per rank, in rank
order. A sequence may span several ranks. Each rank

1. computes the segment transition (M, E) of the last sequence piece it holds
   (flashkda.transitions: S_out = S_in @ M + E for any state S_in entering it),
2. all-gathers every rank's transition in one collective
   (all_gather_into_tensor of one packed f32 buffer per rank),
3. applies, to the initial state of the sequence its slice begins inside, the
   transitions of the earlier ranks that sequence spans (flashkda.apply_transitions),
4. runs flashkda.fwd on its own tokens from those states.

Each rank's out holds the output of its own tokens; final_state rows are
written by the rank holding the sequence's last token (see
context_parallel_fwd). Works with gloo on CPU tensors (CPU backend) and NCCL on
CUDA tensors (GPU backend); the library itself never communicates.
"""

from dataclasses import dataclass
from typing import List

from ._abi import BetaMode, GateMode, NullSlotRule
from ._api import apply_transitions, fwd, transitions
from ._errors import invalid_argument

HEAD_DIM = 128


@dataclass(frozen=True)
class Piece:
    """Tokens [begin, end) of the rank's slice (local offsets) belonging to
    global sequence `seq`, whose tokens are [seq_begin, seq_end) globally."""

    seq: int
    begin: int
    end: int
    seq_begin: int
    seq_end: int


@dataclass(frozen=True)
class Layout:
    """How the packed tokens are cut: the global sequence offsets and the
    ranks' token offsets (rank r holds [rank_offsets[r], rank_offsets[r + 1]))."""

    cu_seqlens: List[int]
    rank_offsets: List[int]

    def pieces(self, rank):
        """The sequence pieces of a rank's slice in token order. A sequence of
        no tokens belongs to the rank whose slice starts at or before its
        offset and ends after it (the last rank for offsets at the end), so
        that exactly one rank carries its state over."""
        first, last = self.rank_offsets[rank], self.rank_offsets[rank + 1]
        total = self.rank_offsets[-1]
        is_last_owner = rank == self._last_rank_with_tokens_or_last()
        out = []
        for n in range(len(self.cu_seqlens) - 1):
            begin, end = self.cu_seqlens[n], self.cu_seqlens[n + 1]
            if begin == end:
                owns = (first <= begin < last) or (begin == total and is_last_owner)
                if owns:
                    out.append(Piece(n, begin - first, begin - first, begin, end))
                continue
            lo, hi = max(begin, first), min(end, last)
            if lo < hi:
                out.append(Piece(n, lo - first, hi - first, begin, end))
        return out

    def _last_rank_with_tokens_or_last(self):
        ranks = len(self.rank_offsets) - 1
        for rank in range(ranks - 1, -1, -1):
            if self.rank_offsets[rank + 1] > self.rank_offsets[rank]:
                return rank
        return ranks - 1

    def ranks_before(self, rank, piece):
        """The earlier ranks whose slices hold tokens of `piece`'s sequence, in order."""
        return [r for r in range(rank)
                if max(piece.seq_begin, self.rank_offsets[r]) < min(piece.seq_end, self.rank_offsets[r + 1])]


def _host_offsets(name, values):
    if values is None:
        return None
    if hasattr(values, "tolist"):
        values = values.tolist()
    try:
        offsets = [int(x) for x in values]
    except (TypeError, ValueError):
        raise invalid_argument(f"{name}: expected a sequence of integers on the host") from None
    if len(offsets) < 2 or offsets[0] != 0 or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise invalid_argument(f"{name}: expected non-decreasing offsets from 0, got {offsets}")
    return offsets


def make_layout(local_tokens, world_size, rank, cu_seqlens=None, rank_offsets=None):
    """The Layout of a call: `rank_offsets` ([world_size + 1], host) when
    given, else every rank holding `local_tokens` tokens; `cu_seqlens` (global,
    host) when given, else one sequence of all the tokens."""
    ranks = _host_offsets("rank_offsets", rank_offsets)
    if ranks is None:
        ranks = [r * local_tokens for r in range(world_size + 1)]
    if len(ranks) != world_size + 1:
        raise invalid_argument(f"rank_offsets: expected {world_size + 1} offsets, got {len(ranks)}")
    if ranks[rank + 1] - ranks[rank] != local_tokens:
        raise invalid_argument(
            f"q: rank {rank} holds {local_tokens} tokens, but rank_offsets gives it "
            f"{ranks[rank + 1] - ranks[rank]}")
    sequences = _host_offsets("cu_seqlens", cu_seqlens)
    if sequences is None:
        sequences = [0, ranks[-1]]
    if sequences[-1] != ranks[-1]:
        raise invalid_argument(
            f"cu_seqlens: ends at {sequences[-1]}, but the ranks hold {ranks[-1]} tokens")
    return Layout(sequences, ranks)


def context_parallel_fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound,
                         initial_state=None, final_state=None, cu_seqlens=None, *,
                         group=None, rank_offsets=None, state_pool=None, state_indices=None,
                         has_initial_state=None, null_slot_rule=NullSlotRule.NEGATIVE,
                         gate_mode=GateMode.BOUNDED, beta_mode=BetaMode.LOGITS):
    """flashkda.fwd over tokens spread across the ranks of `group`.

    Every rank calls it with its own slice of the packed tokens:
      q, k, v, g, out  [1, T_rank, H, 128] (bf16; g f32 allowed with log_decay)
      beta             [1, T_rank, H]
      A_log, dt_bias, scale, lower_bound, gate_mode, beta_mode  as for
                       flashkda.fwd, the same on every rank
      cu_seqlens       the GLOBAL sequence offsets [N + 1] over all ranks'
                       tokens, on the host (a list, or a CPU tensor); None: one
                       sequence of all the tokens. The same on every rank.
      rank_offsets     [world_size + 1] host offsets of the ranks' slices in
                       rank order; None: every rank holds T_rank tokens
      initial_state    optional [N, H, 128, 128] f32 or bf16, the same on every
                       rank (each reads the rows of the sequences it holds)
      final_state      optional [N, H, 128, 128], written on each rank for the
                       sequences whose last token that rank holds (and for a
                       sequence of no tokens, on the rank owning its offset);
                       the other rows are left as they were, so a gather or
                       sum over ranks of zero-filled buffers assembles them
      state_pool, state_indices, has_initial_state, null_slot_rule
                       states in a pool instead: state_pool [slots, H, 128,
                       128] (f32 or bf16, each rank's own copy), state_indices
                       [N] and has_initial_state [N] on the host (lists or CPU
                       tensors), the same on every rank. Sequence n starts
                       from slot state_indices[n] (zeros where
                       has_initial_state[n] is false); the rank holding its
                       last token writes its final state there; a null index
                       makes it padding (zero output rows, no slot touched).
                       has_initial_state also applies to initial_state.
      group            the process group (None: the default group)
    Tensors are torch tensors: CPU tensors with a gloo group run on the CPU
    backend, CUDA tensors with NCCL on the GPU backend. One collective: an
    all_gather_into_tensor of H * 2 * 128 * 128 f32 per rank.
    """
    import torch
    import torch.distributed as dist

    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if q.dim() != 4 or q.shape[0] != 1:
        raise invalid_argument(f"q: expected [1, T_rank, H, 128] (packed tokens), got {list(q.shape)}")
    local_tokens, heads = int(q.shape[1]), int(q.shape[2])
    layout = make_layout(local_tokens, world_size, rank, cu_seqlens, rank_offsets)
    pieces = layout.pieces(rank)
    num_seqs = len(layout.cu_seqlens) - 1
    for name, state in (("initial_state", initial_state), ("final_state", final_state)):
        if state is not None and (state.dim() != 4 or state.shape[0] != num_seqs):
            raise invalid_argument(f"{name}: expected [{num_seqs}, H, 128, 128] (one row per "
                                   f"sequence of cu_seqlens), got {list(state.shape)}")
    if state_pool is not None and (initial_state is not None or final_state is not None):
        raise invalid_argument("state_indices: the states come from state_pool, so initial_state "
                               "and final_state must be None")
    if (state_pool is None) != (state_indices is None):
        raise invalid_argument("state_indices: state_pool and state_indices go together")
    slots = _host_ints("state_indices", state_indices, num_seqs)
    starts = _host_ints("has_initial_state", has_initial_state, num_seqs)
    nonpositive = int(null_slot_rule) == int(NullSlotRule.NONPOSITIVE) or null_slot_rule == "nonpositive"

    def padding(n):
        return slots is not None and (slots[n] <= 0 if nonpositive else slots[n] < 0)

    device = q.device
    # The rank's states stay in f32 whatever the caller's dtype (a bf16
    # initial state is exact in f32): the state entering a rank is rounded
    # only where the one-process call rounds it, into final_state.
    state_dtype = torch.float32
    modes = dict(gate_mode=gate_mode, beta_mode=beta_mode)
    matrix = heads * HEAD_DIM * HEAD_DIM

    # 1. The transition of the rank's last piece: what later ranks of its
    #    sequence need. Without tokens the rank passes the identity map on.
    sent = torch.zeros(2 * matrix, dtype=torch.float32, device=device)
    m_sent = sent[:matrix].view(1, heads, HEAD_DIM, HEAD_DIM)
    e_sent = sent[matrix:].view(1, heads, HEAD_DIM, HEAD_DIM)
    last = pieces[-1] if pieces else None
    if last is not None and last.end > last.begin and last.seq_end > layout.rank_offsets[rank + 1]:
        part = slice(last.begin, last.end)
        transitions(k[:, part], v[:, part], g[:, part], beta[:, part], A_log, dt_bias, lower_bound,
                    m_sent, e_sent, **modes)
    else:
        # Nothing of this rank continues on a later one: never read, but kept
        # a valid (identity) map.
        m_sent.copy_(torch.eye(HEAD_DIM, dtype=torch.float32, device=device).expand_as(m_sent))

    # 2. One collective.
    if device.type == "cuda" and dist.get_backend(group) == "gloo":
        # gloo gathers host memory: CUDA tensors go through it (NCCL gathers
        # device memory directly).
        gathered = torch.empty(world_size * 2 * matrix, dtype=torch.float32)
        dist.all_gather_into_tensor(gathered, sent.cpu(), group=group)
        gathered = gathered.to(device)
    else:
        gathered = torch.empty(world_size * 2 * matrix, dtype=torch.float32, device=device)
        dist.all_gather_into_tensor(gathered, sent, group=group)
    gathered = gathered.view(world_size, 2, heads, HEAD_DIM, HEAD_DIM)

    # 3. The states entering the rank's pieces.
    local_initial = None
    if pieces:
        local_initial = torch.zeros(len(pieces), heads, HEAD_DIM, HEAD_DIM, dtype=state_dtype,
                                    device=device)
        for i, p in enumerate(pieces):
            if padding(p.seq) or (starts is not None and not starts[p.seq]):
                continue
            if state_pool is not None:
                local_initial[i].copy_(state_pool[slots[p.seq]])
            elif initial_state is not None:
                local_initial[i].copy_(initial_state[p.seq])
        first = pieces[0]
        before = layout.ranks_before(rank, first)
        if before:
            index = torch.tensor(before, device=device)
            chosen = gathered.index_select(0, index)  # [R, 2, H, K, K]
            m = chosen[:, 0].contiguous().view(len(before), 1, heads, HEAD_DIM, HEAD_DIM)
            e = chosen[:, 1].contiguous().view(len(before), 1, heads, HEAD_DIM, HEAD_DIM)
            entering = local_initial[:1]  # updated in place
            apply_transitions(m, e, entering, entering)

    # 4. The rank's own tokens from those states.
    local_cu = torch.tensor([0] + [p.end for p in pieces], dtype=torch.int64, device=device)
    local_final = None
    if (final_state is not None or state_pool is not None) and pieces:
        local_final = torch.empty(len(pieces), heads, HEAD_DIM, HEAD_DIM, dtype=state_dtype,
                                  device=device)
    if pieces:
        fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound,
            initial_state=local_initial, final_state=local_final, cu_seqlens=local_cu, **modes)
    for i, p in enumerate(pieces):
        if padding(p.seq):
            out[:, p.begin:p.end].zero_()
        elif local_final is not None and _owns_end(layout, rank, p):
            if state_pool is not None:
                state_pool[slots[p.seq]].copy_(local_final[i])
            else:
                final_state[p.seq].copy_(local_final[i])
    return out


def _host_ints(name, values, count):
    if values is None:
        return None
    if hasattr(values, "tolist"):
        values = values.tolist()
    values = [int(x) for x in values]
    if len(values) != count:
        raise invalid_argument(f"{name}: expected {count} entries (one per sequence), got {len(values)}")
    return values


def _owns_end(layout, rank, piece):
    """Whether `rank` holds the sequence's last token (or, for a sequence of
    no tokens, owns its offset: it is among the rank's pieces)."""
    if piece.seq_end == piece.seq_begin:
        return True
    return layout.rank_offsets[rank] < piece.seq_end <= layout.rank_offsets[rank + 1]


__all__ = ["Layout", "Piece", "context_parallel_fwd", "make_layout"]
