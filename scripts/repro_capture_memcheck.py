"""A torch-only reproducer: the CUDA-graph capture of a backward in which no parameter receives a
defined gradient fails under compute-sanitizer, and captures and replays without it.

snack.optim.AdamW updates a SparseLinear's values (and bias) inside the layer's backward, so the
autograd node returns no gradient for them. When no other parameter of the step receives one, the
capture of that step fails under `compute-sanitizer --tool memcheck` with
`cudaErrorStreamCaptureIsolation` on a `cudaStreamWaitEvent` in the autograd engine's
`run_backward`; it captures and replays without the sanitizer (seen on the H200 with torch 2.11 and
CUDA 13.0). This script shows the same with a ten-line torch-only autograd.Function:

    python scripts/repro_capture_memcheck.py none     # captured and replayed
    compute-sanitizer --tool memcheck python scripts/repro_capture_memcheck.py none    # FAILED
    compute-sanitizer --tool memcheck python scripts/repro_capture_memcheck.py zeros   # captured

`none`: the backward returns None for the parameter (as snack's fused optimizer does); `zeros`:
it returns a defined zero gradient."""

import sys

import torch

MODE = sys.argv[1] if len(sys.argv) > 1 else "none"


class UpdateInBackward(torch.autograd.Function):
    """y = x * w; the backward updates w itself and returns no gradient for it (mode `none`)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        with torch.no_grad():
            w.sub_(1e-3 * grad * x)
        return None, (None if MODE == "none" else torch.zeros_like(w))


def main() -> int:
    if MODE not in ("none", "zeros"):
        print("usage: repro_capture_memcheck.py none|zeros")
        return 2
    w = torch.nn.Parameter(torch.ones(1000, device="cuda"))
    x, target = torch.randn(1000, device="cuda"), torch.randn(1000, device="cuda")

    def step():
        ((UpdateInBackward.apply(x, w) - target) ** 2).mean().backward()

    try:
        side = torch.cuda.Stream()  # warm-up on a side stream, as capture requires
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - the point is to print what failed
        print(MODE, "FAILED:", str(exc).splitlines()[0])
        return 1
    print(MODE, "captured and replayed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
