#!/usr/bin/env python
"""How long torch.autograd.grad takes to reach a custom Function's backward, for Functions with no work in them,
shaped like kda_kcp's (two nodes, an expanded placeholder between them) or one node, on the benchmark batch's
tensors. It separates torch's and the machine's share of the host latency (scripts/host_gap.py) from ours:

    python scripts/autograd_entry.py --heads 4                  # GPU idle when the timed call starts
    python scripts/autograd_entry.py --heads 4 --spin-ms 3      # a 3 ms GPU spin before the synchronize

With --spin-ms the synchronize before each timed call waits on the GPU, as the benchmark's does after the previous
iteration's work; session 17 measured the host 3-4x slower after such a wait (NOTES.md).
"""

import argparse
import statistics
import time

import torch

ENTRY: list = []


class TwoInputs(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q, k, v, g, beta, expand):
        fctx.save_for_backward(q, k, v, g, beta)
        return q.new_empty(()).expand(q.shape[0], q.shape[1], v.shape[2]) if expand else torch.empty_like(v)

    @staticmethod
    def backward(fctx, do):
        ENTRY.append(time.perf_counter())
        return (*(torch.empty_like(t) for t in fctx.saved_tensors), None)


class TwoOutput(torch.autograd.Function):
    @staticmethod
    def forward(fctx, placeholder):
        return torch.empty(placeholder.shape, dtype=placeholder.dtype, device=placeholder.device)

    @staticmethod
    def backward(fctx, do):
        ENTRY.append(time.perf_counter())
        return do


class One(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q, k, v, g, beta):
        fctx.save_for_backward(q, k, v, g, beta)
        return torch.empty_like(v)

    @staticmethod
    def backward(fctx, do):
        ENTRY.append(time.perf_counter())
        return tuple(torch.empty_like(t) for t in fctx.saved_tensors)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--tokens", type=int, default=261392)
    p.add_argument("--spin-ms", type=float, default=0.0, help="GPU spin before each synchronize")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    dev = torch.device("cuda")
    T, H, D = args.tokens, args.heads, 128
    x = tuple(torch.randn(T, H, D, device=dev, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    x += (torch.rand(T, H, D, device=dev).requires_grad_(), torch.rand(T, H, device=dev, dtype=torch.bfloat16).requires_grad_())
    do = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
    spin = 0
    if args.spin_ms > 0:  # cycles of torch.cuda._sleep that last ~spin-ms
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)
        a.record()
        torch.cuda._sleep(1_000_000)
        b.record()
        b.synchronize()
        spin = int(1_000_000 * args.spin_ms / a.elapsed_time(b))
    variants = {
        "two nodes, expanded placeholder": lambda: TwoOutput.apply(TwoInputs.apply(*x, True)),
        "two nodes, real placeholder": lambda: TwoOutput.apply(TwoInputs.apply(*x, False)),
        "one node": lambda: One.apply(*x),
    }
    print(f"H = {H}, GPU spin before the synchronize: {args.spin_ms} ms; medians of {args.iters} (us after the call)")
    for name, fwd in variants.items():
        for threads in (True, False):
            first, last, ret = [], [], []
            for i in range(args.iters + 5):
                o = fwd()
                if spin:
                    torch.cuda._sleep(spin)
                torch.cuda.synchronize()
                ENTRY.clear()
                t0 = time.perf_counter()
                with torch.autograd.set_multithreading_enabled(threads):
                    gr = torch.autograd.grad(o, x, do)
                t1 = time.perf_counter()
                if i >= 5:
                    first.append(ENTRY[0] - t0)
                    last.append(ENTRY[-1] - t0)
                    ret.append(t1 - t0)
                del gr, o
            med = [1e6 * statistics.median(v) for v in (first, last, ret)]
            print(f"  {name:32s} autograd threads {'on ' if threads else 'off'}: first backward {med[0]:6.1f}, "
                  f"last backward {med[1]:6.1f}, grad() returns {med[2]:6.1f}")


if __name__ == "__main__":
    main()
