"""A GPT language model trained the way scripts written for a 16 GB card are: small micro-batches (--batch-size),
gradient accumulation over --accum of them, the loss divided by --accum, the optimizer stepping every --accum
batches of the DataLoader. No dropout (pretraining). Random tokens, no download.

    python bench/scripts/gpt_accum.py --device cuda --n-layer 12 --n-embd 768 --block-size 512 --batch-size 4 --accum 16
"""

import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab, block_size, n_layer, n_embd, n_head):
        super().__init__()
        self.tok = nn.Embedding(vocab, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class RandomTokens(Dataset):
    def __init__(self, count, block_size, vocab):
        generator = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, vocab, (count, block_size + 1), generator=generator)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i, :-1], self.data[i, 1:]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--accum", type=int, default=16)
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps")
    args = parser.parse_args()

    torch.manual_seed(0)
    data = RandomTokens(4096, args.block_size, args.vocab)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, generator=torch.Generator().manual_seed(0))
    model = GPT(args.vocab, args.block_size, args.n_layer, args.n_embd, args.n_head).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)

    steps, start = 0, time.perf_counter()
    for i, (x, y) in enumerate(loader):
        x, y = x.to(args.device), y.to(args.device)
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)) / args.accum
        loss.backward()
        if (i + 1) % args.accum == 0:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            steps += 1
            if steps == args.steps:
                break
    elapsed = time.perf_counter() - start
    print(f"{steps} steps, {steps / elapsed:.2f} steps/s, loss {loss.item() * args.accum:.4f}, "
          f"ln(vocab) {math.log(args.vocab):.4f}")


if __name__ == "__main__":
    main()
