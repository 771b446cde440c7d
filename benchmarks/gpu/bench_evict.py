#!/usr/bin/env python3
"""Eviction scores on the GPU: kvindex's proxy_scores kernels beside the same
computation in PyTorch, on the same tensors in one run.

IndexProxyEvict scores a prompt of n tokens with F_j = sum over the proxy
query rows r of softmax_r(q_r . K / sqrt(d))_j (GQA: the query heads of a
group summed). Two workloads per prompt length, d = 128, a GQA group of 4
query heads:
  - NaCl: the proxy window = the last 18% of the prompt, non-causal;
  - H2O: every prompt query, causal (skipped above 32k tokens when the time
    measured at 32k, scaled by (n / 32k)^2, predicts more than --h2o-max-s
    per call).
kvindex runs two tiled float32 passes on the CUDA cores (gpu/proxy_scores.h,
through libkvindex_gpu_capi.so: what GpuIndexProxyEvict runs); PyTorch
computes the same scores in float32 (TF32 off) by chunks of rows: S = Q K^T
/ sqrt(d) (masked when causal), lse = logsumexp(S), F += exp(S - lse) summed
over the rows in float64, keeping its memory under ~2 GB. Times are medians
of CUDA-event timings after a warm-up call. GFLOP/s counts 2 passes x
2 * rows * n * d flops for kvindex (its causal passes skip the masked tiles:
"visible" counts only the key-query pairs a row sees) and 2 * rows * n * d
for PyTorch's one matmul.

Then one decode step of GpuIndexProxyEvict after eviction (--keep of the
prompt kept, 32 query heads, bf16): the dense kernel over the kept tokens,
which is what the index runs, beside the dense kernel and SDPA over all.

Usage (on the GPU machine; needs only the driver and PyTorch):
    python3 benchmarks/gpu/bench_evict.py --lib build-device/dist/libkvindex_gpu_capi.so \\
        [--tokens 8192,32768,131072] [--json out.json]
"""

import argparse
import ctypes
import json
import math
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_decode import (parse_heads, check, copy_bandwidth, dense_step, load, sdpa_timings,  # noqa: E402
                          time_graph_us, time_us)


def load_evict(lib_path):
    lib = load(lib_path)
    i64, i32, vp = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.kvgpu_proxy_scores_workspace.restype = i64
    lib.kvgpu_proxy_scores_workspace.argtypes = [i64, i32, i32, i64, i32]
    lib.kvgpu_proxy_scores.restype = i32
    lib.kvgpu_proxy_scores.argtypes = [vp, i64, i32, vp, i32, i64, vp, i64, i32, vp, vp, i64, vp]
    return lib


def time_ms(fn, reps):
    """Median of reps timed calls (CUDA events), after one warm-up call."""
    return time_us(fn, reps, warmup=1)[0] * 1e-3


def reps_for(fn, budget_s, most):
    """How many timed calls fit in budget_s, from one untimed call (>= 2)."""
    torch.cuda.synchronize()
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    t = a.elapsed_time(b) * 1e-3
    return max(2, min(most, int(budget_s / max(t, 1e-6)))), t


def torch_scores(keys, queries, q_pos, n_heads, causal, chunk_bytes=512 << 20):
    """F in float64 from float32 matmuls, by chunks of query rows."""
    n, d = keys.shape
    rows = queries.shape[0]
    n_q = rows // n_heads
    scale = 1.0 / math.sqrt(d)
    F = torch.zeros(n, dtype=torch.float64, device=keys.device)
    cols = torch.arange(n, device=keys.device)
    step = max(1, chunk_bytes // (4 * n))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        s = torch.matmul(queries[r0:r1], keys.t())
        s.mul_(scale)
        if causal:
            lim = q_pos[torch.arange(r0, r1, device=keys.device) % n_q]  # first_pos = 0
            s.masked_fill_(cols[None, :] > lim[:, None], float("-inf"))
        lse = torch.logsumexp(s, dim=1, keepdim=True)
        lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # a row seeing nothing
        s.sub_(lse).exp_()
        F += s.sum(dim=0, dtype=torch.float64)
        del s
    return F


def bench(lib, method, n, d, n_heads, n_q, causal, budget_s, stream):
    torch.manual_seed(n + (1 if causal else 0))
    # keys around a common offset, queries on its far side (out of
    # distribution, as LLM queries are for their keys)
    keys = (torch.randn(n, d, device="cuda") + 0.5).contiguous()
    queries = (torch.randn(n_heads * n_q, d, device="cuda") * 1.5 - 0.5).contiguous()
    q_pos = torch.arange(n - n_q, n, device="cuda", dtype=torch.int64)
    rows = n_heads * n_q
    ws_bytes = lib.kvgpu_proxy_scores_workspace(n, d, n_heads, n_q, int(causal))
    check(lib, 0 if ws_bytes >= 0 else -1, "proxy_scores workspace")
    ws = torch.empty(max(ws_bytes, 1), dtype=torch.uint8, device="cuda")
    scores = torch.full((n,), float("nan"), device="cuda")

    def ours():
        check(lib, lib.kvgpu_proxy_scores(keys.data_ptr(), n, d, queries.data_ptr(), n_heads, n_q,
                                          q_pos.data_ptr(), 0, int(causal), scores.data_ptr(),
                                          ws.data_ptr(), ws_bytes, stream), "proxy_scores")

    ours()
    torch.cuda.synchronize()
    assert torch.isfinite(scores).all(), "scores not fully written"
    reps, _ = reps_for(ours, budget_s, 20)
    t_ours = time_ms(ours, reps)

    ref_holder = {}

    def ref():
        ref_holder["F"] = torch_scores(keys, queries, q_pos, n_heads, causal)

    reps_t, _ = reps_for(ref, budget_s, 10)
    t_torch = time_ms(ref, reps_t)
    F = ref_holder["F"]
    diff = (scores.double() - F).abs()
    err_max = (diff.max() / F.abs().max()).item()
    err_l2 = ((scores.double() - F).norm() / F.norm()).item()

    flops = 2 * 2 * rows * n * d
    if causal:  # pairs a row sees: keys 0 .. q_pos (first_pos = 0)
        visible = n_heads * int((q_pos + 1).clamp(max=n).sum().item())
    else:
        visible = rows * n
    row = {"method": method, "tokens": n, "d": d, "q_heads": n_heads, "n_q": n_q, "rows": rows,
           "causal": causal, "workspace_bytes": ws_bytes, "ours_ms": t_ours, "torch_ms": t_torch,
           "ours_gflops": flops / (t_ours * 1e-3) / 1e9,
           "ours_gflops_visible": 2 * 2 * visible * d / (t_ours * 1e-3) / 1e9,
           "torch_gflops": 2 * rows * n * d / (t_torch * 1e-3) / 1e9,
           "speedup_vs_torch": t_torch / t_ours, "rel_err_max": err_max, "rel_err_l2": err_l2,
           "reps": reps, "reps_torch": reps_t}
    del keys, queries, q_pos, ws, scores, F, ref_holder
    torch.cuda.empty_cache()
    return row


def dense_step_us(lib, keys, values, q, reps):
    """(eager, graph) us of one step of the dense kernel (GpuIndexKVFlat's)
    over keys / values [h_kv][n][d] bf16 for q [h_kv][g][d] float32."""
    step = dense_step(lib, keys, values, q)[0]
    return time_us(step, reps)[0], time_graph_us(step, reps)[0]


def decode_step(lib, n, keep, d, h_q, h_kv, reps, copy_bps):
    """One decode step of GpuIndexProxyEvict after its prefill kept `keep` of
    n tokens: the index stores only the kept tokens, compacted, and its
    attend is the dense kernel over them (gpu/GpuIndexProxyEvict.cpp,
    attend_heads), so the step is timed as that kernel over keep * n
    tokens, beside the dense kernel and SDPA over all n on the same run."""
    torch.manual_seed(n)
    g = h_q // h_kv
    n_keep = max(1, round(keep * n))
    q = torch.randn(h_kv, g, d, device="cuda") * 1.5 - 0.5
    row = {"tokens": n, "kept": n_keep, "q_heads": h_q, "kv_heads": h_kv, "d": d}
    keys = (torch.randn(h_kv, n, d, device="cuda") + 0.5).to(torch.bfloat16)
    values = torch.randn(h_kv, n, d, device="cuda").to(torch.bfloat16)
    row["dense_us"], row["dense_graph_us"] = dense_step_us(lib, keys, values, q, reps)
    q4 = q.reshape(1, h_q, 1, d).to(torch.bfloat16)
    sd = sdpa_timings(q4, keys.unsqueeze(0), values.unsqueeze(0), g > 1, reps)
    row["sdpa_us"] = min(v for v in sd.values() if isinstance(v, float))
    kept_k, kept_v = keys[:, :n_keep].contiguous(), values[:, :n_keep].contiguous()
    del keys, values
    row["evict_us"], row["evict_graph_us"] = dense_step_us(lib, kept_k, kept_v, q, reps)
    row["evict_bytes"] = 2 * h_kv * n_keep * d * 2
    row["evict_of_copy"] = row["evict_bytes"] / (row["evict_graph_us"] * 1e-6) / copy_bps
    del kept_k, kept_v
    torch.cuda.empty_cache()
    print(f"decode n={n:>8} heads {h_q}/{h_kv}, {100 * keep:.0f}% kept: evict step "
          f"{row['evict_us']:8.1f} us (graph {row['evict_graph_us']:8.1f}) | dense "
          f"{row['dense_us']:8.1f} us (graph {row['dense_graph_us']:8.1f}) | SDPA "
          f"{row['sdpa_us']:8.1f} us | {row['dense_us'] / row['evict_us']:.2f}x dense, graph "
          f"{row['dense_graph_us'] / row['evict_graph_us']:.2f}x | graph at "
          f"{100 * row['evict_of_copy']:.0f}% of copy", flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--tokens", default="8192,32768,131072")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4, help="query heads of the GQA group")
    ap.add_argument("--window", type=float, default=0.18, help="NaCl's proxy window, share of n")
    ap.add_argument("--h2o-max-s", type=float, default=2.0,
                    help="skip H2O above 32k tokens when a call would take longer (predicted)")
    ap.add_argument("--budget-s", type=float, default=1.5,
                    help="time spent on the timed calls of one configuration and side")
    ap.add_argument("--decode-tokens", default="32768,131072,1048576",
                    help="contexts of the decode step after eviction ('' for none)")
    ap.add_argument("--decode-heads", default="32/32", help="q_heads/kv_heads of the decode step")
    ap.add_argument("--keep", type=float, default=0.2, help="share of the prompt kept")
    ap.add_argument("--reps", type=int, default=30, help="timed decode steps")
    ap.add_argument("--json")
    args = ap.parse_args()

    torch.backends.cuda.matmul.allow_tf32 = False  # float32 as kvindex: no TF32 rounding
    torch.set_float32_matmul_precision("highest")
    lib = load_evict(args.lib)
    props = torch.cuda.get_device_properties(0)
    info = {"device": props.name, "multiprocessors": props.multi_processor_count,
            "torch": torch.__version__, "torch_cuda": torch.version.cuda}
    print(f"# {props.name}, torch {torch.__version__} (CUDA {torch.version.cuda}), d={args.d}, "
          f"GQA group of {args.heads} query heads")
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    header = (f"{'method':<6} {'tokens':>7} {'rows':>7} {'kvindex ms':>11} {'torch ms':>10} "
              f"{'speedup':>8} {'kvindex GF/s':>13} {'visible GF/s':>13} {'torch GF/s':>11} "
              f"{'max rel err':>11}")
    print(header)
    rows = []
    h2o_32k_s = None
    for n in (int(t) for t in args.tokens.split(",")):
        configs = [("NaCl", max(1, round(args.window * n)), False)]
        if n <= 32768:
            configs.append(("H2O", n, True))
        elif h2o_32k_s is not None and h2o_32k_s * (n / 32768) ** 2 <= args.h2o_max_s:
            configs.append(("H2O", n, True))
        else:
            print(f"# H2O at {n} tokens skipped (predicted > {args.h2o_max_s} s per call)")
        for method, n_q, causal in configs:
            row = bench(lib, method, n, args.d, args.heads, n_q, causal, args.budget_s, stream)
            if method == "H2O" and n == 32768:
                h2o_32k_s = max(row["ours_ms"], row["torch_ms"]) * 1e-3
            rows.append(row)
            print(f"{method:<6} {n:>7} {row['rows']:>7} {row['ours_ms']:>11.2f} "
                  f"{row['torch_ms']:>10.2f} {row['speedup_vs_torch']:>7.2f}x "
                  f"{row['ours_gflops']:>13.0f} {row['ours_gflops_visible']:>13.0f} "
                  f"{row['torch_gflops']:>11.0f} {row['rel_err_max']:>11.1e}", flush=True)
            if row["rel_err_max"] > 1e-4:
                print(f"# WARNING: {method} n={n}: kvindex and PyTorch differ by "
                      f"{row['rel_err_max']:.1e} of the largest score")
    decode = []
    if args.decode_tokens:
        copy_bps = copy_bandwidth()
        info["copy_bps"] = copy_bps
        print(f"# decode after eviction: device-to-device copy {copy_bps / 1e12:.3f} TB/s")
        h_q, h_kv = parse_heads(args.decode_heads)
        for n in (int(t) for t in args.decode_tokens.split(",")):
            decode.append(decode_step(lib, n, args.keep, args.d, h_q, h_kv, args.reps, copy_bps))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "rows": rows, "decode": decode}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
