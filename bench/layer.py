"""One layer's training step, and the backward kernels alone, against dense, Dense+Mask and torch.sparse.

    python bench/layer.py            # the issue's grid (a few minutes on an H200)
    python bench/layer.py --quick    # two shapes, to check the set-up
    python bench/layer.py --dtype bf16 --ns 16,32,64,128   # the backward kernels in bf16 (or fp16)
    python bench/layer.py --precisions fp32,tf32,bf16_autocast --ns 512,2048,8192,16384 --tag large

Step = forward + backward + optimizer step (SGD with momentum, AdamW) of one layer on an input of N
rows, for: snack (SparseLinear), dense (nn.Linear), dense_mask (a dense weight times a fixed 0/1
mask, as dynamic-sparse-training code does it) and torch_sparse (a COO weight built from a values
Parameter and torch.sparse.mm, as a user would write it); with AdamW also snack_fused_step
(SparseLinear with snack.optim.AdamW: the updates of the values and of the bias run in the
backward, fused with their gradient kernels, so the torch AdamW flavour of a row applies to the
baselines only).
Per step: GPU time (CUDA events around a warm step; and the replay of a captured CUDA graph where
capture works), the wall time a user sees (many steps back to back, divided), and peak memory
(torch.cuda.max_memory_allocated over a step, minus what was allocated before the layer existed:
parameters, gradients, optimizer state, indices, activations). Backward kernels: dX (transposed
SpMM) against cuSPARSE on the transposed CSR, and dW (SDDMM) against torch.sparse.sampled_addmm,
cold L2, checked against float64 first. In 16 bits (--dtype bf16 | fp16) against dense cuBLAS in the
same dtype, with the forward beside them and each kernel forced next to the planner's choice (up to
N = 128: the tile view's forward, dX and dW, the row kernels' dX, the rows SDDMM; tensor_core for both),
and dW with AdamW's step by every kernel that runs it.
Writes bench/results/layer_<gpu>.{csv,md} and backward_<gpu>.{csv,md} (backward_<gpu>[_<tag>]_<dtype>
in 16 bits), and a PNG plot.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import statistics
import time
from pathlib import Path

import torch
from torch import nn

import snack
from snack import benchmark

SHAPES = [(4096, 4096), (5000, 5000), (16384, 4096)]
NS = [1, 16, 128]
SPARSITIES = [0.9, 0.95, 0.99]
IMPLS = ["snack", "snack_fused_step", "dense", "dense_mask", "torch_sparse"]
# Steps that cannot be captured as a CUDA graph: torch.sparse.mm's step raises AcceleratorError under
# capture (torch 2.11). A capture that fails part-way leaves the CUDA generator counting as if in
# capture, so the next torch.randn of the run raises; these are never tried.
NO_GRAPH_IMPLS = {"torch_sparse"}
OPTIMIZERS = ["sgd", "adamw"]
# adamw_fused (--optimizers): torch's single-kernel AdamW (fused=True), for every implementation alike.
OPTIMIZER_CHOICES = OPTIMIZERS + ["adamw_fused"]
LAYER_COLUMNS = ["M", "K", "N", "sparsity", "dtype", "impl", "optimizer", "gpu_us", "graph_us", "wall_us", "peak_mib"]
BACKWARD_COLUMNS = ["op", "M", "K", "N", "sparsity", "pattern", "dtype", "impl", "median_us", "floor_us", "tflops"]


class TorchSparse(nn.Module):
    def __init__(self, indices, values, bias, shape):
        super().__init__()
        self.values = nn.Parameter(values.clone())
        self.bias = nn.Parameter(bias.clone())
        self.register_buffer("indices", indices)
        self.shape = shape

    def forward(self, x):
        w = torch.sparse_coo_tensor(self.indices, self.values, self.shape, is_coalesced=True)
        return torch.sparse.mm(w, x.t()).t() + self.bias


def make_layer(impl, ref: snack.SparseLinear):
    m, k = ref.out_features, ref.in_features
    if impl in ("snack", "snack_fused_step"):
        return snack.SparseLinear.from_dense(ref.to_dense().detach(), mask=ref.mask(), bias=ref.bias.detach())
    if impl == "dense":
        lin = nn.Linear(k, m, device="cuda")
        with torch.no_grad():
            lin.weight.copy_(ref.to_dense())
            lin.bias.copy_(ref.bias)
        return lin
    if impl == "dense_mask":
        return snack.dst.DenseMaskLinear.from_sparse(ref)
    indices = torch.stack([ref.row_idx.long(), ref.col_idx.long()])
    return TorchSparse(indices, ref.values.detach(), ref.bias.detach(), (m, k))


def make_optimizer(name, params, capturable=False, impl=""):
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    adamw = snack.optim.AdamW if impl == "snack_fused_step" else torch.optim.AdamW
    return adamw(params, lr=1e-3, capturable=capturable, fused=name == "adamw_fused" or None)


def runs(impl, opt_name):
    """snack_fused_step exists for AdamW only."""
    return impl != "snack_fused_step" or opt_name != "sgd"


PRECISIONS = ("fp32", "tf32", "bf16_autocast")


@contextlib.contextmanager
def precision_mode(precision: str):
    """fp32: TF32 off (this benchmark's default); tf32: torch's matmuls and convolutions may use TF32
    (snack's kernels compute in fp32 either way); bf16_autocast: like fp32, the forward then runs
    under torch.autocast(bfloat16) (training_step)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: one of {PRECISIONS}")
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = precision == "tf32"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def training_step(layer, opt, x, target, precision="fp32"):
    """The step every implementation is timed on: forward (under autocast for bf16_autocast),
    squared-error loss in fp32, backward (dX too where x requires its gradient, as for a layer inside
    a network), optimizer step."""
    autocast = precision == "bf16_autocast"

    def step():
        opt.zero_grad()  # PyTorch's default, set_to_none=True: backward writes fresh gradients
        x.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast, cache_enabled=False):
            out = layer(x)
        ((out.float() - target) ** 2).mean().backward()
        opt.step()

    return step


def time_layer(impl, ref, n, opt_name, steps=20, precision="fp32", input_grad=False):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    layer = make_layer(impl, ref)
    opt = make_optimizer(opt_name, layer.parameters(), impl=impl)
    x = torch.randn(n, ref.in_features, device="cuda", requires_grad=input_grad)
    target = torch.randn(n, ref.out_features, device="cuda")
    step = training_step(layer, opt, x, target, precision)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gpu = []
    for _ in range(steps):
        start.record()
        step()
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end) * 1e3)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps * 1e6
    graph_us = float("nan")
    try:
        if impl in NO_GRAPH_IMPLS:
            raise NotImplementedError(f"{impl} is not captured")
        layer_g = make_layer(impl, ref)
        opt_g = make_optimizer(opt_name, layer_g.parameters(), capturable=True, impl=impl)
        graph = benchmark.capture_graph(training_step(layer_g, opt_g, x, target, precision))
        for _ in range(3):
            graph.replay()
        graph_us = 1e3 * statistics.median(benchmark.replay_times_ms(graph, steps))
        del graph, layer_g, opt_g
    except Exception as exc:  # capture unsupported for this implementation
        print(f"  (no CUDA graph for {impl}/{opt_name}: {type(exc).__name__})")
    del layer, opt
    return statistics.median(gpu), graph_us, wall, peak


SDDMM_VARIANTS = ("vector", "rows", "staged")  # forced with --sddmm-variants, as impl "snack_<variant>"
ADAMW_16BIT_VARIANTS = ("rows", "vector", "tensor_core", "tile_view")  # forced beside the planner's fused dW in 16 bits


def backward_operands(ref, n, dtype):
    """Random dY and X of a batch of n rows, the dense weight in `dtype`, and the float64 references:
    the forward, dX, the whole dY^T X and dW at the stored slots."""
    dy = torch.randn(n, ref.out_features, device="cuda").to(dtype)
    x = torch.randn(n, ref.in_features, device="cuda").to(dtype)
    dense_w = ref.to_dense().detach().to(dtype)
    dense64 = dense_w.double()
    full = dy.double().t() @ x.double()
    return (dy, x, dense_w, x.double() @ dense64.t(), dy.double() @ dense64, full,
            full[ref.row_idx.long(), ref.col_idx.long()])


def csc_read_paths(values, pattern, dy, ref_dx) -> dict:
    """dX with the planner's kernel over the CSC view read in place (through csc_perm) and over a
    copy gathered first (snack.csc_read), so the planner's choice between them is checked."""
    def under(csc):
        def run():
            with snack.csc_read(csc):
                return snack.ops.spmm_t(dy, values, pattern)
        return run
    return {("dx", "snack_in_place"): (under("in_place"), ref_dx), ("dx", "snack_copied"): (under("copied"), ref_dx)}


def backward_rows(ref, n, sparsity, timer, bandwidth, sddmm_variants=(), csc_reads=False):
    m, k, nnz = ref.out_features, ref.in_features, ref.nnz
    pattern = ref.pattern.tensors
    values = ref.values.detach()
    dy, x, dense_w, _, ref_dx, full, ref_dw = backward_operands(ref, n, torch.float32)
    # cuSPARSE operands built from the pattern itself (a dense round trip would drop exact zeros):
    # W in CSR, and W^T in CSR = W's CSC view.
    w_csr = torch.sparse_csr_tensor(ref.pattern.row_ptr, ref.col_idx.int(), values, (m, k))
    perm = ref.pattern.csc_perm.long()
    wt_csr = torch.sparse_csr_tensor(ref.pattern.col_ptr, ref.row_idx.int()[perm], values[perm], (k, m))
    rows = []
    floor_dx = (nnz * 12 + 4 * (k + 1) + 4 * n * (m + k)) / (bandwidth * 1e3)
    floor_dw = (nnz * 12 + 4 * n * (m + k)) / (bandwidth * 1e3)
    cands = {
        ("dx", "snack"): (lambda: snack.ops.spmm_t(dy, values, pattern), ref_dx),
        ("dx", "cusparse_csr"): (lambda: torch.sparse.mm(wt_csr, dy.t()).t(), ref_dx),
        ("dw", "snack"): (lambda: snack.ops.sddmm(dy, x, pattern), ref_dw),
        ("dw", "cusparse_sddmm"): (lambda: torch.sparse.sampled_addmm(w_csr, dy.t().contiguous(), x, beta=0.0).values(),
                                   ref_dw),
    }
    for variant in sddmm_variants:
        cands[("dw", f"snack_{variant}")] = (lambda v=variant: snack.ops.sddmm(dy, x, pattern, variant=v), ref_dw)
    cands[("dx", "dense")] = (lambda: dy @ dense_w, ref_dx)
    cands[("dw", "dense")] = (lambda: dy.t() @ x, full)
    cands.update(large_batch_paths(n, values, pattern, dy, x, ref_dx, ref_dw))
    if csc_reads:
        cands.update(csc_read_paths(values, pattern, dy, ref_dx))
    rows += adamw_step_rows(ref, pattern, dy, x, n, sparsity, timer, bandwidth, sddmm_variants)
    return rows + timed_rows(cands, ref, n, sparsity, "fp32", {"dx": floor_dx, "dw": floor_dw}, timer)


def large_batch_paths(n, values, pattern, dy, x, ref_dx, ref_dw, fwd=None) -> dict:
    """From a batch of snack.DENSE_BLOCK_MIN_ROWS: the planner's two paths for dX and dW forced side
    by side (the sparse kernel, and the dense GEMM over expanded blocks), so its choice is checked;
    fwd=(x, float64 reference): the forward's dense blocks too. A forced dX kernel reads the CSC view
    as the planner would (over a copy from N = 256; csc_read_paths forces either way)."""
    if n < snack.DENSE_BLOCK_MIN_ROWS:
        return {}
    paths = {} if fwd is None else {
        ("fwd", "snack_dense_blocks"): (lambda: snack.ops.spmm(fwd[0], values, pattern, None, variant="dense_blocks"),
                                        fwd[1])}
    return paths | {
        ("dx", "snack_global_xt"): (lambda: snack.ops.spmm_t(dy, values, pattern, "global_xt"), ref_dx),
        ("dx", "snack_shared_x"): (lambda: snack.ops.spmm_t(dy, values, pattern, "shared_x"), ref_dx),
        ("dx", "snack_dense_blocks"): (lambda: snack.ops.spmm_t(dy, values, pattern, "dense_blocks"), ref_dx),
        ("dw", "snack_vector"): (lambda: snack.ops.sddmm(dy, x, pattern, variant="vector"), ref_dw),
        ("dw", "snack_staged"): (lambda: snack.ops.sddmm(dy, x, pattern, variant="staged"), ref_dw),
        ("dw", "snack_dense_blocks"): (lambda: snack.ops.sddmm(dy, x, pattern, variant="dense_blocks"), ref_dw),
    }


def timed_rows(cands, ref, n, sparsity, dtype_name, floor, timer) -> list[dict]:
    """Checks each candidate {(op, impl): (fn, float64 reference)} against its reference within the
    dtype's tolerance, then times it: a result row per candidate that ran and was right. A forced
    snack kernel that cannot run the shape (ValueError) is reported and left out; a baseline's error
    stays an error. floor: the floor in us of each op."""
    m, k, nnz = ref.out_features, ref.in_features, ref.nnz
    rows = []
    for (op, impl), (fn, ref_out) in cands.items():
        try:
            out = fn()
        except ValueError as e:
            if not impl.startswith("snack_"):
                raise
            print(f"  {op}/{impl} {m}x{k} N={n}: {e}")
            continue
        err = benchmark.rel_error(out, ref_out)
        if not err < benchmark.TOLERANCE[dtype_name]:
            print(f"  {op}/{impl} {m}x{k} N={n} {dtype_name}: rel error {err:.2e}, not timed")
            continue
        us = timer.median_us(fn, reps=20)
        rows.append(dict(op=op, M=m, K=k, N=n, sparsity=sparsity, pattern="uniform", dtype=dtype_name, impl=impl,
                         median_us=us, floor_us=floor[op], tflops=benchmark.useful_tflops(nnz, n, us)))
    return rows


def backward_rows_16bit(ref, n, sparsity, dtype_name, timer, bandwidth, csc_reads=False):
    """The backward kernels in 16 bits (values, dY and X in `dtype`, fp32 accumulation): dX as snack's
    planner runs it and with the tensor-core kernel forced, dW (the SDDMM), the forward beside them
    (the issue's dX-against-forward ratio), and dense cuBLAS in the same dtype (dY @ W and dY^T @ X)."""
    m, k, nnz = ref.out_features, ref.in_features, ref.nnz
    dtype = benchmark.DTYPES[dtype_name]
    pattern = ref.pattern.tensors
    values = ref.values.detach().to(dtype)
    dy, x, dense_w, ref_fwd, ref_dx, full, ref_dw = backward_operands(ref, n, dtype)
    vb, ib = dtype.itemsize, ref.col_idx.element_size()
    floor = {  # bytes of the view (values, indices, csc_perm for dX) and of the activations
        "fwd": (nnz * (vb + ib) + 4 * (m + 1) + vb * n * (m + k)) / (bandwidth * 1e3),
        "dx": (nnz * (vb + ib + 4) + 4 * (k + 1) + vb * n * (m + k)) / (bandwidth * 1e3),
        "dw": (nnz * (vb + 2 * ib) + vb * n * (m + k)) / (bandwidth * 1e3),
    }
    cands = {
        ("fwd", "snack"): (lambda: snack.ops.spmm(x, values, pattern, None), ref_fwd),
        ("dx", "snack"): (lambda: snack.ops.spmm_t(dy, values, pattern), ref_dx),
        ("dx", "snack_tensor_core"): (lambda: snack.ops.spmm_t(dy, values, pattern, "tensor_core"), ref_dx),
        ("dx", "dense"): (lambda: dy @ dense_w, ref_dx),
        ("dw", "snack"): (lambda: snack.ops.sddmm(dy, x, pattern), ref_dw),
        ("dw", "snack_tensor_core"): (lambda: snack.ops.sddmm(dy, x, pattern, "tensor_core"), ref_dw),
        ("dw", "snack_rows"): (lambda: snack.ops.sddmm(dy, x, pattern, "rows"), ref_dw),
        ("dw", "dense"): (lambda: dy.t() @ x, full),
    }
    cands.update(large_batch_paths(n, values, pattern, dy, x, ref_dx, ref_dw, fwd=(x, ref_fwd)))
    if ref.pattern.tile_ptr.numel() > 0 and n <= 128:  # the tile view's dX forced (the forward's view)
        cands[("fwd", "snack_tile_view")] = (lambda: snack.ops.spmm(x, values, pattern, None, variant="tile_view"),
                                             ref_fwd)
        cands[("dx", "snack_tile_view")] = (lambda: snack.ops.spmm_t(dy, values, pattern, "tile_view"), ref_dx)
        cands[("dw", "snack_tile_view")] = (lambda: snack.ops.sddmm(dy, x, pattern, "tile_view"), ref_dw)
    if ref.pattern.tile_ptr.numel() > 0 and torch.cuda.get_device_capability() == (9, 0):
        # the tile view's dW with its products on wgmma, past 128 rows over the batch in chunks of 128
        # (refused, and left out, past its rows)
        cands[("dw", "snack_tile_view_wgmma")] = (lambda: snack.ops.sddmm(dy, x, pattern, "tile_view_wgmma"), ref_dw)
    if n <= 128:  # the CUDA-core row kernels' dX, the CSC view read in place (no copy below a batch of 256)
        for variant in ("global_x", "global_xt"):
            cands[("dx", f"snack_{variant}")] = (lambda v=variant: snack.ops.spmm_t(dy, values, pattern, v), ref_dx)
    if csc_reads:
        cands.update(csc_read_paths(values, pattern, dy, ref_dx))
    # dW with AdamW's step, as snack.optim.AdamW runs it under autocast: the 16-bit operands, float32
    # values and moments; the planner's kernel and each that runs 16-bit batches of any size forced.
    return timed_rows(cands, ref, n, sparsity, dtype_name, floor, timer) + adamw_step_rows(
        ref, pattern, dy, x, n, sparsity, timer, bandwidth, ADAMW_16BIT_VARIANTS, dtype_name)


def write_16bit_summary(csv_path: Path, back_rows, info, plot: bool = True) -> str:
    """Writes the summary of a 16-bit backward run beside its result file (and its plot): the Markdown."""
    md = summarize_16bit(back_rows, info)
    csv_path.with_suffix(".md").write_text(md)
    if plot:
        plot_16bit(back_rows, csv_path.with_suffix(".png"), info)
    return md


def summarize_16bit(back_rows, info) -> str:
    """The 16-bit backward kernels against dense cuBLAS in the same dtype, and dX against the forward."""
    dtype = back_rows[0]["dtype"] if back_rows else "bf16"
    lines = benchmark.markdown_head(f"Backward kernels in {dtype}", info)
    b = {(r["op"], r["M"], r["K"], r["N"], r["sparsity"], r["impl"]): r for r in back_rows}
    lines += ["Median us, cold L2. dX and dW: the planner's kernel (snack) and the tensor-core, tile-view "
              "(N <= 128; dW also on wgmma, on Hopper) and rows (dW, N <= 128) kernels forced; dX row kernels: "
              "the faster of global_x and "
              "global_xt forced (N <= 128, the CSC view in place); fwd tile_view: the forward's tile-view kernel "
              f"forced; dense: cuBLAS in {dtype} (dY @ W for dX, the whole dY^T @ X for dW). dX / fwd: snack's dX "
              "over its forward on the same problem.", "",
              "| M x K | N | sparsity | fwd | fwd tile_view | dX | dX row kernels | dX tensor_core | dX tile_view "
              "| dense dX "
              "| dX vs dense | dX / fwd | dW | dW tensor_core | dW tile_view | dW tile_view_wgmma | dW rows "
              "| dense dW | dW vs dense |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    cell = lambda r: f"{r['median_us']:.1f}" if r else "-"  # noqa: E731
    ratio = lambda num, den: f"{num['median_us'] / den['median_us']:.2f}x" if num and den else "-"  # noqa: E731
    dx_vs_dense, dx_vs_fwd, dw_vs_dense = [], [], []
    for key in sorted({k[1:5] for k in b}):
        get = lambda op, impl: b.get((op,) + key + (impl,))  # noqa: E731
        fwd, dx, dx_tc, ddx = get("fwd", "snack"), get("dx", "snack"), get("dx", "snack_tensor_core"), get("dx", "dense")
        fwd_tv, dx_tv, dw_tv = get("fwd", "snack_tile_view"), get("dx", "snack_tile_view"), get("dw", "snack_tile_view")
        dw_wg = get("dw", "snack_tile_view_wgmma")
        dx_rows = min((r for r in (get("dx", "snack_global_x"), get("dx", "snack_global_xt")) if r),
                      key=lambda r: r["median_us"], default=None)
        dw, dw_tc, dw_rows, ddw = get("dw", "snack"), get("dw", "snack_tensor_core"), get("dw", "snack_rows"), \
            get("dw", "dense")
        if dx and ddx:
            dx_vs_dense.append(ddx["median_us"] / dx["median_us"])
        if dx and fwd:
            dx_vs_fwd.append(dx["median_us"] / fwd["median_us"])
        if dw and ddw:
            dw_vs_dense.append(ddw["median_us"] / dw["median_us"])
        lines.append(f"| {key[0]}x{key[1]} | {key[2]} | {key[3]} | {cell(fwd)} | {cell(fwd_tv)} | {cell(dx)} "
                     f"| {cell(dx_rows)} "
                     f"| {cell(dx_tc)} | {cell(dx_tv)} | {cell(ddx)} "
                     f"| {ratio(ddx, dx)} | {ratio(dx, fwd)} | {cell(dw)} | {cell(dw_tc)} | {cell(dw_tv)} | {cell(dw_wg)} "
                     f"| {cell(dw_rows)} "
                     f"| {cell(ddw)} "
                     f"| {ratio(ddw, dw)} |")
    if dx_vs_dense:
        lines += ["", f"- dX against dense {dtype}, geomean: {benchmark.geomean(dx_vs_dense):.2f}x; "
                  f"dX / forward, geomean: {benchmark.geomean(dx_vs_fwd):.2f} (target <= 1.3); "
                  f"dW against dense {dtype}, geomean: {benchmark.geomean(dw_vs_dense):.2f}x"]
    lines += input_grad_paths_table(b)
    lines += weight_grad_paths_table(b)
    lines += adamw_paths_table(b)
    return "\n".join(lines) + "\n"


def adamw_paths_table(b) -> list[str]:
    """dW with AdamW's step: the planner's fused kernel, each forced one, and the unfused pair."""
    keys = sorted({k[1:5] for k in b if k[0] == "dw_adamw"})
    if not keys:
        return []
    impls = ["snack_fused"] + [f"snack_fused_{v}" for v in ADAMW_16BIT_VARIANTS] + ["snack_unfused"]
    lines = ["", "## Weight gradient with AdamW's step (cold L2, median us)", "",
             "snack_fused: `sddmm_adamw_` with the planner's kernel (what snack.optim.AdamW runs; float32 values "
             "and moments); snack_fused_<kernel>: that kernel forced (`-`: it does not run the shape); "
             "snack_unfused: `snack.ops.sddmm`, then torch's fused AdamW on the gradient.", "",
             "| M x K | N | sparsity | " + " | ".join(impls) + " |", "|---|---|---|" + "---|" * len(impls)]
    for key in keys:
        cells = [b.get(("dw_adamw",) + key + (impl,)) for impl in impls]
        lines.append(f"| {key[0]}x{key[1]} | {key[2]} | {key[3]} | "
                     + " | ".join(f"{r['median_us']:.1f}" if r else "-" for r in cells) + " |")
    return lines


ADAMW = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=1e-2, eps=1e-8)


def adamw_step_rows(ref, pattern, dy, x, n, sparsity, timer, bandwidth, sddmm_variants=(), dtype_name="fp32"):
    """op dw_adamw: the weight gradient and AdamW's step of the values. snack_fused: one kernel
    (sddmm_adamw_, the automatic choice); snack_fused_<variant>: the same with an SDDMM kernel forced;
    snack_unfused: snack's SDDMM, then torch's fused AdamW kernel on the gradient. All start from
    the same state; each fused one is checked against the unfused one first. dtype_name: the type of
    dy and x; the values and moments stay float32 (mixed precision: the gradient is rounded to the
    16-bit type, whose rounding another kernel may take to the other neighbour, so the check is the
    type's tolerance)."""
    m, k, nnz = ref.out_features, ref.in_features, ref.nnz
    tolerance = 1e-5 if dtype_name == "fp32" else benchmark.TOLERANCE[dtype_name]

    def fresh(step):  # values, exp_avg, exp_avg_sq, step
        return [ref.values.detach().clone(), torch.full_like(ref.values, 1e-3), torch.full_like(ref.values, 1e-6),
                torch.full((), float(step), device="cuda")]

    h = ADAMW
    unfused_state = fresh(1)  # torch's optimizer advances the count before its kernel

    def unfused():
        grad = snack.ops.sddmm(dy, x, pattern).float()
        torch._fused_adamw_([unfused_state[0]], [grad], [unfused_state[1]], [unfused_state[2]], [], [unfused_state[3]],
                            amsgrad=False, maximize=False, **h)

    def fused_step(variant):
        state = fresh(0)  # sddmm_adamw_ advances the count itself

        def fused():
            snack.ops.sddmm_adamw_(dy, x, pattern, state[0], state[1:],
                                   [h["lr"], h["beta1"], h["beta2"], h["eps"], h["weight_decay"], 0.0], [],
                                   variant=variant)
        return fused, state

    candidates = [("snack_fused", *fused_step("auto"))]
    candidates += [(f"snack_fused_{v}", *fused_step(v)) for v in sddmm_variants]
    unfused()
    # Indices, then values and both moments read and written once, dy and x read once.
    floor = (nnz * (2 * ref.row_idx.element_size() + 24) + dy.element_size() * n * (m + k)) / (bandwidth * 1e3)
    rows = []
    for impl, fn, state in candidates + [("snack_unfused", unfused, unfused_state)]:
        if fn is not unfused:
            try:
                fn()
            except ValueError as e:  # a forced SDDMM kernel that cannot run this shape
                print(f"  dw_adamw/{impl} {m}x{k} N={n}: {e}")
                continue
            err = max(benchmark.rel_error(a, b) for a, b in zip(state[:3], unfused_state[:3]))
            if not err < tolerance:
                print(f"  dw_adamw/{impl} {m}x{k} N={n}: fused and unfused differ by {err:.2e}, not timed")
                continue
        rows.append(dict(op="dw_adamw", M=m, K=k, N=n, sparsity=sparsity, pattern="uniform", dtype=dtype_name,
                         impl=impl, median_us=(us := timer.median_us(fn, reps=20)), floor_us=floor,
                         tflops=benchmark.useful_tflops(nnz, n, us)))
    return rows


def less_or_more(value: float, reference: float) -> str:
    """'22% less' or '46% more': value against reference."""
    change = 100 * (1 - value / reference)
    return f"{change:.0f}% less" if change >= 0 else f"{-change:.0f}% more"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--render", action="store_true",
                        help="only rebuild the summaries (.md) and the plots from the result CSVs in --out")
    parser.add_argument("--out", type=Path, default=benchmark.RESULTS_DIR)
    parser.add_argument("--shapes", default=None, help="e.g. 4096x4096,16384x4096")
    parser.add_argument("--ns", default=None, help="e.g. 1,16")
    parser.add_argument("--sparsities", default=None, help="e.g. 0.9,0.99")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS),
                        help=f"comma-separated, of {', '.join(OPTIMIZER_CHOICES)} (adamw: torch's default, foreach)")
    parser.add_argument("--tag", default="", help="suffix of the result files' names (layer_<gpu>_<tag>.*)")
    parser.add_argument("--backward-only", action="store_true", help="only the backward kernels (no layer steps)")
    parser.add_argument("--input-grad", action="store_true",
                        help="the layer steps compute dX too (the input requires its gradient, as for a layer inside "
                             "a network); without it the input is data, as for a first layer")
    parser.add_argument("--precisions", default="fp32",
                        help=f"layer steps in each of {', '.join(PRECISIONS)} (comma-separated): fp32 with TF32 off, "
                             "TF32 allowed for torch's matmuls, the forward under autocast bf16")
    parser.add_argument("--sddmm-variants", action="store_true",
                        help="also time every SDDMM kernel forced (impl snack_vector, snack_rows; "
                             "with AdamW fused: snack_fused_<variant>)")
    parser.add_argument("--csc-reads", action="store_true",
                        help="also time dX with the CSC view read in place and copied first (impl snack_in_place, "
                             "snack_copied)")
    parser.add_argument("--dtype", choices=sorted(benchmark.DTYPES), default="fp32",
                        help="bf16 / fp16: only the backward kernels, values and activations in that dtype, against "
                             "dense cuBLAS in it (backward_<gpu>_<dtype>.*)")
    parser.add_argument("--profile", action="store_true",
                        help="only write layer_profile_<gpu>[_<tag>].txt: where the GPU time of a step goes, kernel "
                             "by kernel, for snack with torch's AdamW, snack_fused_step with the in-backward AdamW "
                             "and dense; by default the issue's target step (16384x4096, N=16, 90%%, fp32), else "
                             "every --shapes x --ns x --sparsities x --precisions step (with --input-grad: dX too)")
    args = parser.parse_args(argv)
    if args.render:  # every layer_<slug>.csv in --out, with its backward_<slug>.csv; every backward-only file
        for backward_csv in sorted(args.out.glob("backward_*_bf16.csv")) + sorted(args.out.glob("backward_*_fp16.csv")):
            info, back_rows = benchmark.read_csv(backward_csv)
            print(write_16bit_summary(backward_csv, back_rows, info))
        for layer_csv in sorted(args.out.glob("layer_*.csv")):
            slug = layer_csv.stem[len("layer_"):]
            info, layer_rows = benchmark.read_csv(layer_csv)
            _, back_rows = benchmark.read_csv(args.out / f"backward_{slug}.csv")
            md = summarize(layer_rows, back_rows, info)
            (args.out / f"layer_{slug}.md").write_text(md)
            plot(layer_rows, args.out / f"layer_{slug}.png", info)
            print(md)
        for backward_csv in sorted(args.out.glob("backward_*_kernels.csv")):
            info, back_rows = benchmark.read_csv(backward_csv)
            md = summarize([], back_rows, info)
            backward_csv.with_suffix(".md").write_text(md)
            plot_weight_grad_paths(back_rows, backward_csv.with_suffix(".png"), info)
            print(md)
        return 0
    if not torch.cuda.is_available():
        print("bench/layer.py needs a CUDA GPU")
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.profile:
        chosen = args.shapes or args.ns or args.sparsities or args.precisions != "fp32" or args.input_grad
        steps = ([(m, k, n, s, p) for (m, k), n, s, p in itertools.product(
                     benchmark.shape_list(args.shapes, [(16384, 4096)]), benchmark.number_list(args.ns, [16]),
                     benchmark.number_list(args.sparsities, [0.9], float), args.precisions.split(","))]
                 if chosen else [(16384, 4096, 16, 0.9, "fp32")])
        impls = (("snack", "adamw"), ("snack_fused_step", "adamw_fused")) + ((("dense", "adamw"),) if chosen else ())
        text = "\n\n".join(profile_step(m, k, n, s, impl, opt_name, precision=p, input_grad=args.input_grad)
                             for m, k, n, s, p in steps for impl, opt_name in impls)
        name = f"layer_profile_{benchmark.gpu_slug()}" + (f"_{args.tag}" if args.tag else "")
        benchmark.write_text(args.out / f"{name}.txt", benchmark.provenance(), text)
        print(text)
        return 0
    shapes, ns, sparsities = (SHAPES[:1] + SHAPES[2:], [1, 16], [0.9]) if args.quick else (SHAPES, NS, SPARSITIES)
    shapes = benchmark.shape_list(args.shapes, shapes)
    ns = benchmark.number_list(args.ns, ns)
    sparsities = benchmark.number_list(args.sparsities, sparsities, float)
    precisions = args.precisions.split(",")
    if set(precisions) - set(PRECISIONS):
        parser.error(f"unknown precisions {sorted(set(precisions) - set(PRECISIONS))}; choose from {PRECISIONS}")
    optimizers = args.optimizers.split(",")
    unknown = set(optimizers) - set(OPTIMIZER_CHOICES)
    if unknown:
        parser.error(f"unknown optimizers {sorted(unknown)}; choose from {OPTIMIZER_CHOICES}")
    info = benchmark.provenance()
    bandwidth = benchmark.copy_bandwidth_gbs()
    info["copy_bandwidth"] = f"{bandwidth:.0f} GB/s"
    info["method"] = ("layer: median of 20 warm steps (CUDA events), CUDA-graph replay median, wall = 20 steps "
                      "back to back / 20, peak = max_memory_allocated over one step minus memory before the layer; "
                      f"backward kernels: median of 20 single calls, {benchmark.ColdTimer.METHOD}")
    info["step"] = ("forward, dX, dW, optimizer step (the input requires its gradient)" if args.input_grad else
                    "forward, dW, optimizer step (the input is data: no dX)")
    timer = benchmark.ColdTimer()
    layer_rows, back_rows = [], []
    configs = list(itertools.product(shapes, sparsities))
    gen = torch.Generator().manual_seed(0)
    if args.dtype != "fp32":
        info["method"] = f"backward kernels in {args.dtype}: median of 20 single calls, {benchmark.ColdTimer.METHOD}"
        for (m, k), sparsity in benchmark.progress(configs, len(configs), f"backward {args.dtype}"):
            ref = snack.SparseLinear(k, m, sparsity=sparsity, device="cuda", generator=gen)
            for n in ns:
                back_rows += backward_rows_16bit(ref, n, sparsity, args.dtype, timer, bandwidth, args.csc_reads)
            del ref
            slug = benchmark.gpu_slug() + ("_quick" if args.quick else "") + (f"_{args.tag}" if args.tag else "")
            csv_path = args.out / f"backward_{slug}_{args.dtype}.csv"
            benchmark.write_csv(csv_path, info, BACKWARD_COLUMNS, back_rows)
            write_16bit_summary(csv_path, back_rows, info, plot=False)  # kept current as the sweep goes
        print(write_16bit_summary(csv_path, back_rows, info))
        return 0
    for (m, k), sparsity in benchmark.progress(configs, len(configs), "layer"):
        ref = snack.SparseLinear(k, m, sparsity=sparsity, device="cuda", generator=gen)
        for n in ns:
            for impl, opt_name, precision in itertools.product(() if args.backward_only else IMPLS, optimizers,
                                                               precisions):
                if not runs(impl, opt_name):
                    continue
                try:
                    with precision_mode(precision):
                        gpu, graph_us, wall, peak = time_layer(impl, ref, n, opt_name, precision=precision,
                                                               input_grad=args.input_grad)
                except RuntimeError as exc:  # a baseline without this precision (torch.sparse under autocast)
                    if impl.startswith("snack") or precision == "fp32":
                        raise
                    print(f"  {impl}/{opt_name} {precision} {m}x{k} N={n}: {str(exc)[:120]}")
                    continue
                layer_rows.append(dict(M=m, K=k, N=n, sparsity=sparsity, dtype=precision, impl=impl,
                                       optimizer=opt_name, gpu_us=gpu, graph_us=graph_us, wall_us=wall, peak_mib=peak))
            back_rows += backward_rows(ref, n, sparsity, timer, bandwidth,
                                       SDDMM_VARIANTS if args.sddmm_variants else (), args.csc_reads)
        del ref
        md = write_results(args, info, layer_rows, back_rows)  # after every shape: a cut-off run keeps its rows
    print(md)
    return 0


def profile_step(m, k, n, sparsity, impl="snack", opt_name="adamw", steps=10, precision="fp32",
                 input_grad=False) -> str:
    """torch.profiler over `steps` warm steps of `impl` with `opt_name` in `precision` (dX too where
    `input_grad`): each kernel's GPU time per step."""
    from torch.profiler import ProfilerActivity, profile
    ref = snack.SparseLinear(k, m, sparsity=sparsity, device="cuda", generator=torch.Generator().manual_seed(0))
    layer = make_layer(impl, ref)
    opt = make_optimizer(opt_name, layer.parameters(), impl=impl)
    x = torch.randn(n, k, device="cuda", requires_grad=input_grad)
    target = torch.randn(n, m, device="cuda")
    step = training_step(layer, opt, x, target, precision)
    with precision_mode(precision):
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    events.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in events) / steps
    lines = [f"{impl} step {m}x{k}, N={n}, sparsity {sparsity}, {opt_name}, {precision}"
             f"{', with dX' if input_grad else ''}: {total:.1f} us of kernels per step "
             f"(sum of self device times over {steps} steps / {steps})", "",
             "| us per step | share | calls per step | kernel |", "|---|---|---|---|"]
    for e in events:
        us = e.self_device_time_total / steps
        lines.append(f"| {us:.1f} | {100 * us / total:.0f}% | {e.count / steps:g} | {e.key[:110]} |")
    return "\n".join(lines)


def write_results(args, info, layer_rows, back_rows) -> str:
    # --backward-only runs go to their own files (backward_<gpu>_kernels.*), leaving the full tables alone.
    slug = (benchmark.gpu_slug() + ("_quick" if args.quick else "") + (f"_{args.tag}" if args.tag else "")
            + ("_kernels" if args.backward_only else ""))
    benchmark.write_csv(args.out / f"backward_{slug}.csv", info, BACKWARD_COLUMNS, back_rows)
    md = summarize(layer_rows, back_rows, info)
    if args.backward_only:
        (args.out / f"backward_{slug}.md").write_text(md)
        plot_weight_grad_paths(back_rows, args.out / f"backward_{slug}.png", info)
        return md
    benchmark.write_csv(args.out / f"layer_{slug}.csv", info, LAYER_COLUMNS, layer_rows)
    (args.out / f"layer_{slug}.md").write_text(md)
    plot(layer_rows, args.out / f"layer_{slug}.png", info)
    return md


def summarize(layer_rows, back_rows, info) -> str:
    lines = benchmark.markdown_head("One-layer training step and backward kernels", info)
    # A row's key: (M, K, N, sparsity, dtype, impl, optimizer); dtype is the step's precision.
    t = {(r["M"], r["K"], r["N"], r["sparsity"], r.get("dtype", "fp32"), r["impl"], r["optimizer"]): r
         for r in layer_rows}
    keys = sorted({(r["M"], r["K"], r["N"], r["sparsity"], r.get("dtype", "fp32"), r["optimizer"]) for r in layer_rows})
    lines.append("GPU us per step (events) / graph-replay us / wall us / peak MiB. Speedups: GPU time of the baseline "
                 "over snack's (events, which also count the GPU waiting for the host); \"graph vs dense\": dense's "
                 "graph-replay time over snack's and over snack_fused_step's, the GPU work of the step alone. "
                 "Precision: fp32 (TF32 off), tf32 (allowed for torch's matmuls), bf16_autocast (the forward under "
                 "torch.autocast).")
    lines.append("")
    lines.append("| M x K | N | sparsity | precision | opt | " + " | ".join(IMPLS) +
                 " | vs dense | vs D+M | graph vs dense | memory vs dense |")
    lines.append("|---|---|---|---|---|" + "---|" * len(IMPLS) + "---|---|---|---|")
    for key in keys:
        cells, snack_row = [], t.get(key[:5] + ("snack", key[5]))
        for impl in IMPLS:
            r = t.get(key[:5] + (impl, key[5]))
            cells.append(f"{r['gpu_us']:.0f} / {r['graph_us']:.0f} / {r['wall_us']:.0f} / {r['peak_mib']:.1f}" if r else "-")
        d, dm = t.get(key[:5] + ("dense", key[5])), t.get(key[:5] + ("dense_mask", key[5]))
        sp = lambda b: f"{b['gpu_us'] / snack_row['gpu_us']:.2f}x" if b and snack_row else "-"  # noqa: E731
        mem = less_or_more(snack_row["peak_mib"], d["peak_mib"]) if d and snack_row else "-"
        fused = t.get(key[:5] + ("snack_fused_step", key[5]))
        graph = " / ".join(f"{d['graph_us'] / r['graph_us']:.2f}x"
                           if d and r and math.isfinite(d["graph_us"] / r["graph_us"]) else "-" for r in (snack_row, fused))
        lines.append(f"| {key[0]}x{key[1]} | {key[2]} | {key[3]} | {key[4]} | {key[5]} | " + " | ".join(cells) +
                     f" | {sp(d)} | {sp(dm)} | {graph} | {mem} |")
    key = (16384, 4096, 16, 0.9, "fp32")
    target_rows = []
    for opt_name, flavour in (("adamw", "default (foreach)"), ("adamw_fused", "fused=True")):
        d, dm = t.get(key + ("dense", opt_name)), t.get(key + ("dense_mask", opt_name))
        for impl in ("snack", "snack_fused_step"):
            r = t.get(key + (impl, opt_name))
            if r and d and dm:
                target_rows.append(
                    f"| {impl} | {flavour} | {r['graph_us']:.0f} | {dm['graph_us']:.0f} | {d['graph_us']:.0f} | "
                    f"{dm['graph_us'] / r['graph_us']:.2f}x | {d['graph_us'] / r['graph_us']:.2f}x | "
                    f"{dm['gpu_us'] / r['gpu_us']:.2f}x / {d['gpu_us'] / r['gpu_us']:.2f}x | "
                    f"{100 * (1 - r['peak_mib'] / d['peak_mib']):.0f}% |")
    if target_rows:
        lines += ["", "## Targets (16384x4096, N=16, 90%, AdamW): step >= 8x Dense+Mask, >= 3.7x dense, "
                  "peak memory >= 80% below dense", "",
                  "CUDA-graph replay (GPU time of the step alone); \"events\": CUDA events around an eager step, "
                  "which also count the GPU waiting for the host. torch AdamW: the flavour the baselines use, and "
                  "snack for its values and bias (snack); snack_fused_step updates both in the backward "
                  "(snack.optim.AdamW).", "",
                  "| snack as | torch AdamW | snack us | Dense+Mask us | dense us | vs Dense+Mask | vs dense | "
                  "events vs D+M / dense | memory below dense |", "|---|---|---|---|---|---|---|---|---|"] + target_rows
    b = {(r["op"], r["M"], r["K"], r["N"], r["sparsity"], r["impl"]): r for r in back_rows}
    lines += ["", "## Backward kernels (cold L2, median us)", "",
              "| op | M x K | N | sparsity | floor | snack | cuSPARSE | speedup |", "|---|---|---|---|---|---|---|---|"]
    ratios = {"dx": [], "dw": []}
    for key in sorted({k[:5] for k in b}):
        s = b.get(key + ("snack",))
        c = b.get(key + ("cusparse_csr" if key[0] == "dx" else "cusparse_sddmm",))
        if not s:
            continue
        if c:
            ratios[key[0]].append(c["median_us"] / s["median_us"])
        lines.append(f"| {key[0]} | {key[1]}x{key[2]} | {key[3]} | {key[4]} | {s['floor_us']:.1f} | {s['median_us']:.1f} | "
                     f"{c['median_us'] if c else float('nan'):.1f} | {c['median_us'] / s['median_us'] if c else float('nan'):.2f}x |")
    lines += ["", f"- dX geomean speedup over cuSPARSE: {benchmark.geomean(ratios['dx']):.2f}x (target >= 3x)",
              f"- dW geomean speedup over cuSPARSE sampled_addmm: {benchmark.geomean(ratios['dw']):.2f}x (target >= 3x)"]
    step_keys = sorted({k[:5] for k in b if k[0] == "dw_adamw"})
    if step_keys:
        lines += ["", "## Weight gradient and AdamW step of the values (cold L2, median us)", "",
                  "snack_fused: `sddmm_adamw_` (the update in the SDDMM's epilogue, what snack.optim.AdamW runs); "
                  "snack_unfused: `snack.ops.sddmm`, then torch's fused AdamW kernel on the gradient.", "",
                  "| M x K | N | sparsity | floor | fused | unfused | speedup |", "|---|---|---|---|---|---|---|"]
        for key in step_keys:
            f, u = b.get(key + ("snack_fused",)), b.get(key + ("snack_unfused",))
            if f and u:
                lines.append(f"| {key[1]}x{key[2]} | {key[3]} | {key[4]} | {f['floor_us']:.1f} | {f['median_us']:.1f} | "
                             f"{u['median_us']:.1f} | {u['median_us'] / f['median_us']:.2f}x |")
    forced = {}
    for key in sorted({k[:5] for k in b if k[0] == "dw"}):
        c = b.get(key + ("cusparse_sddmm",))
        for variant in SDDMM_VARIANTS:
            r = b.get(key + (f"snack_{variant}",))
            if c and r:
                forced.setdefault(variant, []).append(c["median_us"] / r["median_us"])
    for variant, values in forced.items():
        lines.append(f"- dW forced `{variant}` kernel, geomean speedup over cuSPARSE on the {len(values)} rows where it "
                     f"runs: {benchmark.geomean(values):.2f}x")
    lines += weight_grad_paths_table(b)
    lines += input_grad_paths_table(b)
    return "\n".join(lines) + "\n"


def input_grad_paths_table(b) -> list[str]:
    """dX with the CSC view read in place and over a copy (--csc-reads), beside the planner's choice,
    the forward on the same problem where it was timed, and dense."""
    keys = sorted({k[1:5] for k in b if k[0] == "dx" and b.get(k[:5] + ("snack_copied",))})
    if not keys:
        return []
    lines = ["", "## Input gradient (dX = dY W): the CSC view read in place or copied first (cold L2, median us)", "",
             "in place: the planner's kernel reads each slot through csc_perm; copied: one pass gathers the CSC "
             "view into a CSR copy of W^T, then the forward's planner and kernels run on it (`snack.csc_read`); "
             "snack: the planner's choice; fwd: the forward on the same weight and batch.", "",
             "| M x K | N | sparsity | fwd | in place | copied | snack | dense | copied vs in place | snack / fwd |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    gains = []
    for key in keys:
        get = lambda impl, op="dx": b.get((op,) + key + (impl,))  # noqa: E731
        fwd, inp, cop, auto, dense = get("snack", "fwd"), get("snack_in_place"), get("snack_copied"), get("snack"), get("dense")
        cell = lambda r: f"{r['median_us']:.1f}" if r else "-"  # noqa: E731
        gain = inp["median_us"] / cop["median_us"] if inp and cop else None
        if gain:
            gains.append(gain)
        over_fwd = f"{auto['median_us'] / fwd['median_us']:.2f}" if auto and fwd else "-"
        lines.append(f"| {key[0]}x{key[1]} | {key[2]} | {key[3]} | {cell(fwd)} | {cell(inp)} | {cell(cop)} | {cell(auto)} "
                     f"| {cell(dense)} | {f'{gain:.2f}x' if gain else '-'} | {over_fwd} |")
    if gains:
        lines += ["", f"- copied against in place, geomean over {len(gains)} rows: {benchmark.geomean(gains):.2f}x"]
    return lines


# The weight gradient's paths side by side, where a run timed them (--sddmm-variants, or N from
# snack.DENSE_BLOCK_MIN_ROWS): the planner's choice, each kernel forced, and the baselines.
DW_PATHS = ("snack", "snack_rows", "snack_vector", "snack_staged", "snack_tensor_core", "snack_dense_blocks", "dense",
            "cusparse_sddmm")


def weight_grad_paths_table(b) -> list[str]:
    forced = [impl for impl in DW_PATHS if impl.startswith("snack_")]
    keys = sorted({k[1:5] for k in b if k[0] == "dw" and any(b.get(k[:5] + (impl,)) for impl in forced)})
    if not keys:
        return []
    lines = ["", "## Weight gradient (dW = dY^T X at the stored slots): every path (cold L2, median us / useful TFLOP/s)",
             "", "useful TFLOP/s: 2 x nnz x N over the time, whatever the path; dense: `dY.t() @ x` (cuBLAS), "
             "cusparse_sddmm: `torch.sparse.sampled_addmm`; `-`: the path does not run the shape.", "",
             "| M x K | N | sparsity | " + " | ".join(DW_PATHS) + " |", "|---|---|---|" + "---|" * len(DW_PATHS)]
    for key in keys:
        cells = []
        for impl in DW_PATHS:
            r = b.get(("dw",) + key + (impl,))
            cells.append(f"{r['median_us']:.0f} / {r['tflops']:.1f}" if r else "-")
        lines.append(f"| {key[0]}x{key[1]} | {key[2]} | {key[3]} | " + " | ".join(cells) + " |")
    return lines


def plot_weight_grad_paths(back_rows, path, info):
    """Useful TFLOP/s of each dW path per problem (the rows of weight_grad_paths_table)."""
    plt = benchmark.pyplot()
    sel = [r for r in back_rows if r["op"] == "dw" and r["impl"] in DW_PATHS]
    if plt is None or not sel:
        return
    labels = sorted({(r["M"], r["K"], r["N"], r["sparsity"]) for r in sel})
    impls = [impl for impl in DW_PATHS if any(r["impl"] == impl for r in sel)]
    fig, ax = plt.subplots(figsize=(max(8, 0.6 * len(labels) * len(impls) / 3), 4.5))
    width = 0.8 / len(impls)
    for i, impl in enumerate(impls):
        vals = [next((r["tflops"] for r in sel if (r["M"], r["K"], r["N"], r["sparsity"]) == lab and r["impl"] == impl), 0)
                for lab in labels]
        ax.bar([j + i * width for j in range(len(labels))], vals, width, label=impl)
    ax.set_xticks([j + 0.4 for j in range(len(labels))])
    ax.set_xticklabels([f"{m}x{k}\nN={n}\n{s:g}" for m, k, n, s in labels], fontsize=6)
    ax.set_ylabel("useful TFLOP/s (2 nnz N / time)")
    ax.legend(fontsize=7)
    ax.set_title(f"dW paths, {sel[0]['dtype']} - {info['gpu']}, commit {benchmark.short_commit(info)}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot(layer_rows, path, info):
    plt = benchmark.pyplot()
    if plt is None:
        return
    # AdamW at 90% (the run's first sparsity if it has no 90%), in fp32 where the run has it, else in its
    # first precision; the graph-replay time, the GPU work of the step without the host's waits.
    adamw = [r for r in layer_rows if r["optimizer"] == "adamw"]
    if not adamw:
        return
    sparsity = 0.9 if any(r["sparsity"] == 0.9 for r in adamw) else adamw[0]["sparsity"]
    sel = [r for r in adamw if r["sparsity"] == sparsity]
    precision = "fp32" if any(r.get("dtype", "fp32") == "fp32" for r in sel) else sel[0]["dtype"]
    sel = [r for r in sel if r.get("dtype", "fp32") == precision]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = sorted({(r["M"], r["K"], r["N"]) for r in sel})
    percent = f"{100 * sparsity:g}%"
    for ax, field, title in zip(axes, ["graph_us", "peak_mib"],
                                [f"graph-replay us per step (AdamW, {percent})", f"peak MiB (AdamW, {percent})"]):
        width = 0.8 / len(IMPLS)
        for i, impl in enumerate(IMPLS):
            vals = [next((r[field] for r in sel if (r["M"], r["K"], r["N"]) == lab and r["impl"] == impl), 0) for lab in labels]
            ax.bar([j + i * width for j in range(len(labels))], vals, width, label=impl)
        ax.set_xticks([j + 0.4 for j in range(len(labels))])
        ax.set_xticklabels([f"{m}x{k}\nN={n}" for m, k, n in labels], fontsize=7, rotation=45, ha="right")
        ax.set_yscale("log")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.suptitle(f"one layer, fwd+bwd+step, {precision} - {info['gpu']}, commit {benchmark.short_commit(info)}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_16bit(back_rows, path, info):
    """Speedup of snack's dX and dW over dense cuBLAS in the same dtype, against N, a line per layer."""
    plt = benchmark.pyplot()
    if plt is None:
        return
    b = {(r["op"], r["M"], r["K"], r["N"], r["sparsity"], r["impl"]): r["median_us"] for r in back_rows}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, op in zip(axes, ("dx", "dw")):
        for m, k, sparsity in sorted({(r["M"], r["K"], r["sparsity"]) for r in back_rows}):
            ns = sorted({key[3] for key in b if key[:3] == (op, m, k) and key[4] == sparsity
                         and (op, m, k, key[3], sparsity, "dense") in b and (op, m, k, key[3], sparsity, "snack") in b})
            if ns:
                ax.plot(ns, [b[(op, m, k, n, sparsity, "dense")] / b[(op, m, k, n, sparsity, "snack")] for n in ns],
                        marker="o", label=f"{m}x{k} {sparsity:g}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("N")
        ax.set_ylabel(f"dense {op} us / snack {op} us")
        ax.set_title(f"{op}: speedup over dense {back_rows[0]['dtype'] if back_rows else ''}")
        ax.legend(fontsize=7)
    fig.suptitle(f"backward kernels - {info['gpu']}, commit {benchmark.short_commit(info)}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
