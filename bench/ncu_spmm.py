"""One snack SpMM launch to profile with Nsight Compute, e.g.

    ncu --kernel-name regex:spmm_rows_kernel --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \\
        python bench/ncu_spmm.py --shape 16384x4096 --n 16 --sparsity 0.9 --variant global_xt

The product runs three times (the first two are warm-up launches for ncu to skip); the script
prints the plan so that the profile can be matched to the kernel it ran. `--tiles` gives the forward
the values in tile order (16-bit: `fragments` for the fragment kernel, `entries` for packed tile
values), as `snack.for_inference(model, pack_tiles=...)` does. `--op dw` runs the SDDMM
(`--variant` then names an SDDMM kernel: auto, slot, vector, rows; the kernels are
`sddmm_<variant>_kernel`, `sddmm_thread_slot_kernel` for slot)."""

from __future__ import annotations

import argparse

import torch

import snack
from snack import benchmark
from snack.layer import TILE_FORMATS


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="16384x4096", help="out x in")
    parser.add_argument("--n", type=int, default=16, help="batch rows")
    parser.add_argument("--sparsity", type=float, default=0.9)
    parser.add_argument("--variant", default="auto",
                        help=f"one of {', '.join(('auto',) + snack.SPMM_VARIANTS)}; for --op dw an SDDMM kernel")
    parser.add_argument("--dtype", choices=sorted(benchmark.DTYPES), default="fp32",
                        help="the values' and activations' precision")
    parser.add_argument("--tiles", choices=("none", *TILE_FORMATS), default="none",
                        help="the forward reads the values in tile order (16-bit values)")
    parser.add_argument("--op", choices=("fwd", "dx", "dw"), default="fwd",
                        help="the forward Y = X W^T, the input gradient dX = dY W, or the weight gradient (SDDMM)")
    args = parser.parse_args(argv)
    m, k = map(int, args.shape.split("x"))
    gen = torch.Generator().manual_seed(0)
    dtype = benchmark.DTYPES[args.dtype]
    layer = snack.SparseLinear(k, m, sparsity=args.sparsity, bias=False, device="cuda", dtype=dtype, generator=gen)
    pattern = layer.pattern.tensors
    x = torch.randn(args.n, k, device="cuda", dtype=dtype)
    dy = torch.randn(args.n, m, device="cuda", dtype=dtype)
    if args.tiles != "none" and (args.op != "fwd" or args.dtype == "fp32"):
        parser.error("--tiles: the forward of 16-bit values only")
    if args.op == "dw":
        run = lambda: snack.ops.sddmm(dy, x, pattern, variant=args.variant)  # noqa: E731
    elif args.tiles != "none":
        layer.pack_tiles, layer.tile_format = True, args.tiles
        print(snack.explain(layer, args.n, variant=args.variant))
        tiles = TILE_FORMATS[args.tiles](layer.values.detach(), pattern)
        run = lambda: snack.ops.spmm(x, layer.values, pattern, None, variant=args.variant, tiles=tiles)  # noqa: E731
    else:
        print(snack.explain(layer, args.n, op="input_grad" if args.op == "dx" else "forward", variant=args.variant))
        run = ((lambda: snack.ops.spmm_t(dy, layer.values, pattern, args.variant)) if args.op == "dx"
               else (lambda: snack.ops.spmm(x, layer.values, pattern, None, variant=args.variant)))
    with torch.no_grad():
        for _ in range(3):
            run()
        torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
