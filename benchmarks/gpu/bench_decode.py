#!/usr/bin/env python3
"""Decode attention on the GPU: kvindex's kernels beside a device copy and
PyTorch's scaled_dot_product_attention, on the same tensors in one run.

One decode step = 1 query per query head against a KV cache of n tokens
(bf16, d = 128). kvindex's kernels are called through the C interface of
libkvindex_gpu_capi.so (gpu/capi.cu), which runs exactly what the GPU
index types run. Every figure is a median over repeated launches timed with
CUDA events, after warm-up; the KV cache of every configuration is many
times the L2 cache, so the timings are of HBM, not of the cache.

Usage (on the GPU machine; needs only the driver and PyTorch):
    python3 benchmarks/gpu/bench_decode.py --lib build-device/dist/libkvindex_gpu_capi.so \
        [--tokens 32768,131072,1048576] [--json out.json]
"""

import argparse
import ctypes
import json
import math
import statistics
import subprocess
import sys

import torch
import torch.nn.functional as F

BF16 = 1  # kvindex KVType



def parse_heads(text):
    """"q/kv" (e.g. "32/8") as (q_heads, kv_heads); a GQA group needs kv_heads
    dividing q_heads (a reshape deep in a timing loop failed otherwise)."""
    try:
        h_q, h_kv = (int(x) for x in text.split("/"))
    except ValueError:
        sys.exit(f"heads '{text}': expected q_heads/kv_heads, e.g. 32/8")
    if h_kv < 1 or h_q < h_kv or h_q % h_kv:
        sys.exit(f"heads '{text}': kv_heads must be >= 1 and divide q_heads")
    return h_q, h_kv

def load(lib_path):
    lib = ctypes.CDLL(lib_path)
    i64, i32, vp = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.kvgpu_last_error.restype = ctypes.c_char_p
    lib.kvgpu_dense_workspace.restype = i64
    lib.kvgpu_dense_workspace.argtypes = [i64, i32, i32, i32, i32]
    lib.kvgpu_dense_attention.restype = i32
    lib.kvgpu_dense_attention.argtypes = [vp, vp, i64, i64, i32, i32, i32, vp, i32, vp, vp, vp,
                                          i64, vp]
    lib.kvgpu_topk_workspace.restype = i64
    lib.kvgpu_topk_workspace.argtypes = [i64, i32, i32, i32, i32, i64, i64, i64]
    lib.kvgpu_set_slices_per_sm.restype = i32
    lib.kvgpu_set_slices_per_sm.argtypes = [i32]
    lib.kvgpu_topk_attention.restype = i32
    lib.kvgpu_topk_attention.argtypes = [vp, vp, i64, i64, i32, i32, i32, vp, i32, i64, i64, i64,
                                         vp, vp, vp, i64, vp]
    return lib


def check(lib, rc, what):
    if rc != 0:
        raise RuntimeError(f"{what}: {lib.kvgpu_last_error().decode()}")


def dense_step(lib, keys, values, q):
    """One decode step of the dense kernel (GpuIndexKVFlat's) over keys /
    values [h_kv][n][d] bf16 for q [h_kv][g][d] float32, on the current
    stream: (step, out [h_kv][g][d], lse [h_kv][g]), step() launching it."""
    h_kv, n, d = keys.shape
    g = q.shape[1]
    ws_bytes = lib.kvgpu_dense_workspace(n, h_kv, d, BF16, g)
    check(lib, 0 if ws_bytes >= 0 else -1, "dense workspace")
    ws = torch.empty(max(ws_bytes, 1), dtype=torch.uint8, device="cuda")
    out = torch.empty(h_kv, g, d, device="cuda")
    lse = torch.empty(h_kv, g, device="cuda")

    def step():
        check(lib, lib.kvgpu_dense_attention(keys.data_ptr(), values.data_ptr(), n, n, h_kv, d,
                                             BF16, q.data_ptr(), g, out.data_ptr(),
                                             lse.data_ptr(), ws.data_ptr(), ws_bytes,
                                             cur_stream()), "dense")

    return step, out, lse


def time_us(fn, reps, warmup=5):
    """Median time of fn() in microseconds, by CUDA events around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    return statistics.median(times), times


def cur_stream():
    """The stream our kernels run on: the current one at call time (a
    graph capture runs on a side stream)."""
    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)


def time_graph_us(fn, reps, warmup=3):
    """Median time of one replay of fn captured in a CUDA graph: the GPU
    work of a step without the host's launch gaps (a decode loop that
    replays a captured step, as serving stacks do, pays only this).
    Returns (median, times) like time_us."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return time_us(graph.replay, reps)


def kernel_profile(fn, iters=20, top=12):
    """GPU time per call of fn, kernel by kernel (PyTorch's profiler, CUPTI:
    it sees the kernels our library launches too): [(name, launches per
    call, us per call)], largest first."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = getattr(e, "cuda_time_total", 0)
        if t > 0:
            rows.append((e.key[:70], e.count / iters, t / iters))
    rows.sort(key=lambda r: -r[2])
    return rows[:top]


def print_profile(title, rows):
    print(f"  kernels of one {title} (GPU us per call):")
    for name, calls, us in rows:
        print(f"    {us:8.1f} us  x{calls:4.1f}  {name}")


def copy_bandwidth(gib=2.0, reps=30):
    """Device-to-device copy: bytes read + bytes written per second."""
    n = int(gib * (1 << 30))
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    t, _ = time_us(lambda: dst.copy_(src), reps)
    del src, dst
    torch.cuda.empty_cache()
    return 2.0 * n / (t * 1e-6)


def sdpa_timings(q, k, v, gqa, reps):
    """PyTorch SDPA: the default dispatch, and each backend forced where it runs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    out = {}
    fn = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    out["default"] = time_us(fn, reps)[0]
    for name, backend in [("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION)]:
        try:
            with sdpa_kernel(backend):
                fn()
                torch.cuda.synchronize()
                out[name] = time_us(fn, reps)[0]
        except Exception as e:  # a backend that refuses these shapes
            out[name] = None
            out[name + "_error"] = str(e).splitlines()[0][:120]
    return out


def sweep_slices(lib, n, h_kv, h_q, d, reps, copy_bps, values):
    """Dense and top-k 1% time per setting of the blocks per multiprocessor."""
    g = h_q // h_kv
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    keys = (torch.randn(h_kv, n, d, device="cuda") + 0.5).to(torch.bfloat16)
    values_t = torch.randn(h_kv, n, d, device="cuda").to(torch.bfloat16)
    q = torch.randn(h_kv, g, d, device="cuda") * 1.5 - 0.5
    out = torch.empty(h_kv, g, d, device="cuda")
    lse = torch.empty(h_kv, g, device="cuda")
    k = max(1, n // 100)
    ws_bytes = max(lib.kvgpu_dense_workspace(n, h_kv, d, BF16, g),
                   lib.kvgpu_topk_workspace(n, h_kv, d, BF16, g, 0, 0, k))
    ws = torch.empty(ws_bytes, dtype=torch.uint8, device="cuda")
    rows = []
    for v in values:
        check(lib, lib.kvgpu_set_slices_per_sm(v), "slices")
        dense = lambda: check(lib, lib.kvgpu_dense_attention(
            keys.data_ptr(), values_t.data_ptr(), n, n, h_kv, d, BF16, q.data_ptr(), g,
            out.data_ptr(), lse.data_ptr(), ws.data_ptr(), ws_bytes, stream), "dense")
        topk = lambda: check(lib, lib.kvgpu_topk_attention(
            keys.data_ptr(), values_t.data_ptr(), n, n, h_kv, d, BF16, q.data_ptr(), g, 0, 0, k,
            out.data_ptr(), lse.data_ptr(), ws.data_ptr(), ws_bytes, stream), "topk")
        td, _ = time_us(dense, reps)
        tt, _ = time_us(topk, reps)
        frac = 2 * h_kv * n * d * 2 / (td * 1e-6) / copy_bps
        rows.append({"tokens": n, "q_heads": h_q, "kv_heads": h_kv, "slices_per_sm": v,
                     "dense_us": td, "dense_of_copy": frac, "topk1pct_us": tt})
        print(f"sweep n={n:>8} heads {h_q}/{h_kv} slices/SM {v:>2}: dense {td:9.1f} us "
              f"({100 * frac:.0f}% of copy), top-k 1% {tt:9.1f} us", flush=True)
    check(lib, lib.kvgpu_set_slices_per_sm(8), "slices")
    del keys, values_t, ws
    torch.cuda.empty_cache()
    return rows


def bench_config(lib, n, h_kv, h_q, d, reps, copy_bps, check_ref):
    g = h_q // h_kv
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    torch.manual_seed(n + h_kv)
    # keys around a common offset and queries on its far side (out of
    # distribution, as real decode queries are), values Gaussian
    keys = (torch.randn(h_kv, n, d, device="cuda") + 0.5).to(torch.bfloat16)
    values = torch.randn(h_kv, n, d, device="cuda").to(torch.bfloat16)
    q = torch.randn(h_kv, g, d, device="cuda") * 1.5 - 0.5
    row = {"tokens": n, "kv_heads": h_kv, "q_heads": h_q, "d": d, "dtype": "bf16"}

    # dense (GpuIndexKVFlat's kernel)
    dense, out, lse = dense_step(lib, keys, values, q)

    out.fill_(float("nan"))
    dense()
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "dense output not fully written"
    t_dense, _ = time_us(dense, reps)
    row["dense_graph_us"] = time_graph_us(dense, reps)[0]
    kv_bytes = 2 * h_kv * n * d * 2
    row["dense_us"] = t_dense
    row["dense_bytes"] = kv_bytes
    row["dense_bps"] = kv_bytes / (t_dense * 1e-6)
    row["dense_of_copy"] = row["dense_bps"] / copy_bps

    # PyTorch SDPA on the same tensors (query in bf16, as SDPA requires)
    q4 = q.reshape(1, h_q, 1, d).to(torch.bfloat16)
    k4, v4 = keys.unsqueeze(0), values.unsqueeze(0)
    ref = F.scaled_dot_product_attention(q4, k4, v4, enable_gqa=g > 1).float().reshape(h_kv, g, d)
    row["err_vs_sdpa"] = ((out - ref).norm() / ref.norm()).item()
    row["sdpa_us"] = sdpa_timings(q4, k4, v4, g > 1, reps)

    if check_ref:
        # float32 reference for the output and lse (our query in float32)
        kf, vf = keys.float(), values.float()
        s = torch.einsum("hgd,hnd->hgn", q, kf) / math.sqrt(d)
        ref_lse = torch.logsumexp(s, dim=-1)
        ref_out = torch.einsum("hgn,hnd->hgd", torch.softmax(s, dim=-1), vf)
        row["err_vs_fp32"] = ((out - ref_out).norm() / ref_out.norm()).item()
        row["lse_err_vs_fp32"] = (lse - ref_lse).abs().max().item()
        del kf, vf, s

    # top-k, k = 1% of the tokens (GpuIndexTopK's kernels), bare and with the
    # usual static part (sink 4, window 64)
    k = max(1, n // 100)
    for label, n_sink, n_window in [("topk1pct", 0, 0), ("topk1pct_sink4_window64", 4, 64)]:
        tws_bytes = lib.kvgpu_topk_workspace(n, h_kv, d, BF16, g, n_sink, n_window, k)
        check(lib, 0 if tws_bytes >= 0 else -1, "topk workspace")
        tws = torch.empty(max(tws_bytes, 1), dtype=torch.uint8, device="cuda")
        tout = torch.empty_like(out)
        tlse = torch.empty_like(lse)

        def topk():
            check(lib, lib.kvgpu_topk_attention(keys.data_ptr(), values.data_ptr(), n, n, h_kv, d,
                                                BF16, q.data_ptr(), g, n_sink, n_window, k,
                                                tout.data_ptr(), tlse.data_ptr(), tws.data_ptr(),
                                                tws_bytes, cur_stream()), "topk")

        tout.fill_(float("nan"))
        topk()
        torch.cuda.synchronize()
        assert torch.isfinite(tout).all(), "top-k output not fully written"
        t_topk, _ = time_us(topk, reps)
        row[label + "_graph_us"] = time_graph_us(topk, reps)[0]
        # what the method must read: every key once (scores), then the
        # values and keys of the selected and static tokens per row
        touched = h_kv * n * d * 2 + h_q * (k + n_sink + n_window) * 2 * d * 2
        row[label + "_us"] = t_topk
        row[label + "_k"] = k
        row[label + "_bytes"] = touched
        row[label + "_bps"] = touched / (t_topk * 1e-6)
        row[label + "_speedup_vs_dense"] = t_dense / t_topk
        row[label + "_err_vs_dense"] = ((tout - out).norm() / out.norm()).item()
        del tws
    del keys, values, dense
    torch.cuda.empty_cache()
    return row


def device_info():
    """The device, driver and torch of the run, and the device-to-device copy
    rate (the bandwidth figure every benchmark divides by), printed as the
    run's header and returned for its JSON."""
    props = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True).stdout.strip()
    except OSError:
        driver = "?"
    info = {"device": props.name, "multiprocessors": props.multi_processor_count,
            "memory_gib": props.total_memory / (1 << 30), "driver": driver,
            "torch": torch.__version__, "torch_cuda": torch.version.cuda}
    info["copy_bps"] = copy_bps = copy_bandwidth()
    print(f"# {info['device']}, driver {driver}, torch {torch.__version__} (CUDA {torch.version.cuda})")
    print(f"# device-to-device copy: {copy_bps / 1e12:.3f} TB/s (read + written)")
    return info


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--tokens", default="32768,131072,1048576")
    ap.add_argument("--heads", default="32/32,32/8", help="q_heads/kv_heads configurations")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json")
    ap.add_argument("--sweep-slices", default="",
                    help="comma list of blocks per multiprocessor: time dense / top-k per value, "
                         "instead of the comparison table")
    args = ap.parse_args()

    lib = load(args.lib)
    info = device_info()
    copy_bps = info["copy_bps"]
    rows = []
    if args.sweep_slices:
        values = [int(v) for v in args.sweep_slices.split(",")]
        for heads in args.heads.split(","):
            h_q, h_kv = parse_heads(heads)
            for n in (int(t) for t in args.tokens.split(",")):
                rows += sweep_slices(lib, n, h_kv, h_q, args.d, args.reps, copy_bps, values)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"info": info, "sweep": rows}, f, indent=1)
        return 0
    for heads in args.heads.split(","):
        h_q, h_kv = parse_heads(heads)
        for n in (int(t) for t in args.tokens.split(",")):
            row = bench_config(lib, n, h_kv, h_q, args.d, args.reps, copy_bps,
                               check_ref=n <= 131072)
            rows.append(row)
            sd = row["sdpa_us"]
            best = min((v, k) for k, v in sd.items() if isinstance(v, float))
            print(f"n={n:>8} heads {h_q}/{h_kv}: dense {row['dense_us']:9.1f} us "
                  f"({row['dense_bps'] / 1e12:.2f} TB/s, {100 * row['dense_of_copy']:.0f}% of copy) | "
                  f"SDPA {best[0]:9.1f} us ({best[1]}) | top-k 1% {row['topk1pct_us']:8.1f} us "
                  f"({row['topk1pct_speedup_vs_dense']:.2f}x dense) | "
                  f"err vs SDPA {row['err_vs_sdpa']:.1e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
