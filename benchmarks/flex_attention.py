"""FlexAttention against the SDPA kernels on packed shared-prefix rows, and what compiling
it costs over rows of varying length (docs/attention.md quotes these figures).

1. Kernel time, forward (and forward + backward where the device has it: FlexAttention
   has no backward on CPU): the SDPA pieces (``trainer/attention_pieces.py``), SDPA
   under the layout's dense mask, FlexAttention eager, and compiled where asked.
2. Compile policy over ``--lengths`` rows (groups of 8 of random lengths): compile time
   and the number of graphs compiled for ``torch.compile(flex_attention)`` with
   static shapes at each exact length, static shapes at lengths bucketed to 128 (the
   trainer pads rows to whole blocks), and ``dynamic=True``; a failure is printed.

    .venv/bin/python benchmarks/flex_attention.py [--device cuda] [--rows 6] [--heads 14,2,64]
"""

from __future__ import annotations

import argparse
import time
import traceback

import torch
import torch.nn.functional as F

from trainer.attention_flex import padded_row_length, row_block_mask
from trainer.attention_pieces import pieces_attention, plan_pieces
from trainer.row_layout import RowLayout


def shared_prefix_row(num_tokens: int, gen: torch.Generator, group: int = 8,
                      prompt: int = 64) -> RowLayout:
    """Groups of ``group`` responses after one ``prompt``, until ~``num_tokens``."""
    lengths, starts, heads, total = [], [], [], 0
    while total < num_tokens:
        head = len(lengths)
        for j in range(group):
            response = int(torch.randint(8, 96, (1,), generator=gen))
            lengths.append(prompt + response)
            starts.append(0 if j == 0 else prompt - 1)
            heads.append(head)
            total += response + (prompt if j == 0 else 1)
    return RowLayout.build(torch.tensor(lengths), starts_N=torch.tensor(starts),
                           heads_N=torch.tensor(heads))


def timed(fn, repeats: int = 3) -> float:
    fn()  # warm up
    best = float("inf")
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def kernels(layout: RowLayout, heads: tuple[int, int, int], device: str, dtype: torch.dtype,
            compiled: bool) -> None:
    from torch.nn.attention.flex_attention import flex_attention

    hq, hkv, dim = heads
    n = len(layout.slot_T)
    layout = layout.to(device)
    backward = device != "cpu"
    q = torch.randn(1, hq, n, dim, device=device, dtype=dtype, requires_grad=backward)
    k, v = (torch.randn(1, hkv, n, dim, device=device, dtype=dtype, requires_grad=backward)
            for _ in "kv")
    pieces = plan_pieces(layout)
    mask = layout.dense_mask()
    block_mask = row_block_mask(layout)
    pad = padded_row_length(n) - n
    qp, kp, vp = (F.pad(x.detach(), (0, 0, 0, pad)).requires_grad_(backward) for x in (q, k, v))
    flex = torch.compile(flex_attention, dynamic=True) if compiled else flex_attention
    runs = {
        "sdpa pieces": lambda: pieces_attention(q, k, v, pieces, 0.0, None),
        "sdpa dense mask": lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=True),
        f"flex {'compiled' if compiled else 'eager'}": lambda: flex(
            qp, kp, vp, block_mask=block_mask, enable_gqa=True),
    }
    print(f"row of {n} tokens, {len(layout.lengths_N)} samples, heads {hq}/{hkv}x{dim}, "
          f"{dtype}, {device}; BlockMask built in "
          f"{timed(lambda: row_block_mask(layout)) * 1e3:.1f} ms")
    base = None
    for name, fn in runs.items():
        def step(fn=fn) -> None:
            out = fn()
            if backward:
                out.sum().backward()
        grad = torch.enable_grad() if backward else torch.no_grad()
        with grad:
            seconds = timed(step)
        base = base or seconds
        print(f"  {name:<18} {'fwd+bwd' if backward else 'fwd'} {seconds * 1e3:9.1f} ms  "
              f"x{seconds / base:.2f} of sdpa pieces")


def graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_policy(lengths: list[int], heads: tuple[int, int, int], device: str,
                   dtype: torch.dtype) -> None:
    from torch.nn.attention.flex_attention import flex_attention

    hq, hkv, dim = heads
    gen = torch.Generator().manual_seed(1)
    rows = [shared_prefix_row(n, gen).to(device) for n in lengths]
    policies = {"static, exact lengths": (False, False), "static, bucketed to 128": (False, True),
                "dynamic=True, bucketed to 128": (True, True)}
    print(f"compile over {len(rows)} rows of {[len(r.slot_T) for r in rows]} tokens "
          f"(buckets {sorted({padded_row_length(len(r.slot_T)) for r in rows})})")
    for name, (dynamic, bucketed) in policies.items():
        torch._dynamo.reset()
        flex = torch.compile(flex_attention, dynamic=dynamic)
        before, started, first = graphs(), time.perf_counter(), None
        try:
            for layout in rows:
                n = len(layout.slot_T)
                length = padded_row_length(n) if bucketed else n
                block_mask = row_block_mask_at(layout, length)
                q = torch.randn(1, hq, length, dim, device=device, dtype=dtype)
                k, v = (torch.randn(1, hkv, length, dim, device=device, dtype=dtype)
                        for _ in "kv")
                with torch.no_grad():
                    flex(q, k, v, block_mask=block_mask, enable_gqa=True)
                first = first or time.perf_counter() - started
            total = time.perf_counter() - started
            print(f"  {name:<30} {total:7.1f} s for all rows (first {first:.1f} s), "
                  f"{graphs() - before} graph(s) compiled")
        except Exception as error:  # a policy that fails is a result
            print(f"  {name:<30} FAILED: {type(error).__name__}: {str(error)[:200]}")
            traceback.print_exc(limit=1)


def row_block_mask_at(layout: RowLayout, length: int):
    """The row's BlockMask over exactly ``length`` tokens (the unbucketed policy)."""
    from torch.nn.attention.flex_attention import create_block_mask

    device = layout.slot_T.device
    return create_block_mask(layout.mask_mod(length), None, None, length, length,
                             device=device, _compile=device.type == "cuda")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--heads", default="14,2,64", help="q heads, kv heads, head dim")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--lengths", default="300,420,560,700,850,1000")
    parser.add_argument("--compiled-kernel", action="store_true",
                        help="also time compiled flex in part 1")
    parser.add_argument("--skip-compile", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    heads = tuple(int(x) for x in args.heads.split(","))
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    kernels(shared_prefix_row(args.tokens, gen), heads, args.device, dtype,
            args.compiled_kernel)
    if not args.skip_compile:
        compile_policy([int(n) for n in args.lengths.split(",")], heads, args.device, dtype)


if __name__ == "__main__":
    main()
