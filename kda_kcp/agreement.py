"""Agreement of the ranks before a collective: one small host header per call, so that no rank hangs.

A call that exchanges (W > 1 and a document crosses a piece) first runs this rank's local checks with their
error caught, then all-gathers a fixed-size int64 header on the host (over gloo: the group itself, or the gloo
companion of an NCCL group, kda_kcp.context.host_group_of). The header carries the rank's status and every
property the ranks must share. Then, the same on every rank:

- a rank whose checks failed: the ranks exchange their messages (one all_gather_object, only on this path)
  and every rank raises one ValueError naming each failing rank and its message;
- a property that differs (context, H, K, V, dtypes, scale, mode, workspace arena, whether initial states are
  passed and final states asked for): every rank raises one ValueError naming it and each rank's value.

Only then does the payload all-gather, whose size depends on H, K, V and the dtype, run. Nothing here touches
the GPU, so the header adds no device synchronization (and under CUDA-graph capture it runs on the host only).
``build_context_kcp`` agrees on its cu_seqlens and layout with the same header (kind "context").
"""

from __future__ import annotations

import struct

import torch
import torch.distributed as dist

from .context import KcpContext, fingerprint
from .partition import LAYOUTS

__all__ = ["KINDS", "exchanges", "agree_call", "agree_failure", "agree_context", "call_properties", "layer_properties"]

KINDS = ("context", "forward", "backward", "layer")
_KIND_NAMES = ("build_context_kcp", "a forward", "a backward", "a KimiDeltaAttention forward")

# the header: int64 fields in this order
_FIELDS = (
    "kind", "status", "rank",
    # the context's fingerprint (kda_kcp.context.fingerprint)
    "world_size", "layout", "num_docs", "num_tokens", "crc32", "adler32",
    # the call's properties (call_properties): this rank's local T, then what every rank must share
    "local_tokens", "H", "K", "V", "q", "k", "v", "g", "beta", "do", "scale", "deterministic", "arena", "lean_passes",
    "initial_state", "final_state", "conv_size",
)
_AT = {name: i for i, name in enumerate(_FIELDS)}
_PACKED = struct.Struct(f"<{len(_FIELDS)}q")  # torch.frombuffer of its bytes: ~3 us, torch.tensor(list) ~25 us
_NUM_CONTEXT = _AT["local_tokens"] - _AT["world_size"]
_PROPERTY_FIELDS = _FIELDS[_AT["local_tokens"]:]
_NUM_PROPERTIES = len(_PROPERTY_FIELDS)
_CONTEXT = slice(_AT["world_size"], _AT["local_tokens"])
_SHARED = slice(_AT["H"], len(_FIELDS))

# dtype codes (0: no tensor); the same table on every rank of one installation
_DTYPES = sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype)}, key=str)
_DTYPE_CODE = {d: i + 1 for i, d in enumerate(_DTYPES)}
_ARENAS = (None, "replay", "lean")
# called here directly: kda_kcp.exchange's all-gather carries the payload (what kda_comm_bytes_kcp counts)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def exchanges(ctx) -> bool:
    """Whether a call on ``ctx`` runs a collective (and so must agree with every rank before it)."""
    return isinstance(ctx, KcpContext) and ctx.world_size > 1 and ctx.plan.needs_exchange


def _scale_bits(scale: float) -> int:
    return struct.unpack("<q", struct.pack("<d", scale))[0]


def _scale_of(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def call_properties(q, k, v, g, beta, do, scale: float, deterministic: bool, workspace, initial_state=None,
                    final_state: bool = False) -> list[int]:
    """The header's property fields of one checked call (``do`` None in the forward; ``initial_state`` and
    ``final_state``: whether the call takes initial states and returns final states, the backward's from its
    forward)."""
    if workspace is None:
        arena, passes = 0, 0
    elif workspace.lean_passes is None:
        arena, passes = 1, 0
    else:
        arena, passes = 2, workspace.lean_passes
    codes = dict(zip(("q", "k", "v", "g", "beta", "do", "initial_state"),
                     (_DTYPE_CODE[x.dtype] if x is not None else 0 for x in (q, k, v, g, beta, do, initial_state))))
    return _properties(local_tokens=q.shape[0], H=q.shape[1], K=q.shape[2], V=v.shape[2], **codes,
                       scale=_scale_bits(scale), deterministic=int(deterministic), arena=arena, lean_passes=passes,
                       final_state=int(final_state))


def _properties(**fields) -> list[int]:
    """The header's property fields in their order: those named, the others 0."""
    unknown = set(fields).difference(_PROPERTY_FIELDS)
    if unknown:
        raise KeyError(f"not property fields of the header: {sorted(unknown)}")
    return [fields.get(name, 0) for name in _PROPERTY_FIELDS]


def layer_properties(qkv, H: int, K: int, V: int, conv_weight, deterministic: bool) -> list[int]:
    """The header's property fields of a KimiDeltaAttention forward (kda_kcp.nn) before its convolution's exchange,
    which all-gathers rows of ``qkv`` [T, H * (2K + V)] (its dtype in the ``q`` field, the convolution weight's in
    ``k``) over as many rows per rank as the convolution's size."""
    return _properties(local_tokens=qkv.shape[0], H=H, K=K, V=V, q=_DTYPE_CODE[qkv.dtype],
                       k=_DTYPE_CODE[conv_weight.dtype], deterministic=int(deterministic),
                       conv_size=conv_weight.shape[-1])


def _exchange_headers(group, world_size: int, header: list[int], error: BaseException | None) -> list[list[int]]:
    """Every rank's header (in the group's rank order). If any rank failed its checks, every rank raises
    the same ValueError with each failing rank's message (this rank's own error chained)."""
    header[_AT["status"]] = 0 if error is None else 1
    out = torch.empty(world_size * len(header), dtype=torch.int64)
    _all_gather(out, torch.frombuffer(bytearray(_PACKED.pack(*header)), dtype=torch.int64), group=group)
    rows = out.view(world_size, len(header)).tolist()
    if any(row[_AT["status"]] for row in rows):
        mine = None if error is None else f"{type(error).__name__}: {error}"
        messages = [None] * world_size
        dist.all_gather_object(messages, mine, group=group)
        failures = "; ".join(
            f"rank {row[_AT['rank']]} ({_KIND_NAMES[row[_AT['kind']]]}): {msg}"
            for row, msg in zip(rows, messages)
            if row[_AT["status"]]
        )
        raise ValueError(f"kda_kcp: a rank failed its checks, so every rank raises: {failures}") from error
    return rows


def _differs(name: str, rows, field, show=str) -> str | None:
    """'name: rank 0 has a, rank 1 has b' when the ranks' values of ``field(row)`` differ, else None."""
    values = [field(row) for row in rows]
    if all(x == values[0] for x in values):
        return None
    return f"{name}: " + ", ".join(f"rank {row[_AT['rank']]} has {show(x)}" for row, x in zip(rows, values))


def _context_problems(rows) -> list[str]:
    """Differences of the ranks' contexts (world size, layout, cu_seqlens)."""
    at = _AT
    docs = slice(at["num_docs"], at["adler32"] + 1)
    problems = [
        _differs("world size", rows, lambda r: r[at["world_size"]]),
        _differs("layout", rows, lambda r: r[at["layout"]], lambda x: repr(LAYOUTS[x])),
        _differs("cu_seqlens", rows, lambda r: tuple(r[docs]), lambda x: f"{x[0]} documents and T = {x[1]}"),
    ]
    if problems[2] is not None and len({(r[at["num_docs"]], r[at["num_tokens"]]) for r in rows}) == 1:
        problems[2] += " (same sizes, different offsets)"
    return [p for p in problems if p is not None]


def _rank_problems(rows, ctx: KcpContext) -> list[str]:
    """Every rank of the plan once, each with its own local token count (a context of another rank fails here)."""
    problems = []
    claimed = [row[_AT["rank"]] for row in rows]
    for r in sorted(set(claimed)):
        holders = [i for i, c in enumerate(claimed) if c == r]
        if len(holders) > 1:
            problems.append(f"group ranks {holders} all run the context of rank {r}")
    for i, row in enumerate(rows):
        want = ctx.rank_tokens[row[_AT["rank"]]]
        if row[_AT["local_tokens"]] != want:
            problems.append(f"group rank {i} has {row[_AT['local_tokens']]} local tokens, its context gives {want}")
    return problems


def _show_dtype(code: int) -> str:
    return str(_DTYPES[code - 1]) if code > 0 else "none"


def _show_workspace(x) -> str:
    arena, passes = x
    if arena == 0:
        return "none"
    return _ARENAS[arena] + (f" ({passes} passes)" if arena == 2 else "")


_LAYER_DTYPES = {"q": "projections", "k": "conv_weight"}  # what a layer's header holds in these fields


def _property_problems(rows, kind: str = "forward") -> list[str]:
    at = _AT
    problems = [_differs(name, rows, lambda r, i=at[name]: r[i]) for name in ("H", "K", "V")]
    problems += [_differs(f"{_LAYER_DTYPES.get(name, name) if kind == 'layer' else name} dtype", rows,
                          lambda r, i=at[name]: r[i], _show_dtype)
                 for name in ("q", "k", "v", "g", "beta", "do")]
    problems += [
        _differs("scale", rows, lambda r: r[at["scale"]], lambda x: repr(_scale_of(x))),
        _differs("deterministic", rows, lambda r: r[at["deterministic"]], lambda x: str(bool(x))),
        _differs("workspace", rows, lambda r: (r[at["arena"]], r[at["lean_passes"]]), _show_workspace),
        _differs("initial_state (dtype, or none)", rows, lambda r: r[at["initial_state"]], _show_dtype),
        _differs("output_final_state", rows, lambda r: r[at["final_state"]], lambda x: str(bool(x))),
        _differs("conv_size", rows, lambda r: r[at["conv_size"]]),
    ]
    return [p for p in problems if p is not None]


def _agree(rows, ctx: KcpContext) -> bool:
    """Whether the headers of one call agree (the common case, checked before any message is made)."""
    first, at = rows[0], _AT
    if sorted(row[at["rank"]] for row in rows) != list(range(len(rows))):
        return False
    return all(
        row[at["kind"]] == first[at["kind"]] and row[_CONTEXT] == first[_CONTEXT] and row[_SHARED] == first[_SHARED]
        and row[at["local_tokens"]] == ctx.rank_tokens[row[at["rank"]]]
        for row in rows
    )


def _raise_on_disagreement(rows, ctx: KcpContext | None) -> None:
    """The same ValueError on every rank when the headers differ (``ctx`` None: build_context_kcp's header)."""
    if ctx is not None and _agree(rows, ctx):
        return
    kinds = [row[_AT["kind"]] for row in rows]
    if len(set(kinds)) > 1:
        where = ", ".join(f"rank {row[_AT['rank']]} in {_KIND_NAMES[k]}" for row, k in zip(rows, kinds))
        raise ValueError(f"kda_kcp: the ranks are in different calls: {where}")
    problems = _context_problems(rows)
    if ctx is None:
        if problems:
            raise ValueError("build_context_kcp: ranks disagree on the context: " + "; ".join(problems))
        return
    what = KINDS[kinds[0]]
    if problems:
        raise ValueError(f"kda_kcp: the ranks run the {what} on different contexts: " + "; ".join(problems))
    problems = _rank_problems(rows, ctx) or _property_problems(rows, what)
    if problems:
        raise ValueError(f"kda_kcp: the ranks' {what} calls disagree: " + "; ".join(problems))


def agree_call(ctx, kind: str, checks, properties, *args):
    """Returns ``checks(*args)``: this rank's local checks of one call, which raise on a bad input and return
    what the call needs from them. When the call exchanges (``exchanges(ctx)``; in the backward ``ctx``
    is the forward's context), an error of the checks is caught instead and agreed with every rank through
    the header, with ``properties(result, *args)`` (``call_properties`` of the checked call): a failure on
    any rank, or a property that differs, raises the same ValueError on every rank. Whatever ``checks``
    raises counts as this rank's failure, so one more local check is one more line in ``checks``."""
    if not exchanges(ctx):
        return checks(*args)
    try:
        result, error = checks(*args), None
        props = properties(result, *args)
    except Exception as exc:  # noqa: BLE001 - any failure of this rank's checks is reported on every rank
        result, error, props = None, exc, [0] * _NUM_PROPERTIES
    header = [KINDS.index(kind), 0, ctx.rank, *ctx.fingerprint, *props]
    _raise_on_disagreement(_exchange_headers(ctx.host_group, ctx.world_size, header, error), ctx)
    return result


def agree_failure(ctx, kind: str, error: BaseException):
    """Raises for ``error``, a failure of this rank's side of a call on ``ctx`` before that call's ``agree_call``
    (an entry's own checks, e.g. its flags, or kda_kcp.chunk_kda's options, shapes and activations): when the call
    exchanges, the failure takes the place of this rank's header in that agreement, so every rank raises the same
    ValueError instead of the other ranks waiting in it; otherwise ``error`` itself."""
    if not exchanges(ctx):
        raise error
    header = [KINDS.index(kind), 0, ctx.rank, *ctx.fingerprint, *[0] * _NUM_PROPERTIES]
    _exchange_headers(ctx.host_group, ctx.world_size, header, error)
    raise error  # not reached: a header with this rank's failure makes every rank raise


def agree_context(group, world_size: int, rank: int, checks, layout: str) -> tuple[list[int], list[int]]:
    """build_context_kcp at W > 1: ``checks()`` (this rank's checks of cu_seqlens, layout and world size;
    returns cu as ints), its error agreed like a call's, then every rank's context compared. Returns
    (cu, its fingerprint)."""
    try:
        cu, error = checks(), None
        context = fingerprint(cu, layout, world_size)
    except Exception as exc:  # noqa: BLE001 - reported on every rank
        cu, error, context = None, exc, [0] * _NUM_CONTEXT
    header = [KINDS.index("context"), 0, rank, *context, *[0] * _NUM_PROPERTIES]
    _raise_on_disagreement(_exchange_headers(group, world_size, header, error), None)
    return cu, context
