"""Train a small byte-level language model of KDA layers on the Python standard library's own source files.

The model: a byte embedding, N blocks of [RMSNorm, kda_kcp.nn.KimiDeltaAttention, RMSNorm, MLP] with residuals, a
final RMSNorm and a head tied to the embedding (--no-tie for its own). The data: every ``*.py`` file of the standard
library (the directory of ``os.py``, without site-packages), one file per document, in a seeded order, each cut to a
seeded window of at most --max-doc-len bytes, packed back to back into batches of exactly --tokens-per-batch tokens
(the last document of a batch is cut to fit), described by cu_seqlens. Each token predicts the next byte of its
own document.

    python examples/train_lm.py --steps 200                                  # one process: GPU if any, else CPU
    torchrun --nproc-per-node 2 examples/train_lm.py --steps 200             # W = 2: NCCL on GPUs, gloo on CPU

Under torchrun every rank builds the same packed batch, a KcpContext over the group, and trains on its shard of
the tokens (context parallelism); the parameter gradients are summed over the ranks. Rank 0 prints progress and
writes ``loss.json`` (the loss of every step) and ``loss.png`` (needs matplotlib) to --out. With --deterministic
(the default) two runs with the same --seed on the same machine give bitwise-identical losses.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import kda_kcp
from kda_kcp.nn import KimiDeltaAttention

IGNORE = -100
# (hidden, layers, heads, head_dim, tokens_per_batch, max_doc_len) when not given
SIZES = {"cuda": (512, 4, 4, 128, 32768, 8192), "cpu": (128, 2, 2, 64, 2048, 1024)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True,
                   help="kda_kcp's deterministic package and torch.use_deterministic_algorithms")
    p.add_argument("--out", type=Path, default=Path("train_lm_out"), help="directory for loss.json and loss.png")
    p.add_argument("--device", default="auto", help="auto (cuda:LOCAL_RANK when CUDA is available, else cpu), cpu, cuda")
    p.add_argument("--hidden", type=int, help="model width (default: 512 on GPUs, 128 on the CPU)")
    p.add_argument("--layers", type=int, help="number of blocks (default: 4 on GPUs, 2 on the CPU)")
    p.add_argument("--heads", type=int, help="KDA heads (default: 4 on GPUs, 2 on the CPU)")
    p.add_argument("--head-dim", type=int, help="KDA head size (default 128 on GPUs, which the CUDA kernels need; 64 on the CPU)")
    p.add_argument("--tokens-per-batch", type=int, help="tokens of one packed batch (default: 32768 on GPUs, 2048 on the CPU)")
    p.add_argument("--max-doc-len", type=int, help="documents are cut to this many bytes (default: 8192 on GPUs, 1024 on the CPU)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=20, help="steps of linear warm-up before the cosine decay")
    p.add_argument("--layout", default="contiguous", choices=kda_kcp.LAYOUTS, help="how a batch is split over the ranks")
    p.add_argument("--tie", action=argparse.BooleanOptionalAction, default=True, help="tie the head to the embedding")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--threads", type=int, help="CPU threads per process (torch.set_num_threads)")
    p.add_argument("--data", type=Path, default=Path(os.__file__).parent,
                   help="directory whose *.py files are the documents (default: the standard library)")
    return p.parse_args(argv)


# ---- data ----

def corpus_files(root: Path) -> list[Path]:
    """Every *.py file under root, sorted, without installed packages (the same list on every rank)."""
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return sorted(p for p in root.glob("**/*.py") if p.is_file() and not skip.intersection(p.parts))


class PackedBatches:
    """Endless packed batches: documents in a seeded order (reshuffled every pass), each a seeded window of at most
    ``max_doc_len`` bytes, filled back to back up to ``tokens`` tokens. Yields (bytes as int64 [T], cu_seqlens)."""

    def __init__(self, files: list[Path], tokens: int, max_doc_len: int, seed: int):
        if not files:
            raise ValueError("no documents: the corpus directory holds no *.py files")
        self.files, self.tokens, self.max_doc_len = files, tokens, max_doc_len
        self.gen = torch.Generator().manual_seed(seed)
        self.order: list[int] = []

    def _next_document(self) -> bytes:
        while True:
            if not self.order:
                self.order = torch.randperm(len(self.files), generator=self.gen).tolist()
            data = self.files[self.order.pop()].read_bytes()
            if len(data) < 2:
                continue
            if len(data) > self.max_doc_len:
                start = int(torch.randint(len(data) - self.max_doc_len + 1, (1,), generator=self.gen))
                data = data[start:start + self.max_doc_len]
            return data

    def __iter__(self):
        return self

    def __next__(self):
        docs, used = [], 0
        while used < self.tokens:
            doc = self._next_document()[: self.tokens - used]
            docs.append(doc)
            used += len(doc)
        cu = [0]
        for d in docs:
            cu.append(cu[-1] + len(d))
        return torch.frombuffer(bytearray(b"".join(docs)), dtype=torch.uint8).long(), cu


def next_byte_targets(tokens: torch.Tensor, cu: list[int]) -> torch.Tensor:
    """targets[t] = tokens[t + 1] inside a document; the last token of each document has none."""
    targets = torch.full_like(tokens, IGNORE)
    targets[:-1] = tokens[1:]
    ends = torch.tensor(cu[1:], dtype=torch.long) - 1
    targets[ends[ends >= 0]] = IGNORE
    return targets


# ---- model ----

class MLP(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, head_dim: int, deterministic: bool):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.attn = KimiDeltaAttention(d, heads, head_dim=head_dim, deterministic=deterministic)
        self.mlp = MLP(d)

    def forward(self, x, ctx):
        x = x + self.attn(self.norm1(x), cp_context=ctx)
        return x + self.mlp(self.norm2(x))


class ByteLM(nn.Module):
    def __init__(self, d: int, layers: int, heads: int, head_dim: int, tie: bool, deterministic: bool):
        super().__init__()
        self.embed = nn.Embedding(256, d)
        nn.init.normal_(self.embed.weight, std=d ** -0.5)
        self.blocks = nn.ModuleList(Block(d, heads, head_dim, deterministic) for _ in range(layers))
        self.norm = nn.RMSNorm(d)
        self.head = None if tie else nn.Linear(d, 256, bias=False)

    def forward(self, tokens: torch.Tensor, ctx) -> torch.Tensor:
        """tokens: this rank's [T_local] bytes of the packed batch ``ctx`` describes; returns logits [T_local, 256]."""
        x = self.embed(tokens)[None]
        for block in self.blocks:
            x = block(x, ctx)
        x = self.norm(x[0])
        return x @ self.embed.weight.T if self.head is None else self.head(x)


# ---- training ----

def setup(args):
    """(device, group or None, rank, world size); joins torchrun's group when launched by it."""
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        use_cuda = args.device != "cpu" and torch.cuda.is_available()
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if use_cuda else "gloo")
    group = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None
    rank, world = (dist.get_rank(), dist.get_world_size()) if group is not None else (0, 1)
    if args.device == "auto":
        device = torch.device("cuda", torch.cuda.current_device() if group is not None else 0) \
            if torch.cuda.is_available() else torch.device("cpu")
    else:
        device = torch.device(args.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    if group is not None and (dist.get_backend(group) == "nccl") != (device.type == "cuda"):
        raise ValueError(f"the process group runs {dist.get_backend(group)} but the model is on {device}")
    return device, group, rank, world


def fill_sizes(args, device) -> None:
    names = ("hidden", "layers", "heads", "head_dim", "tokens_per_batch", "max_doc_len")
    for name, default in zip(names, SIZES["cuda" if device.type == "cuda" else "cpu"]):
        if getattr(args, name) is None:
            setattr(args, name, default)


def learning_rate(args, step: int) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(frac, 1.0))))


def byte_loss(logits: torch.Tensor, targets: torch.Tensor, count: int) -> torch.Tensor:
    """This rank's share of the batch's mean next-byte cross entropy (the shares sum to the mean over the ranks).
    Written with gather: torch's NLL loss has no deterministic CUDA kernel."""
    logp = logits.float().log_softmax(-1)
    picked = logp.gather(1, targets.clamp_min(0)[:, None])[:, 0]
    return -(picked * (targets != IGNORE)).sum() / count


def all_reduce_grads(params, group) -> None:
    """Sum every gradient over the ranks with one collective."""
    for p in params:
        if p.grad is None:  # a parameter this rank's tokens did not reach still takes part in the sum
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def write_results(out: Path, record: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "loss.json").write_text(json.dumps(record, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: wrote {out / 'loss.json'}, no plot (pip install matplotlib for loss.png)")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    losses = record["losses"]
    steps = range(1, len(losses) + 1)
    ax.plot(steps, losses, lw=0.8, alpha=0.4, label="loss of the step")
    smooth, avg = [], 0.0
    for i, x in enumerate(losses):  # exponential moving average over ~10 steps, debiased at the start
        avg = 0.9 * avg + 0.1 * x
        smooth.append(avg / (1 - 0.9 ** (i + 1)))
    ax.plot(steps, smooth, lw=1.6, label="moving average")
    ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    a = record["args"]
    ax.set_title(f"byte-level KDA LM on the Python stdlib: {a['layers']} x {a['hidden']}, W = {record['world_size']}, "
                 f"{record['device']}", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=120)
    plt.close(fig)
    print(f"wrote {out / 'loss.json'} and {out / 'loss.png'}")


def train(args) -> list[float]:
    """Runs the training; returns the loss of every step (on every rank)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device, group, rank, world = setup(args)
    fill_sizes(args, device)
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it for deterministic results
        torch.use_deterministic_algorithms(True)
        # nothing here reads memory it did not write, so the NaN fill of every new tensor would only cost time
        torch.utils.deterministic.fill_uninitialized_memory = False
    torch.manual_seed(args.seed)
    model = ByteLM(args.hidden, args.layers, args.heads, args.head_dim, args.tie, args.deterministic).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    files = corpus_files(args.data)
    batches = PackedBatches(files, args.tokens_per_batch, args.max_doc_len, args.seed)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    if rank == 0:
        n = sum(p.numel() for p in params)
        print(f"byte-level KDA LM: {args.layers} blocks x {args.hidden} wide, {args.heads} heads of {args.head_dim}, "
              f"{n / 1e6:.2f} M parameters; {len(files)} documents from {args.data}; {args.tokens_per_batch} tokens "
              f"per batch; W = {world} ({args.layout}) on {device}; deterministic={args.deterministic}", flush=True)

    losses, pending = [], []
    t_log, tokens_since = time.perf_counter(), 0
    for step in range(args.steps):
        tokens, cu = next(batches)
        targets = next_byte_targets(tokens, cu)
        count = int((targets != IGNORE).sum())
        ctx = kda_kcp.build_context_kcp(cu, group, args.layout)
        local_tokens, local_targets = ctx.shard(tokens).to(device), ctx.shard(targets).to(device)
        for g in opt.param_groups:
            g["lr"] = learning_rate(args, step)
        with autocast:
            logits = model(local_tokens, ctx)
        loss = byte_loss(logits, local_targets, count)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        loss = loss.detach()
        if group is not None:
            all_reduce_grads(params, group)
            dist.all_reduce(loss, group=group)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        pending.append(loss)
        tokens_since += len(tokens)
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            losses += torch.stack(pending).tolist()  # waits for the device here only
            pending = []
            now = time.perf_counter()
            if rank == 0:
                print(f"step {step + 1:5d}  loss {losses[-1]:.4f}  {tokens_since / (now - t_log):10,.0f} tokens/s", flush=True)
            t_log, tokens_since = now, 0
    if rank == 0:
        write_results(args.out, {
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "world_size": world, "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
            "torch": torch.__version__, "losses": losses,
        })
    return losses


def main(argv=None) -> list[float]:
    args = parse_args(argv)
    launched = not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1
    try:
        return train(args)
    finally:
        if launched and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
