#!/usr/bin/env python
"""o and every gradient of one det CUDA step on the benchmark batch, saved or compared bitwise: the check that a
kernel change which should not touch the arithmetic does not (an A/B between builds, scripts/ab_builds.sh, or
between checkouts with --checkout).

    python scripts/bitwise_builds.py save /tmp/ref.pt --heads 16     # with build A's .so files in place
    python scripts/bitwise_builds.py cmp /tmp/ref.pt --heads 16      # with build B's: one line per tensor

--activations steps kda_kcp.chunk_kda with every in-call activation on instead (the benchmark's --activations row:
raw q, k, v, g, beta, the q / k norm, the gate with A_log, dt_bias and lower_bound -5, the beta sigmoid; --gate
softplus: FLA's default gate, -exp(A_log) softplus(g + dt_bias), no lower_bound), so the fused activations (program
kda_act) are in the step, and saves or compares the gradients of A_log and dt_bias too. --checkout DIR imports
kda_kcp (and so its programs) from DIR, e.g. a baseline tree for the save and this one for the compare:

    python scripts/bitwise_builds.py save /tmp/act.pt --heads 16 --activations --checkout /path/to/base
    python scripts/bitwise_builds.py cmp /tmp/act.pt --heads 16 --activations

--gates strong draws g uniformly in [-5, 0) (the benchmark's strong law), where every chunk takes the kernels'
per-block anchor path; cmp prints each tensor's relative distance when it is not bitwise equal.

--workspace runs the step through a WorkspaceKcp (the benchmark's call) three times on one workspace, checks the
three agree and saves or compares the last: a change to the host path (the carves and views a workspace keeps, the
streams of the launches) is checked bitwise the same way.
"""

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
NAMES = ("o", "dq", "dk", "dv", "dg", "dbeta")
ACT_NAMES = NAMES + ("dA_log", "ddt_bias")


def step(H, docs, gates="bench"):
    from profile_step import run_step

    torch.manual_seed(0)
    return dict(zip(NAMES, run_step(docs, H, gates=gates)))


def workspace_step(H, docs, gates="bench", calls=3):
    """``step``'s inputs through the benchmark's call (a WorkspaceKcp), the step run ``calls`` times on the same
    workspace (a later call gets the carves and views the workspace keeps); every call's results must be equal, and
    the last call's are returned."""
    import kda_kcp
    from profile_step import step_inputs

    torch.manual_seed(0)
    dev = torch.device("cuda")
    cu, *inputs = step_inputs(docs, H, dev, gates)
    x = tuple(t.requires_grad_() for t in inputs)
    ctx = kda_kcp.build_context_kcp(torch.tensor(cu, device=dev))
    ws = kda_kcp.WorkspaceKcp(ctx, H, device=dev)
    do = None
    results = []
    for _ in range(calls):
        o = kda_kcp.chunk_kda_kcp(*x, ctx, workspace=ws)
        do = torch.randn_like(o) if do is None else do  # (drawn after the first o, as run_step draws it)
        results.append((o.detach(), *torch.autograd.grad(o, x, do)))
    for res in results[1:]:
        if not all(torch.equal(a, b) for a, b in zip(res, results[0])):
            raise SystemExit("the calls on one workspace differ from each other")
    return dict(zip(NAMES, results[-1]))


def activations_step(H, docs, gate):
    """One det forward + backward of kda_kcp.chunk_kda with the benchmark's --activations call and inputs (gate
    "bench"), or with FLA's default softplus gate (gate "softplus": no lower_bound, no safe_gate)."""
    import kda_kcp
    from bench_kda_kcp import ACTIVATION_OPTIONS, draw_inputs
    from profile_step import offsets

    dev = torch.device("cuda")
    cu = offsets(docs)
    options = dict(ACTIVATION_OPTIONS)
    if gate == "softplus":
        options.update(lower_bound=None, safe_gate=False)
    q, k, v, g, beta, do, A_log, dt_bias = draw_inputs(cu[-1], H, 128, dev, 0, activations=True)
    x = tuple(t.requires_grad_() for t in (q, k, v, g, beta, A_log, dt_bias))
    cu_t = torch.tensor(cu, device=dev)
    o, _ = kda_kcp.chunk_kda(*(t[None] for t in x[:5]), A_log=x[5], dt_bias=x[6], cu_seqlens=cu_t,
                             cu_seqlens_cpu=cu_t.cpu(), deterministic=True, **options)
    grads = torch.autograd.grad(o, x, do[None])
    return dict(zip(ACT_NAMES, (o.detach()[0], *grads)))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("save", "cmp"))
    p.add_argument("path")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--docs", nargs="+", type=int, default=None, help="document lengths (default: the benchmark's)")
    p.add_argument("--activations", action="store_true",
                   help="kda_kcp.chunk_kda with every in-call activation on; A_log's and dt_bias' gradients too")
    p.add_argument("--gate", choices=("bench", "softplus"), default="bench",
                   help="with --activations: the benchmark row's gate (lower_bound -5) or FLA's softplus gate")
    p.add_argument("--gates", choices=("bench", "strong"), default="bench",
                   help="the benchmark's gate law for g (strong: uniform in [-5, 0), every chunk on the prep's "
                        "per-block anchors); not with --activations")
    p.add_argument("--checkout", default=None, metavar="DIR", help="import kda_kcp from DIR (default: this tree)")
    p.add_argument("--workspace", action="store_true",
                   help="the step through a WorkspaceKcp (the benchmark's call), three times on one workspace")
    args = p.parse_args()
    if args.activations and args.gates != "bench":
        p.error("--gates applies to the plain step; --activations draws its own raw gates (see --gate)")
    # kda_kcp first, from the checkout asked for: profile_step and the benchmark then find it imported
    sys.path.insert(0, str(Path(args.checkout).resolve() if args.checkout else ROOT))
    import kda_kcp

    sys.path.insert(1, str(ROOT / "scripts"))
    sys.path.insert(2, str(ROOT / "benchmarks"))
    from profile_step import DOCS

    docs = args.docs or list(DOCS)
    print(f"kda_kcp from {Path(kda_kcp.__file__).resolve().parent}")
    if args.activations:
        res = activations_step(args.heads, docs, args.gate)
    else:
        res = (workspace_step(args.heads, docs, args.gates) if args.workspace
               else step(args.heads, docs, args.gates))
    names = tuple(res)
    if args.mode == "save":
        torch.save({n: t.cpu() for n, t in res.items()}, args.path)
        print(f"saved {', '.join(names)} to {args.path}")
        return 0
    ref = torch.load(args.path)
    differ = 0
    for n, t in res.items():
        if n not in ref:
            print(f"{n}: not in {args.path}")
            differ += 1
            continue
        r = ref[n].to(t.device)
        same = torch.equal(t, r)
        differ += not same
        rel = ((t.float() - r.float()).norm() / r.float().norm().clamp_min(1e-30)).item()
        print(f"{n}: {'bitwise equal' if same else 'DIFFERS'} (rel {rel:.2e})")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
