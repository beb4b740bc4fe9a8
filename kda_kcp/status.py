"""The value domain, and how values outside it are reported without stopping the host.

The domain: every value of q, k, v, g and beta finite, g in [-5, 0], beta in [0, 2]. Outside it the chunked
math leaves FP32's range (a gate above 0 grows exp(G) without bound; at -5.9 per token the torch backend's
pairwise factors overflow; the CUDA preps' factors, anchored per 16-row block, lose accuracy from about -5.3 and
overflow near -5.85), so no call lets such values pass silently:

* torch backend: ``domain_error`` checks the inputs with torch ops before computing and the call raises
  ``ValueError`` at once (one host synchronization; the slow path).
* CUDA backend: the chunk preps test the values they hold in registers anyway (q and k through the diagonal of
  their products, which also catches finite values so large that those overflow) and OR a bit into one int32 status
  word per device (csrc/kda_status.cuh). After each call's kernels a small kernel sets that call's outputs (and the
  summaries a KCP rank publishes) to NaN if the word is set and stores the word into a slot of mapped pinned host
  memory, behind an event (``finish``: no copy on the stream). At the start of the next call ``pending_error`` polls
  those events (``event.query``, never a synchronization) and the call raises ``ValueError`` naming what was seen.
  ``check_status`` raises at once.

``validate=True`` (kda_kcp.validate.check_values) runs the torch check before any kernel, on either backend.
"""

from __future__ import annotations

import math
from collections import deque

import torch

__all__ = ["G_MIN", "G_MAX", "BETA_MIN", "BETA_MAX", "NONFINITE", "G_ABOVE", "G_BELOW", "BETA_RANGE", "DOMAIN",
           "describe", "domain_error", "word", "fill", "finish", "pending_error", "raise_pending", "check_status"]

G_MIN, G_MAX = -5.0, 0.0
BETA_MIN, BETA_MAX = 0.0, 2.0  # 2: FLA's allow_neg_eigval doubles beta

# the status word's bits (csrc/kda_status.cuh)
NONFINITE, G_ABOVE, G_BELOW, BETA_RANGE = 1, 2, 4, 8
_WHAT = ((NONFINITE, "non-finite q/k/v/g/beta"), (G_ABOVE, "g above 0"), (G_BELOW, "g below -5"),
         (BETA_RANGE, "beta outside [0, 2]"))
DOMAIN = "finite q, k, v, g, beta; g in [-5, 0] (log decay, already activated); beta in [0, 2]"
_DOMAIN_SENTENCE = f"The domain: {DOMAIN}."


def describe(code: int) -> str:
    """The bits of ``code`` in words ("g below -5; beta outside [0, 2]")."""
    parts = [what for bit, what in _WHAT if code & bit]
    if code & ~(NONFINITE | G_ABOVE | G_BELOW | BETA_RANGE):
        parts.append(f"unknown status bits {code:#x}")
    return "; ".join(parts)


def domain_error(q, k, v, g, beta) -> str | None:
    """The torch check of the domain (reductions only, one host synchronization): a message naming what lies outside
    it (which tensors, their ranges), or None. The same predicate as the CUDA preps' status bits."""
    named = (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta))
    ends = [e for _, x in named for e in ((x.amin(), x.amax()) if x.numel() else (x.new_zeros(()),) * 2)]
    vals = torch.stack([e.double() for e in ends]).tolist()  # min and max propagate NaN
    rng = {name: (vals[2 * i], vals[2 * i + 1]) for i, (name, _) in enumerate(named)}
    problems = []
    bad = [name for name, (lo, hi) in rng.items() if not (math.isfinite(lo) and math.isfinite(hi))]
    if bad:
        problems.append(f"{describe(NONFINITE)}: {', '.join(bad)} hold{'s' if len(bad) == 1 else ''} non-finite values "
                        "(NaN or Inf)")
    (glo, ghi), (blo, bhi) = rng["g"], rng["beta"]
    if "g" not in bad and ghi > G_MAX:
        problems.append(f"{describe(G_ABOVE)}: g must lie in [-5, 0], its largest value is {ghi:g}")
    if "g" not in bad and glo < G_MIN:
        problems.append(f"{describe(G_BELOW)}: g must lie in [-5, 0], its smallest value is {glo:g}")
    if "beta" not in bad and (blo < BETA_MIN or bhi > BETA_MAX):
        problems.append(f"{describe(BETA_RANGE)}: beta must lie in [0, 2], got range [{blo:g}, {bhi:g}]")
    if not problems:
        return None
    return f"kda_kcp: input values outside the domain: {'; '.join(problems)}. {_DOMAIN_SENTENCE}"


# ---- the CUDA backend's status word ----
_SLOTS = 8  # copies in flight per device (the host runs a call or two ahead of the GPU)
_FILL_SLOTS = 5  # the outputs one status_fill takes (csrc/kda_status.cuh kFillSlots)


class _Status:
    """One device's status word, its pinned host slots and the copies in flight."""

    def __init__(self, device: torch.device):
        self.device = device
        self.word = torch.zeros(1, dtype=torch.int32, device=device)
        self.none = torch.empty(0, dtype=torch.float32, device=device)  # status_fill's unused slots
        self.no_report = torch.empty(0, dtype=torch.int32)  # status_fill without a host slot
        self.cuda = device.type == "cuda"
        self.mapped = self.cuda  # False once the binding refused a slot: the word is then copied (``_copy``)
        self.host = torch.zeros(_SLOTS, dtype=torch.int32, pin_memory=self.cuda)
        self.host_view = self.host.numpy()
        self.slots = [self.host[i:i + 1] for i in range(_SLOTS)]
        self.events = [torch.cuda.Event() for _ in range(_SLOTS)] if self.cuda else []
        self.free = list(range(_SLOTS))
        self.pending: deque = deque()  # [slot, counts] in issue order; counts False once the word was reset after it

    def reset(self) -> None:
        """The word zeroed on the current stream; copies issued before it no longer count."""
        self.word.zero_()
        for p in self.pending:
            p[1] = False

    def completed(self) -> int:
        """The OR of the copies that have landed (their slots freed), without waiting for any."""
        code = 0
        while self.pending and self.events[self.pending[0][0]].query():
            slot, counts = self.pending.popleft()
            if counts:
                code |= int(self.host_view[slot])
            self.free.append(slot)
        return code


_STATUS: dict = {}


def _key(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _status(device) -> _Status:
    st = _STATUS.get(device)  # a device with its index, as the calls pass it (the others are normalized first)
    if st is None:
        key = _key(device)
        st = _STATUS.get(key)
        if st is None:
            st = _STATUS[key] = _Status(key)
    return st


def word(device) -> torch.Tensor:
    """The status word of ``device`` (int32 [1], made at the first use: CudaBackend.load makes it before a call, so
    never inside a CUDA graph capture). The preps take it; off CUDA (the CPU emulation of the kernels) a CPU tensor."""
    return _status(device).word


def _capturing(st: _Status) -> bool:
    return st.cuda and torch.cuda.is_current_stream_capturing()


def fill(mod, device, *outputs) -> None:
    """Before a KCP rank publishes its summaries: every output (bf16 or fp32, at most 5) set to NaN on the current
    stream if the word is set, by the program ``mod``'s status_fill. A tiny kernel whose CTAs end after one load
    when the word is zero."""
    st = _status(device)
    mod.status_fill(st.word, st.no_report, *outputs, *(st.none,) * (_FILL_SLOTS - len(outputs)))


def finish(mod, device, *outputs) -> None:
    """After a call's kernels: ``fill`` of its outputs, and the word stored into a free pinned host slot by the same
    kernel, with an event recorded after it that ``pending_error`` polls. No slot while a CUDA graph is being
    captured, nor when every slot is in flight (the word stays set, so a later call's slot sees it). Where the
    binding refuses the slot (pinned memory not mapped into the device's address space) the word is copied to the
    slot instead, for the rest of the process."""
    st = _status(device)
    if not st.cuda or _capturing(st) or not st.free:
        fill(mod, device, *outputs)
        return
    slot = st.free.pop()
    try:
        if st.mapped:
            try:
                mod.status_fill(st.word, st.slots[slot], *outputs, *(st.none,) * (_FILL_SLOTS - len(outputs)))
            except ValueError as e:
                if "status report slot" not in str(e):
                    raise
                st.mapped = False  # (the binding checks the slot before it launches anything)
        if not st.mapped:
            fill(mod, device, *outputs)
            st.slots[slot].copy_(st.word, non_blocking=True)  # on the word's device's current stream, as the event
    except BaseException:
        st.free.append(slot)
        raise
    st.events[slot].record(torch.cuda.current_stream(st.device))
    st.pending.append([slot, True])


def _message(code: int, device, issued: str) -> str:
    # the preps check q and k through their products (csrc/kda_chunk_prep.cuh lq_blocks): finite values so large
    # that those overflow are reported as non-finite too
    products = (" (non-finite: a NaN or Inf, or q and k so large that a chunk's products overflow)"
                if code & NONFINITE else "")
    return (f"kda_kcp: {issued} on {device} read input values outside the domain ({describe(code)}): its outputs were "
            f"set to NaN, and so were those of any call issued after it up to this check.{products} "
            f"{_DOMAIN_SENTENCE} validate=True checks each call's inputs before it runs (one host synchronization).")


def pending_error(device) -> str | None:
    """The start of a call on ``device``: the message of a set status word that a completed copy shows (the word is
    reset then), or None. Never waits: a copy still in flight is looked at by a later call."""
    st = device if isinstance(device, _Status) else _STATUS.get(device) or _STATUS.get(_key(device))
    if st is None or _capturing(st):
        return None
    code = st.completed() if st.cuda else int(st.word[0])  # (off CUDA the emulated kernels ran synchronously)
    if code == 0:
        return None
    st.reset()
    return _message(code, st.device, "a call issued earlier")


def raise_pending(device) -> None:
    """``pending_error`` as a ValueError."""
    msg = pending_error(device)
    if msg is not None:
        raise ValueError(msg)


def check_status(synchronize: bool = True) -> None:
    """Raise ValueError if any call so far read values outside the domain (on any device), and reset the status.
    ``synchronize``: wait for the work issued on each device first (else only the copies that have landed count)."""
    msgs = []
    for st in list(_STATUS.values()):
        if _capturing(st):
            continue
        if synchronize:
            if st.cuda:
                torch.cuda.synchronize(st.device)
            code = st.completed() | int(st.word[0])
            if code:
                st.reset()
                msgs.append(_message(code, st.device, "a call"))
        else:
            msg = pending_error(st)
            if msg is not None:
                msgs.append(msg)
    if msgs:
        raise ValueError("\n".join(msgs))
