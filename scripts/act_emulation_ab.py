#!/usr/bin/env python
"""The fused activations (csrc/kda_act.cu) of this tree against those of a git ref, bitwise, on the CPU emulation:
both compiled with g++ as tests/test_activations_emulation.py compiles them (each tree with its own emulation headers
and driver), then run on the same inputs over many configurations: raw dtypes (bf16 / fp32 for q and k, g, beta),
every gate form with and without A_log / dt_bias, the beta sigmoid (beta_scale 1, 2) or none, the norm on or off,
GVA (HV = 2 H), token counts that end inside a 64-token item, inputs with NaN and Inf and extreme gates. Every
output of both kernels is compared as raw bytes (buffers pre-filled alike, so a stray or missing write shows too).

    python scripts/act_emulation_ab.py              # this tree against main
    python scripts/act_emulation_ab.py --ref HEAD~1

Prints one line per differing configuration and the counts; exit status 1 if any differ beyond NaN payloads. A NaN's
sign and payload are not compared: x86 propagates one operand's NaN (and g++ may swap the operands of an addition)
or makes a negative default NaN, while the GPU's FP32 and bf16 arithmetic returns one canonical NaN, so two kernels
that add the same values in the same order can still disagree there on the CPU only. Those configurations are
counted apart.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from test_kernel_emulation import _emulated  # noqa: E402  (the launch and shared-memory mapping of the emulation)

BF16, F32 = torch.bfloat16, torch.float32
_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_INPUTS = [_P, _P, _I, _P, _I, _P, _I, _P, _P, _I64, _I, _I, _I, _F, _F]
SOFTPLUS, BOUNDED_RATE, BOUNDED = 0, 1, 2  # csrc/kda_act.h GateForm
# name: (form, with A_log, with dt_bias, lower_bound)
GATES = {"softplus": (SOFTPLUS, True, True, 0.0), "softplus_no_bias": (SOFTPLUS, True, False, 0.0),
         "bounded_rate": (BOUNDED_RATE, True, True, -5.0), "bounded_rate_no_bias": (BOUNDED_RATE, True, False, -3.0),
         "bounded": (BOUNDED, False, True, -5.0), "bounded_no_bias": (BOUNDED, False, False, -1.5)}


def build(src: Path, out: Path) -> ctypes.CDLL:
    """kda_act.cu of the tree at ``src`` (csrc/, tests/emulation/) as an emulated library in ``out``."""
    inc = out / "inc"
    inc.mkdir(parents=True)
    for f in ("cuda_runtime.h", "cuda_bf16.h", "cuda_fp16.h", "kda_common.cuh"):
        shutil.copy(src / "tests" / "emulation" / f, inc / f)
    unit = out / "kda_act_emu.cpp"
    unit.write_text(_emulated((src / "csrc" / "kda_act.cu").read_text()))
    lib = out / "libkda_act_emu.so"
    subprocess.run(["g++", "-std=c++20", "-O2", "-pthread", "-fPIC", "-shared", f"-I{inc}", f"-I{src / 'csrc'}",
                    "-x", "c++", str(unit), str(src / "tests" / "emulation" / "act_driver.cpp"), "-o", str(lib)],
                   check=True)
    so = ctypes.CDLL(str(lib))
    so.e_act_fwd.argtypes = _INPUTS + [_P] * 6
    so.e_act_bwd.argtypes = _INPUTS + [_P] * 12
    return so


def checkout(ref: str, out: Path) -> Path:
    """csrc/ and tests/emulation/ of ``ref`` under ``out``."""
    out.mkdir(parents=True)
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "csrc", "tests/emulation"], check=True,
                         capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=tar, check=True)
    return out


def _p(t):
    return ctypes.c_void_p(t.data_ptr() if t is not None and t.numel() else 0)


def _code(t):
    return int(t is not None and t.dtype == F32)  # csrc/kda_act.h Dtype


def _filled(shape, dtype):
    """An output buffer, every byte 0xA5 (a NaN pattern in bf16 and fp32): the same in both runs."""
    t = torch.empty(shape, dtype=dtype)
    t.view(torch.uint8).fill_(0xA5)
    return t


def case(cfg, seed):
    """Inputs of one configuration: the raw tensors (None where off), A_log, dt_bias and the gradients the backward
    reads. With ``nan``, NaN and Inf in the raw inputs and the gradients; the gates always include values past the
    softplus threshold and far below zero (the sigmoid's 1 + exp(-x) overflowing)."""
    N, H, HV = cfg["N"], cfg["H"], cfg["HV"]
    qk_dt, g_dt, b_dt = cfg["dtypes"]
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    x = dict(q=None, k=None, g=None, beta=None, A_log=None, dt_bias=None)
    if cfg["norm"]:
        x["q"], x["k"] = ((randn(N, H, 128) * 3).to(qk_dt) for _ in range(2))
        x["q"][0, 0] = 0  # a zero row: the norm's epsilon alone
    if cfg["gate"] is not None:
        form, with_a, with_dt, _ = GATES[cfg["gate"]]
        g = 1.5 * randn(N, HV, 128)
        g.view(-1)[:: 37] = 25.0
        g.view(-1)[5:: 41] = -95.0
        g.view(-1)[9:: 43] = 1e-40
        x["g"] = g.to(g_dt)
        x["A_log"] = torch.rand(HV, generator=gen) * 2 - 1 if with_a else None
        x["dt_bias"] = 0.5 * randn(HV * 128) if with_dt else None
    if cfg["beta"] is not None:
        beta = 2 * randn(N, HV)
        beta.view(-1)[:: 13] = -120.0
        x["beta"] = beta.to(b_dt)
    grads = dict(dqn=randn(N, HV, 128).to(BF16), dkn=randn(N, HV, 128).to(BF16), dg_out=randn(N, HV, 128),
                 dbeta_out=randn(N, HV).to(BF16))
    if cfg["nan"]:
        for t in (x["q"], x["k"], x["g"], x["beta"], grads["dqn"], grads["dg_out"], grads["dbeta_out"]):
            if t is not None:
                flat = t.view(-1)
                flat[int(torch.randint(flat.numel(), (1,), generator=gen))] = float("nan")
                flat[int(torch.randint(flat.numel(), (1,), generator=gen))] = float("inf")
                flat[int(torch.randint(flat.numel(), (1,), generator=gen))] = float("-inf")
    return x, grads


def run(so, cfg, x, grads, r_in=None):
    """Both kernels of ``so`` on one configuration: {name: output tensor}. ``r_in``: the inverse norms the backward
    reads (default: this forward's)."""
    N, H, HV = cfg["N"], cfg["H"], cfg["HV"]
    form, lb = (GATES[cfg["gate"]][0], GATES[cfg["gate"]][3]) if cfg["gate"] is not None else (0, 0.0)
    bs = 2.0 if cfg["beta"] == 2 else 1.0
    inputs = (_p(x["q"]), _p(x["k"]), _code(x["q"]), _p(x["g"]), _code(x["g"]), _p(x["beta"]), _code(x["beta"]),
              _p(x["A_log"]), _p(x["dt_bias"]), N, H, HV, form, lb, bs)
    items = -(-N // 64)
    norm, gate, beta = x["q"] is not None, x["g"] is not None, x["beta"] is not None
    out = {}
    if norm:
        out.update(qn=_filled((N, HV, 128), BF16), kn=_filled((N, HV, 128), BF16), rq=_filled((N, H), F32),
                   rk=_filled((N, H), F32))
    if gate:
        out["g_act"] = _filled((N, HV, 128), F32)
    if beta:
        out["beta_act"] = _filled((N, HV), BF16)
    assert so.e_act_fwd(*inputs, *(_p(out.get(n)) for n in ("qn", "kn", "rq", "rk", "g_act", "beta_act"))) == 0
    rq, rk = r_in if r_in is not None else (out.get("rq"), out.get("rk"))
    bwd = {}
    if norm:
        bwd.update(dq=_filled(x["q"].shape, x["q"].dtype), dk=_filled(x["k"].shape, x["k"].dtype))
    if gate:
        bwd["dg"] = _filled(x["g"].shape, x["g"].dtype)
        if x["A_log"] is not None:
            bwd["part_a"] = _filled((items, HV), F32)
        if x["dt_bias"] is not None:
            bwd["part_dt"] = _filled((items, HV, 128), F32)
    if beta:
        bwd["dbeta"] = _filled(x["beta"].shape, x["beta"].dtype)
    assert so.e_act_bwd(*inputs, _p(rq), _p(rk), _p(grads["dqn"] if norm else None),
                        _p(grads["dkn"] if norm else None), _p(grads["dg_out"] if gate else None),
                        _p(grads["dbeta_out"] if beta else None),
                        *(_p(bwd.get(n)) for n in ("dq", "dk", "dg", "dbeta", "part_a", "part_dt"))) == 0
    out.update(bwd)
    return out


def configurations():
    """Every raw dtype triple x gate (or none) x beta (none, scale 1, scale 2) x clean / NaN inputs with the norm on,
    and each activation alone per dtype triple; the head counts and token counts cycle through their lists."""
    heads = [(1, 1), (2, 4), (3, 3), (2, 2), (1, 2)]
    tokens = [1, 35, 64, 70, 131, 200, 63, 129]
    dtypes = list(itertools.product((BF16, F32), repeat=3))
    rows = [dict(dtypes=d, norm=True, gate=g, beta=b, nan=n)
            for d, g, b, n in itertools.product(dtypes, [None, *GATES], [None, 1, 2], [False, True])]
    rows += [dict(dtypes=d, norm=norm, gate=g, beta=b, nan=n)
             for d, (norm, g, b), n in itertools.product(
                 dtypes, [(True, None, None), (False, "softplus", None), (False, "bounded", None), (False, None, 2),
                          (False, "bounded_rate", 1)], [False, True])]
    for i, cfg in enumerate(rows):
        cfg["H"], cfg["HV"] = heads[i % len(heads)]
        cfg["N"] = tokens[(i // len(heads)) % len(tokens)]
    return rows


def _bits(t, canonical_nan=False):
    """The tensor's bytes; with ``canonical_nan`` every NaN as one pattern first."""
    if canonical_nan and t.is_floating_point():
        t = torch.where(t.isnan(), torch.full_like(t, float("nan")), t)
    return t.view(torch.uint8)


def describe(cfg):
    name = {BF16: "bf16", F32: "fp32"}
    return (f"qk/g/beta {'/'.join(name[d] for d in cfg['dtypes'])} norm={int(cfg['norm'])} gate={cfg['gate']} "
            f"beta={cfg['beta']} H={cfg['H']} HV={cfg['HV']} N={cfg['N']} nan={int(cfg['nan'])}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref", default="main", help="git ref of the baseline kernels (default: main)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="act_ab_") as tmp:
        tmp = Path(tmp)
        base = build(checkout(args.ref, tmp / "ref"), tmp / "ref_build")
        new = build(ROOT, tmp / "new_build")
        cfgs = configurations()
        equal = nan_payload = 0
        for i, cfg in enumerate(cfgs):
            x, grads = case(cfg, seed=i)
            a = run(base, cfg, x, grads)
            b = run(new, cfg, x, grads, r_in=(a.get("rq"), a.get("rk")))
            if all(torch.equal(_bits(a[n]), _bits(b[n])) for n in a):
                equal += 1
                continue
            differ = [n for n in a if not torch.equal(_bits(a[n], True), _bits(b[n], True))]
            if differ:
                print(f"DIFFERS: {describe(cfg)}: {', '.join(differ)}")
            else:
                nan_payload += 1
        print(f"{args.ref} against this tree, every output of act_fwd and act_bwd: {equal} of {len(cfgs)} "
              f"configurations bitwise equal, {nan_payload} equal but for NaN signs / payloads, "
              f"{len(cfgs) - equal - nan_payload} differ")
    return 0 if equal + nan_payload == len(cfgs) else 1


if __name__ == "__main__":
    sys.exit(main())
