"""CUDA backward of the chunked KDA (csrc/kda_bwd.cu): the two backward operations of a KCP call.

    bwd_grads      dq, dk, dv, dg, dbeta of every run from its incoming state and outgoing state gradient
    bwd_summaries  (M^T, F) of listed runs from a zero state gradient: dS_in = Mt dS_out + F

Stages (docs/kernels.md §1, §4, §5): a prep kernel per (chunk, head) writes one 160.5 KiB record
(W, Kg, s Qg as bf16; Aqk as bf16 hi + lo, A as bf16 hi; U as fp16 at a power of two; P as fp32; gamma; room for
dV_new); a forward walk per (run, head) (one 8-warp CTA of all 128 value columns) writes h (the state entering each chunk) and V_new over U; a reverse
walk writes dh (the gradient of the state leaving each chunk) and dV_new, or the summaries (the two walks,
with their summaries and folds, run on two streams: ``_both_walks``; whole-run walks of unlike lengths run in
up to 4 walk groups, segmented walks in two halves of the chunk table, each group's gradients starting when its
own walks end: ``_walk_groups``; whole-run chains in pieces that hand their FP32 state on, each block's gradients
starting once both walks have passed it: ``WalkGroup``; the choices are ``kda_kcp.cuda.tuning``'s); a gradient
kernel per (chunk, head) finishes from the record, h and dh. h holds each state as bf16 hi only, dh as
fp16 at a power of two per walk warp, in the walks' register order (``hi_state_shape``, ``hi_states``,
``scaled_state_shape``, ``scaled_states``); V_new and dV_new reach the gradient kernel as fp16 the same way
(``walk_tiles``). Because the forward walk overwrites U,
the records of a ``PreparedBackward`` serve one ``grads`` call. Nothing is reduced with atomics: both
packages run the same kernels and the result is bitwise repeatable; ``deterministic`` is accepted for
either value.

Tensors: q, k, v, do bf16 [T, H, 128]; g fp32 [T, H, 128]; beta bf16 [T, H]; incoming states, their
gradients and the summaries fp32 [R, H, 128, 128] indexed [run, head, key, value].
"""

from __future__ import annotations

import math

import torch

from .. import status
from ..arena import Arena
from ..partition import coalesce_ranges
from . import tuning
from .common import _D, _c, check_grid_bounds, check_tensors, even_split, side_streams, sm_count

__all__ = ["PreparedBackward", "bwd_grads", "bwd_summaries", "saved_bytes", "PREP_BYTES", "ENTRY_POINTS", "load",
           "record_lower_blocks"]

PREP_BYTES = 164352  # one prep record per (chunk, head), with the walks' V_new and dV_new; kda_bwd.h kPrepBytes
REC_VN, REC_DVN = 81920, 131584  # byte offsets of the walks' V_new (over U) and dV_new; kda_bwd.h kRecVn, kRecDvn
VN_SCALE_OFF = 640  # their powers of two inside the slot; kda_bwd.h kVnScaleOff
DH_BYTES, DH_SCALE_OFF = 32896, 32768  # dh per chunk-head and its powers of two; kda_bwd.h kDhStateBytes, kDhScaleOff
REC_U, U_SCALE_OFF = 81920, 128  # the prep's U (fp16, scaled) and its scale; kda_bwd.h kRecU, kUScaleOff


def record_lower_blocks(device="cpu") -> torch.Tensor:
    """[64][64] bool, True on the 16 x 16 blocks (I, J <= I) of a record's Aqk, A and P that the prep writes: the
    strictly upper blocks stay unwritten (kda_bwd.h), so a reader of a record must mask them."""
    b = torch.arange(64, device=device) // 16
    return b[None, :] <= b[:, None]


# the program's entry points this module calls (scripts/check_entry_points.py checks them in every build)
ENTRY_POINTS = ("bwd_prep", "bwd_fwd_walk", "bwd_rev_walk", "bwd_fwd_summary", "bwd_rev_summary", "merge_fold",
                "bwd_grads", "status_fill")


def _both_walks(rev_chain, fwd_chain, device) -> None:
    """Run the reverse chain (dh, dV_new) on the current stream and the forward chain (h, V_new) on a side
    stream, joined before returning. They are independent: the reverse recursion of dS never reads S, the
    reverse walk reads the records' W, Kg, Qg, Aqk, gamma and writes dV_new and dh, the forward walk reads
    W, Kg, U, gamma and writes V_new (over U) and h. Each kernel's result is the same whatever the overlap,
    so the backward stays bitwise repeatable. A CTA of each does not fit on one SM (shared memory): the
    overlap is between the segmented chains' summaries and folds (``tuning.bwd_walk_streams``).
    The walks themselves go through ``_pipelined_walks_and_grads`` when there are walk groups; run together, the
    two walks are bound by DRAM bandwidth even when a CTA of each fits on one SM (docs/kernels.md §4)."""
    if torch.device(device).type != "cuda" or not tuning.bwd_walk_streams():  # (the CPU emulation of the kernels)
        rev_chain()
        fwd_chain()
        return
    main = torch.cuda.current_stream(device)
    side = side_streams("bwd_side", main.device, 1)[0]
    side.wait_stream(main)  # the records, states and buffers made so far
    rev_chain()
    with torch.cuda.stream(side):
        fwd_chain()
    main.wait_stream(side)  # buffers used on the side stream are freed (or reused) on main only after this


def load(device=None):
    """The tvm_ffi module of kda_bwd (build.json) for the arch of ``device`` (kda_kcp.jit caches it)."""
    from ..jit import load_program

    return load_program("kda_bwd", device)


# ---------------------------------------------------------------------------------------------------
# tables
# ---------------------------------------------------------------------------------------------------
def _tables(plan, device):
    """(chunks int32 [Nc, 2], whole-run walk rows int32 [R, 4] = (first chunk, chunks, run, 0)), cached."""
    key = ("cuda_bwd_tables", str(torch.device(device)))
    cache = plan._tables
    if key not in cache:
        t = plan.device_tables(device)
        chunks = torch.stack([t["chunk_start"], t["chunk_len"]], 1).contiguous()
        ptr = t["run_chunk_ptr"]
        R = plan.num_runs
        idx = torch.arange(R, dtype=torch.int32, device=ptr.device)
        runs = torch.stack([ptr[:-1], ptr[1:] - ptr[:-1], idx, torch.zeros_like(idx)], 1).contiguous()
        cache[key] = (chunks, runs)
    return cache[key]


def _row_table(rows, device) -> torch.Tensor:
    """A table of 4-int rows (walk, summary or chain rows; kda_bwd.h) as int32 [n, 4] on ``device``."""
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, 4).to(device)


class SegTables:
    """int32 tables of the segmented walks (rows described in csrc/kda_bwd.h)."""

    def __init__(self, plan, heads: int, device):
        C = plan.chunk_size
        run_chunks = [r.num_chunks(C) for r in plan.runs]
        sms = sm_count(device)
        L = tuning.bwd_segment_chunks(run_chunks, heads, sms)
        fwalk, rwalk, fsum, rsum, fch, rch = [], [], [], [], [], []
        nf = nr = 0
        ptr = 0
        for r, n in enumerate(run_chunks):
            parts = even_split(n, math.ceil(n / L)) if n > 0 else []
            starts = []
            for p in parts:
                starts.append(ptr)
                ptr += p
            k = len(parts)
            if k == 0:
                continue
            if k == 1:
                fwalk.append((starts[0], parts[0], r, 0))
                rwalk.append((starts[0], parts[0], r, 0))
                continue
            fch.append((len(fsum), k - 1, r, nf))
            for j in range(k - 1):
                fsum.append((starts[j], parts[j], len(fsum), 0))
            fwalk.append((starts[0], parts[0], r, 0))
            for j in range(1, k):
                fwalk.append((starts[j], parts[j], nf + j - 1, 1))
            nf += k - 1
            rch.append((len(rsum), k - 1, r, nr))
            for j in range(k - 1, 0, -1):
                rsum.append((starts[j], parts[j], len(rsum), 0))
            rwalk.append((starts[k - 1], parts[k - 1], r, 0))
            for j in range(k - 1):
                rwalk.append((starts[j], parts[j], nr + (k - 2 - j), 1))
            nr += k - 1
        # longest rows first: the CTAs that bound a pass start first
        for lst in (fwalk, rwalk, fsum, rsum):
            lst.sort(key=lambda row: -row[1])

        self.seg_chunks = L
        self.host = {"fwalk": fwalk, "rwalk": rwalk, "fsum": fsum, "rsum": rsum}  # for the lean passes
        self.fwalk, self.rwalk, self.fsum, self.rsum, self.fchains, self.rchains = (
            _row_table(rows, device) for rows in (fwalk, rwalk, fsum, rsum, fch, rch))
        self.num_fold_f, self.num_fold_r = nf, nr
        self.num_sum_f, self.num_sum_r = len(fsum), len(rsum)
        self.walk_warps = tuning.bwd_walk_warps(len(fwalk), heads, sms)
        self.summary_warps = tuning.bwd_summary_warps(len(fsum), heads, sms)


def _seg_tables(plan, heads: int, device) -> SegTables:
    key = ("cuda_bwd_segments", heads, str(torch.device(device))) + tuning.cache_key()
    cache = plan._tables
    if key not in cache:
        cache[key] = SegTables(plan, heads, device)
    return cache[key]


class LeanPass:
    """One pass of the lean backward: its chunks (rows of the plan's chunk table) and its rows of the walk
    and summary tables, chunk indices local to the pass (summary and fold indices stay global)."""

    def __init__(self, chunks, rows: dict, device):
        self.num_chunks = int(chunks.shape[0])
        self.chunks = chunks
        for name, lst in rows.items():
            setattr(self, name, _row_table(lst, device))
        self.has_summaries = bool(rows["fsum"] or rows["rsum"])


def _lean_passes(plan, heads: int, device, passes: int) -> list[LeanPass]:
    """The segments of the backward's walks assigned to ``passes`` passes, longest first to the pass with
    the fewest chunks so far (a pure function of the segment table): each pass holds whole segments, so
    every kernel sees exactly the chunks and states it sees in one pass, and results are bitwise equal."""
    key = ("cuda_bwd_lean", heads, str(torch.device(device)), passes) + tuning.cache_key()
    cache = plan._tables
    if key in cache:
        return cache[key]
    st = _seg_tables(plan, heads, device)
    chunks, _ = _tables(plan, device)
    segs = sorted({(r[0], r[1]) for r in st.host["fwalk"]}, key=lambda fc: (-fc[1], fc[0]))
    load, members = [0] * passes, [[] for _ in range(passes)]
    for first, count in segs:
        p = min(range(passes), key=lambda i: (load[i], i))
        load[p] += count
        members[p].append((first, count))
    out = []
    for mem in members:
        if not mem:
            continue
        mem.sort()
        local, ids = {}, []
        for first, count in mem:
            local[first] = len(ids)
            ids.extend(range(first, first + count))
        rows = {name: [(local[r[0]], *r[1:]) for r in st.host[name] if r[0] in local]
                for name in ("fwalk", "rwalk", "fsum", "rsum")}
        sub = chunks.index_select(0, torch.tensor(ids, dtype=torch.long, device=chunks.device))
        out.append(LeanPass(sub, rows, device))
    cache[key] = out
    return out


class SummaryTables:
    """The KCP exchange's reverse summaries of some runs: ``chunks`` (the chunk table the rows index), ``rows``
    (first chunk, chunks, out slot, 0) of the walks and, when the runs are cut into segments, ``chains`` (first
    slot, count, -1, run's index in run_ids) that compose each run's segment summaries, its last segment's first
    (the reverse walk's order: dS_in = Mt_1 (... (Mt_n dS_out + F_n) ...) + F_1); None: one walk per whole run."""

    def __init__(self, chunks, rows, chains):
        self.chunks, self.rows, self.chains = chunks, rows, chains
        self.num_rows = rows.shape[0]


def _summary_tables(plan, run_ids, device, own_chunks: bool, heads: int = 1) -> SummaryTables:
    """The SummaryTables of ``run_ids`` (segments of ``tuning.bwd_summary_chunks``). own_chunks False: rows index the
    plan's chunk table (the replay records cover it); True: a table of just these runs' chunks (the lean backward
    preps them apart). Cached."""
    device = torch.device(device)
    key = ("cuda_bwd_summary_tables", tuple(run_ids), str(device), own_chunks, heads) + tuning.cache_key()
    cache = plan._tables
    if key not in cache:
        C = plan.chunk_size
        L = tuning.bwd_summary_chunks([plan.runs[r].num_chunks(C) for r in run_ids], heads, sm_count(device))
        firsts = [0]
        for run in plan.runs:
            firsts.append(firsts[-1] + run.num_chunks(C))
        chunks, spans = [], []  # spans: (first chunk, segment lengths) per listed run
        for r in run_ids:
            run = plan.runs[r]
            bounds = run.chunk_offsets(C)
            spans.append((len(chunks) if own_chunks else firsts[r],
                          even_split(len(bounds), math.ceil(len(bounds) / L)) if bounds else []))
            if own_chunks:
                chunks += [(run.local_start + off, n) for off, n in bounds]
        segmented = any(len(parts) > 1 for _, parts in spans)
        rows, chains = [], []
        for i, (first, parts) in enumerate(spans):
            if not segmented:  # one walk per run, its summary straight into slot i
                rows.append((first, sum(parts), i, 0))
                continue
            starts = [first + sum(parts[:j]) for j in range(len(parts))]
            chains.append((len(rows), len(parts), -1, i))  # (an empty run: a chain of none, M = I, E = 0)
            for j in reversed(range(len(parts))):  # the last segment's summary first: the chain's order
                rows.append((starts[j], parts[j], len(rows), 0))
        ct = torch.tensor(chunks, dtype=torch.int32).reshape(-1, 2).to(device) if own_chunks else _tables(plan, device)[0]
        rt = _row_table(rows, device)
        ch = _row_table(chains, device) if segmented else None
        cache[key] = SummaryTables(ct, rt, ch)
    return cache[key]


def _forward_program(device):
    """The forward's program (kda_kcp.cuda.forward.load), for its affine compose."""
    from . import forward

    return forward.load(device)


def hi_state_shape(n: int, H: int) -> tuple:
    """Shape of h: bf16 [n, H, 128, 128], the state entering each chunk as bf16 hi only in the walks' fragment
    order (kda_bwd.h kHiStateBytes; ``hi_states``): the gradient kernel's products read S as hi only, and its
    dgamma takes S hi times dS."""
    return (n, H, _D, _D)


def scaled_state_shape(n: int, H: int) -> tuple:
    """Shape of dh: uint8 [n, H, DH_BYTES], per chunk-head the state gradient as fp16 at a power of two per walk warp
    in the walks' fragment order, then the powers (kda_bwd.h kDhStateBytes; ``scaled_states``)."""
    return (n, H, DH_BYTES)


def walk_tiles(records: torch.Tensor, offset: int) -> torch.Tensor:
    """V_new (``offset`` REC_VN) or dV_new (REC_DVN) as fp32 [N, H, 64 tokens, 128] from prep records
    [N, H, PREP_BYTES] uint8 after the walks (for tests and diagnostics). The walks' fragment order (kda_bwd.h):
    64 rows of 512 bytes, row 16 w + 4 ks + 2 ih + il, at byte 256 z the fp16 words of the 32 lanes (4 g + l); a
    word holds tokens 16 ks + 8 ih + 2 l (+1) of value column 64 z + 16 w + 8 il + g, times 2^-e of (z, w); 2^e as
    fp32 at byte VN_SCALE_OFF + 256 z + 4 w."""
    n, H = records.shape[:2]
    x = records[:, :, offset : offset + 32768].contiguous().view(torch.float16).float()
    x = x.reshape(n, H, 4, 4, 2, 2, 2, 2, 8, 4, 2)[:, :, :, :, :, :, :, 0]  # [n, H, w, ks, ih, il, z, g, l, e]
    sc = records[:, :, offset + VN_SCALE_OFF : offset + VN_SCALE_OFF + 512].contiguous().view(torch.float32)
    sc = sc.reshape(n, H, 2, 64)[..., :4]  # [n, H, z, w]
    x = x * sc.permute(0, 1, 3, 2)[:, :, :, None, None, None, :, None, None, None]
    return x.permute(0, 1, 3, 4, 8, 9, 6, 2, 5, 7).reshape(n, H, 64, _D)


def record_u(records: torch.Tensor) -> torch.Tensor:
    """U = A diag(beta) V as fp32 [N, H, 64, 128] from prep records [N, H, PREP_BYTES] uint8 before the forward
    walk writes V_new over it (for tests and diagnostics). kda_bwd.h: row i, value half z as 64 fp16 at byte
    512 i + 256 z of the slot, times the chunk-head's power of two 2^e, an fp32 at byte 128 of the slot."""
    n, H = records.shape[:2]
    u = records[:, :, REC_U : REC_U + 32768].reshape(n, H, 64, 2, 256)[..., :128]
    u = u.contiguous().view(torch.float16).float().reshape(n, H, 64, _D)
    scale = records[:, :, REC_U + U_SCALE_OFF : REC_U + U_SCALE_OFF + 4].contiguous().view(torch.float32)
    return u * scale[..., None]


def scaled_states(x: torch.Tensor) -> torch.Tensor:
    """The states S[key][value] as fp32 [n, H, 128, 128] from dh (``scaled_state_shape``, for tests and
    diagnostics). Per chunk-head, kda_bwd.h: value half z, warp w, key step nt, eh, then 32 lanes (4 g + l) of fp16
    words of two adjacent keys 8 nt + 2 l (+1) of value column 64 z + 16 w + 8 eh + g, times 2^-e of (z, w); then
    2^e as fp32 at byte DH_SCALE_OFF + 16 z + 4 w."""
    n, H = x.shape[:2]
    y = x[:, :, :DH_SCALE_OFF].contiguous().view(torch.float16).float().reshape(n, H, 2, 4, 16, 2, 8, 4, 2)
    sc = x[:, :, DH_SCALE_OFF : DH_SCALE_OFF + 32].contiguous().view(torch.float32).reshape(n, H, 2, 4)
    y = y * sc[:, :, :, :, None, None, None, None, None]
    return y.permute(0, 1, 4, 7, 8, 2, 3, 5, 6).reshape(n, H, _D, _D)  # [n, H, (nt, l, e), (z, w, eh, g)]


def hi_states(x: torch.Tensor) -> torch.Tensor:
    """The states S[key][value] as fp32 [n, H, 128, 128] from h (``hi_state_shape``, for tests and diagnostics):
    the order of ``scaled_states``, bf16 words and no powers."""
    n, H = x.shape[:2]
    y = x.contiguous().view(torch.bfloat16).float().reshape(n, H, 2, 4, 16, 2, 8, 4, 2)
    return y.permute(0, 1, 4, 7, 8, 2, 3, 5, 6).reshape(n, H, _D, _D)  # [n, H, (nt, l, e), (z, w, eh, g)]


def saved_bytes(num_chunks: int, num_heads: int) -> int:
    """Bytes the CUDA backward needs saved from the forward: none beyond the inputs (it recomputes)."""
    return 0


# ---------------------------------------------------------------------------------------------------
# entry points
# ---------------------------------------------------------------------------------------------------
def _state(x, n, H, none, name):
    """A state argument of a binding: ``none`` (a 0-element tensor) when absent."""
    if x is None:
        return none
    x = x.to(device=none.device, dtype=torch.float32).contiguous()  # a no-op for function.py's states
    if tuple(x.shape) != (n, H, _D, _D):
        raise ValueError(f"{name} must be [{n}, {H}, {_D}, {_D}], got {tuple(x.shape)}")
    return x


class WalkGroup:
    """Runs whose walks and gradients go together: their rows of the whole-run walk tables and their chunk
    ranges [c0, c1) of the plan's chunk table (consecutive runs merged). With ``pieces`` k > 1 (whole-run walks
    only; ``tuning.bwd_walk_pieces``) each run's chunks are cut into k blocks (``even_split``) and each chain is
    launched block by block: forward piece j walks block j of every run of the group (rows ``fwd_pieces[j]``), the
    reverse chain blocks k - 1 down to 0 (``rev_pieces``, in launch order). A piece starts from the state its run's
    previous piece left in the group's hand-off buffer (row i of a piece is row i of every piece: src 1, idx i) and writes the one it leaves
    there; the first piece of a chain starts from the run's state_in / dstate_out as a whole-run row does. The
    gradients of block j (``blocks[j]``: chunk ranges) wait for forward piece j and the reverse piece of block j
    only; ``ready[j]`` is when both are expected done (in forward walk steps from the walks' start). k = 1: one
    piece, the whole-run (or segment) rows."""

    def __init__(self, fwalk, rwalk, ranges, device, pieces: int = 1):
        self.fwalk, self.rwalk = _row_table(fwalk, device), _row_table(rwalk, device)
        self.ranges = ranges
        self.rows = len(fwalk)
        self.longest = max((row[1] for row in fwalk), default=0)  # chunks of the group's longest walk row
        self.pieces = k = max(1, min(pieces, self.longest))
        if k == 1:
            self.fwd_pieces, self.rev_pieces, self.rev_blocks = [self.fwalk], [self.rwalk], [0]
            self.blocks = [ranges]
            self.ready = [tuning.REV_STEP_RATIO * self.longest]
            return
        cuts = []  # per row: the (first chunk, count) of its k blocks
        for first, count, _, _ in fwalk:
            parts, at = [], first
            for n in even_split(count, k):
                parts.append((at, n))
                at += n
            cuts.append(parts)
        runs = [row[2] for row in fwalk]

        def piece(j, opens):  # rows of block j; `opens`: the chain's first piece (the run's own state enters)
            return _row_table([(*cuts[i][j], runs[i], 0) if opens else (*cuts[i][j], i, 1) for i in range(len(fwalk))],
                              device)

        self.fwd_pieces = [piece(j, j == 0) for j in range(k)]
        self.rev_blocks = list(range(k - 1, -1, -1))  # the reverse chain's launch order
        self.rev_pieces = [piece(j, j == k - 1) for j in self.rev_blocks]
        self.blocks = [coalesce_ranges(sorted((a, a + n) for a, n in (c[j] for c in cuts) if n > 0)) for j in range(k)]
        ratio = tuning.REV_STEP_RATIO
        self.ready = [self.longest * max((j + 1) / k, ratio * (k - j) / k) for j in range(k)]  # fwd steps


def _walk_groups(plan, heads: int, device):
    """WalkGroups of the backward walks, or None (one segment, or whole runs all alike in one piece). Whole-run
    walks: the shortest runs' first and the longest's last. The walks of a run are serial in its chunks, so the
    shorter runs' walks end well before the longest one's and their SMs would idle: each group's gradient kernel
    starts as soon as its own walks end, beside the longer groups' walks; with ``tuning.bwd_walk_pieces`` > 1 (even
    for one group) the gradients of each block of a group's chunks start once both walks have passed it. Segmented walks
    (all about one length): the first and the second half of the chunk table, so that one half's gradients fill
    the SMs the walks' last wave leaves.
    Every kernel sees the same rows and chunks as unpipelined, so the results are bitwise equal. A pure function of
    the plan (cached)."""
    key = ("cuda_bwd_walk_groups", heads, str(torch.device(device))) + tuning.cache_key()
    cache = plan._tables
    if key in cache:
        return cache[key]
    st = _seg_tables(plan, heads, device)
    fw, rw = st.host["fwalk"], st.host["rwalk"]

    def group(keep, pieces=1) -> WalkGroup:  # the walk rows `keep` accepts (a segment's rows of both tables together)
        f, r = [row for row in fw if keep(row)], [row for row in rw if keep(row)]
        return WalkGroup(f, r, coalesce_ranges([(first, first + count) for first, count, _, _ in sorted(f)]), device,
                         pieces)

    out = None
    if not (st.num_sum_f or st.num_sum_r) and fw:  # whole runs (rows carry the run id)
        runs = tuning.bwd_walk_groups({row[2]: row[1] for row in fw})
        pieces = tuning.bwd_walk_pieces(len(fw), heads, st.walk_warps, sm_count(device))
        if len(runs) > 1 or pieces > 1:
            out = tuple(group(lambda row, ids=frozenset(ids): row[2] in ids, pieces) for ids in runs)
    elif len(fw) > 1:  # segments: the first half of the chunk table (whole segments), then the rest
        total, acc, firsts = sum(row[1] for row in fw), 0, set()
        for first, count, _, _ in sorted(fw):
            if acc + count / 2 > total / 2:
                break
            firsts.add(first)
            acc += count
        if 0 < len(firsts) < len(fw):
            out = (group(lambda row: row[0] in firsts), group(lambda row: row[0] not in firsts))
    cache[key] = out
    return out


def _pipelined_walks_and_grads(groups, launch_walk, launch_grads, device) -> None:
    """Every group's walks, each group's reverse and forward chain on two side streams of its own at high priority,
    piece by piece (``WalkGroup``), and the gradients of each block of each group on a side stream of their own at
    normal priority, each once the forward and the reverse piece of that block end (``WalkGroup.ready``: when that
    is expected); everything enqueued in the order it is expected to start (the longest group's first on ties);
    joined at the end. High priority: a walk piece launched while gradient CTAs wait for SMs takes the next SM free
    instead of queueing behind whole gradient launches (a chain's pieces are serial). On the CPU (the emulated
    kernels) the same launches run in order."""
    if torch.device(device).type != "cuda" or not tuning.bwd_walk_streams():
        for grp in groups[::-1]:
            for p in range(grp.pieces):
                launch_walk(grp, "rev", p)
            for p in range(grp.pieces):
                launch_walk(grp, "fwd", p)
        for grp in groups:
            for blk in grp.blocks:
                launch_grads(blk)
        return
    main = torch.cuda.current_stream(device)
    walk_pool = side_streams("bwd_walks", main.device, 2 * len(groups), priority=-1)
    grads_pool = side_streams("bwd_grads", main.device, sum(grp.pieces for grp in groups))
    for s in walk_pool + grads_pool:
        s.wait_stream(main)  # the records and buffers carved so far
    # every launch with the time it is expected to start (forward walk steps from the walks' start): piece p of a
    # chain at p / k of its group's walk, a block's gradients when both its pieces end (WalkGroup.ready); enqueued in
    # that order, walks first on ties. The host enqueues a launch in ~10-20 us and the first gradients wait for
    # nothing else, so they should not wait behind the later pieces of every chain (each piece's dependencies, its
    # chain's earlier pieces, start earlier and come first).
    launches = []  # (expected start, walks before gradients, ties: longer groups' walks first, group, what, piece)
    for gi, grp in enumerate(groups):
        k = grp.pieces
        for p in range(k):
            launches.append((grp.longest * p / k, 0, -gi, gi, "fwd", p))
            launches.append((tuning.REV_STEP_RATIO * grp.longest * p / k, 0, -gi, gi, "rev", p))
            launches.append((grp.ready[p], 1, gi, gi, "grads", p))  # (block p)
    done = {}  # (group, direction, block) -> the event recorded after that piece
    streams = iter(grads_pool)
    for *_, gi, what, p in sorted(launches):
        grp = groups[gi]
        if what == "grads":
            s = next(streams)
            s.wait_event(done[gi, "fwd", p])
            s.wait_event(done[gi, "rev", p])
            with torch.cuda.stream(s):
                launch_grads(grp.blocks[p])
            continue
        stream = walk_pool[2 * gi + (0 if what == "rev" else 1)]
        with torch.cuda.stream(stream):
            launch_walk(grp, what, p)
            ev = torch.cuda.Event()
            ev.record(stream)
            done[gi, what, grp.rev_blocks[p] if what == "rev" else p] = ev
    for s in walk_pool + grads_pool:
        main.wait_stream(s)  # buffers used on the side streams are freed (or reused) on main only after this


class PreparedBackward:
    """One backward call: with the replay arena (``passes`` None) every chunk's prep record is made once
    and read by the backward summaries of the runs a rank publishes (KCP) and by the local gradients; the
    lean backward (``passes`` 1..8) preps per pass instead. Scratch comes from ``arena``
    (``kda_kcp.arena.Arena``; None: allocated); the records are its first carve. On an arena that only counts,
    every step carves what it carves on the GPU and launches nothing (``mod`` None): that sizes the call."""

    def __init__(self, q, k, v, g, beta, do, scale, plan, arena=None, passes=None, checked=False):
        """``checked``: q, k, v, g, beta passed ``kda_kcp.validate.check_inputs`` for the CUDA backend in the
        forward and ``do`` is the backward's checked, bf16, contiguous output gradient (``CudaBackend.bwd_prepare``
        from ``backward_kcp``): then nothing is checked again before the prep's launch. That runs on autograd's
        device thread right after it wakes, where each Python step costs several times its warm time (on the
        H200 the first launch came 875 us into the H = 16 backward)."""
        if not checked:
            check_tensors("CUDA backward", q, k, v, g, beta, do)
            q, k, v, g, beta, do = (_c(x) for x in (q, k, v, g, beta, do))
        self.q, self.k, self.v, self.g, self.beta, self.do = q, k, v, g, beta, do
        self.scale, self.plan, self.passes = float(scale), plan, passes
        self.arena = arena if arena is not None else Arena(None, q.device)
        self.dev = self.arena.device  # the inputs' (meta when the arena only counts: then the one sized for)
        counting = self.arena.counting
        self.word = None if counting else status.word(self.dev)
        self.H = q.shape[1]
        check_grid_bounds(self.H, plan.num_chunks)
        self.active = q.shape[0] > 0 and plan.num_runs > 0
        self.mod = load(self.dev) if self.active and not counting else None  # None: nothing to launch
        self.prep, self.used = None, False
        if self.active and passes is None:
            chunks, _ = _tables(plan, self.dev)
            self.prep = self.arena.empty((chunks.shape[0] * self.H * PREP_BYTES,), torch.uint8)
            if self.mod is not None:
                self.mod.bwd_prep(q, k, v, g, beta, chunks, self.prep, self.scale, self.word)
        self.e0 = self.arena.empty((0,), torch.float32)  # an absent optional argument (0 bytes: no carve moves)

    def summaries(self, run_ids, arena=None):
        """(Mt [n, H, K, K], F [n, H, K, V]) fp32 of the listed runs: dS_in = Mt dS_out + F; scratch from ``arena``
        (None: the call's)."""
        H, arena = self.H, self.arena if arena is None else arena
        run_ids = tuple(int(r) for r in run_ids)
        Mt = arena.empty((len(run_ids), H, _D, _D), torch.float32)
        F = arena.empty((len(run_ids), H, _D, _D), torch.float32)
        if not run_ids:
            return Mt, F
        tabs = _summary_tables(self.plan, run_ids, self.dev, own_chunks=self.prep is None, heads=H)
        prep = self.prep
        if prep is None:  # lean: these runs' records apart
            prep = arena.empty((tabs.chunks.shape[0] * H * PREP_BYTES,), torch.uint8)
        if tabs.chains is not None:  # segments: every segment's summary, then each run's chain composed
            mt = arena.empty((tabs.num_rows, H, _D, _D), torch.float32)
            f = arena.empty((tabs.num_rows, H, _D, _D), torch.float32)
        if self.mod is None:
            return Mt, F
        if self.prep is None:  # (lean)
            self.mod.bwd_prep(self.q, self.k, self.v, self.g, self.beta, tabs.chunks, prep, self.scale, self.word)
        warps = tuning.bwd_rev_summary_warps(tabs.num_rows, H, sm_count(self.dev))
        if tabs.chains is None:
            self.mod.bwd_rev_summary(self.do, prep, tabs.chunks, tabs.rows, Mt, F, warps)
            status.fill(self.mod, self.dev, Mt, F)  # NaN, not garbage, for the other ranks (kda_kcp.status)
            return Mt, F
        # (the forward's program exports the affine compose; both programs are loaded with the backend)
        self.mod.bwd_rev_summary(self.do, prep, tabs.chunks, tabs.rows, mt, f, warps)
        _forward_program(self.dev).merge_compose(mt, f, tabs.chains, Mt, F)
        status.fill(self.mod, self.dev, Mt, F)
        return Mt, F

    def grads(self, state_in=None, dstate_out=None):
        """dq, dk, dv (bf16), dg (fp32), dbeta (bf16) of every run, from each run's incoming state and
        the gradient of its outgoing state (None: zero); NaN if the status word is set (kda_kcp.status), which is
        then copied to the host."""
        grads = self._grads(state_in, dstate_out)
        if self.mod is not None:
            status.fill(self.mod, self.dev, *grads)
            status.after_call(self.dev)
        return grads

    def _grads(self, state_in, dstate_out):
        if self.used:  # the forward walk wrote V_new over the records' U
            raise RuntimeError("PreparedBackward.grads runs once per prepared backward")
        self.used = True
        q, k, v, g, beta, do = self.q, self.k, self.v, self.g, self.beta, self.do
        grads = tuple(torch.empty_like(x) for x in (q, k, v, g, beta))
        if not self.active:
            return grads
        H, R, arena, mod, e0 = self.H, self.plan.num_runs, self.arena, self.mod, self.e0
        sin = _state(state_in, R, H, e0, "state_in")
        dso = _state(dstate_out, R, H, e0, "dstate_out")
        if self.passes is not None:
            _bwd_grads_lean(mod, q, k, v, g, beta, do, self.scale, self.plan, sin, dso, e0, arena, self.passes,
                            grads)
            return grads
        dq, dk, dv, dg, dbeta = grads
        chunks, _ = _tables(self.plan, self.dev)
        nc, prep = chunks.shape[0], self.prep
        st = _seg_tables(self.plan, H, self.dev)
        groups = _walk_groups(self.plan, H, self.dev) if tuning.bwd_pipeline() else None
        # every buffer of both chains is carved here, on the current stream, before any fork
        h = arena.empty(hi_state_shape(nc, H), torch.bfloat16)
        dh = arena.empty(scaled_state_shape(nc, H), torch.uint8)
        ffold = rfold = e0
        if st.num_sum_f:
            m = arena.empty((st.num_sum_f, H, _D, _D), torch.float32)
            e = arena.empty((st.num_sum_f, H, _D, _D), torch.float32)
            ffold = arena.empty((st.num_fold_f, H, _D, _D), torch.float32)
        if st.num_sum_r:
            mt = arena.empty((st.num_sum_r, H, _D, _D), torch.float32)
            f = arena.empty((st.num_sum_r, H, _D, _D), torch.float32)
            rfold = arena.empty((st.num_fold_r, H, _D, _D), torch.float32)
        # the split walks' hand-off buffers (one state per row of a group, each way; every piece of a chain reads
        # and writes its rows' slots in place)
        handoff = {id(grp): tuple(arena.empty((grp.rows, H, _D, _D), torch.float32) for _ in "rf")
                   for grp in groups or () if grp.pieces > 1}
        if mod is None:
            return grads

        def fwd_folds():  # the segments' incoming states (segmented walks only)
            if st.num_sum_f:
                mod.bwd_fwd_summary(prep, chunks, st.fsum, m, e, st.summary_warps)
                mod.merge_fold(m, e, st.fchains, sin, ffold)

        def rev_folds():  # the segments' outgoing state gradients
            if st.num_sum_r:
                mod.bwd_rev_summary(do, prep, chunks, st.rsum, mt, f, st.summary_warps)
                mod.merge_fold(mt, f, st.rchains, dso, rfold)

        def fwd_chain():
            fwd_folds()
            mod.bwd_fwd_walk(prep, chunks, st.fwalk, sin, ffold, e0, h, st.walk_warps)

        def rev_chain():
            rev_folds()
            mod.bwd_rev_walk(do, prep, chunks, st.rwalk, dso, rfold, e0, dh, st.walk_warps)

        if groups is None:
            _both_walks(rev_chain, fwd_chain, self.dev)
            mod.bwd_grads(q, k, v, g, beta, do, chunks, prep, h, dh, dq, dk, dv, dg, dbeta, self.scale,
                          tuning.bwd_grads_warps())
            return grads
        if st.num_sum_f or st.num_sum_r:  # segmented: every segment's state before any walk
            _both_walks(rev_folds, fwd_folds, self.dev)

        def launch_walk(grp, which, p):  # piece p of a chain (in its launch order)
            last = p == grp.pieces - 1
            if grp.pieces == 1:
                fold_in, out = (rfold if which == "rev" else ffold), e0
            else:
                buf = handoff[id(grp)][0 if which == "rev" else 1]
                fold_in, out = (e0 if p == 0 else buf), (e0 if last else buf)
            if which == "rev":
                mod.bwd_rev_walk(do, prep, chunks, grp.rev_pieces[p], dso, fold_in, out, dh, st.walk_warps)
            else:
                mod.bwd_fwd_walk(prep, chunks, grp.fwd_pieces[p], sin, fold_in, out, h, st.walk_warps)

        def launch_grads(ranges):
            rec = H * PREP_BYTES
            for c0, c1 in ranges:  # views of the chunk rows, records, h and dh of one range
                mod.bwd_grads(q, k, v, g, beta, do, chunks[c0:c1], prep[c0 * rec : c1 * rec], h[c0:c1], dh[c0:c1],
                              dq, dk, dv, dg, dbeta, self.scale, tuning.bwd_grads_warps())

        _pipelined_walks_and_grads(groups, launch_walk, launch_grads, self.dev)
        return grads


def bwd_grads(q, k, v, g, beta, do, scale, plan, state_in=None, dstate_out=None, deterministic=True, arena=None,
              passes=None):
    """dq, dk, dv (bf16), dg (fp32), dbeta (bf16) of every run of ``plan`` (``CudaBackend.bwd_grads``).
    ``passes`` (1..8) runs the lean backward, bitwise equal to the default (replay) one."""
    return PreparedBackward(q, k, v, g, beta, do, scale, plan, arena, passes).grads(state_in, dstate_out)


def _bwd_grads_lean(mod, q, k, v, g, beta, do, scale, plan, sin, dso, e0, arena, passes, grads):
    """The lean backward: per-pass prep records, h and dh (sized for the largest pass); ``mod`` None: the carves
    only."""
    H = q.shape[1]
    dev = arena.device
    st = _seg_tables(plan, H, dev)
    lean = _lean_passes(plan, H, dev, passes)
    ncmax = max(p.num_chunks for p in lean)
    prep_all = arena.empty((ncmax * H * PREP_BYTES,), torch.uint8)
    h_all = arena.empty(hi_state_shape(ncmax, H), torch.bfloat16)
    dh_all = arena.empty(scaled_state_shape(ncmax, H), torch.uint8)

    def views(p):  # exact-size buffers of one pass
        return prep_all[: p.num_chunks * H * PREP_BYTES], h_all[: p.num_chunks], dh_all[: p.num_chunks]

    # the segments' summaries and their folds
    m = e = mt = f = None
    if st.num_sum_f:
        m = arena.empty((st.num_sum_f, H, _D, _D), torch.float32)
        e = arena.empty((st.num_sum_f, H, _D, _D), torch.float32)
    if st.num_sum_r:
        mt = arena.empty((st.num_sum_r, H, _D, _D), torch.float32)
        f = arena.empty((st.num_sum_r, H, _D, _D), torch.float32)
    ffold = arena.empty((st.num_fold_f, H, _D, _D), torch.float32) if st.num_sum_f else e0
    rfold = arena.empty((st.num_fold_r, H, _D, _D), torch.float32) if st.num_sum_r else e0
    if mod is None:
        return
    word = status.word(dev)
    if st.num_sum_f or st.num_sum_r:
        # summaries of every segment first (they need every pass's records), then the folds
        for p in lean:
            if not p.has_summaries:
                continue
            prep, _, _ = views(p)
            mod.bwd_prep(q, k, v, g, beta, p.chunks, prep, scale, word)
            if p.fsum.shape[0]:
                mod.bwd_fwd_summary(prep, p.chunks, p.fsum, m, e, st.summary_warps)
            if p.rsum.shape[0]:
                mod.bwd_rev_summary(do, prep, p.chunks, p.rsum, mt, f, st.summary_warps)
        if st.num_sum_f:
            mod.merge_fold(m, e, st.fchains, sin, ffold)
        if st.num_sum_r:
            mod.merge_fold(mt, f, st.rchains, dso, rfold)
    dq, dk, dv, dg, dbeta = grads
    for p in lean:  # (each pass walks a subset of the rows at the whole table's widths: not measured per pass)
        prep, h, dh = views(p)
        mod.bwd_prep(q, k, v, g, beta, p.chunks, prep, scale, word)
        _both_walks(lambda: mod.bwd_rev_walk(do, prep, p.chunks, p.rwalk, dso, rfold, e0, dh, st.walk_warps),
                    lambda: mod.bwd_fwd_walk(prep, p.chunks, p.fwalk, sin, ffold, e0, h, st.walk_warps), dev)
        mod.bwd_grads(q, k, v, g, beta, do, p.chunks, prep, h, dh, dq, dk, dv, dg, dbeta, scale,
                      tuning.bwd_grads_warps())


def bwd_summaries(q, k, v, g, beta, do, scale, plan, run_ids, arena=None):
    """(Mt, F) fp32 of the listed runs: dS_in = Mt dS_out + F (``CudaBackend.bwd_summaries``)."""
    return PreparedBackward(q, k, v, g, beta, do, scale, plan, arena).summaries(run_ids)
