#!/usr/bin/env python3
"""MagicPIG's LSH sampling on the GPU (kvgpu_lsh_attention, the kernels of
GpuIndexLSHSample) beside dense attention (kvgpu_dense_attention), on the
same tensors in one run.

One decode step = 1 query per query head against a KV cache of n tokens
(bf16, d = 128), MagicPIG's setting: Sink4,Window64, K x L = 10 x 150,
min_hits 2, hyperplanes shared by the heads (one seed). The CSR tables are
built here on the device with PyTorch, as IndexLSHSample::build_tables lays
them out: the codes of the centred middle keys (one fp32 product with the
planes), a stable sort per table, the bucket starts by searchsorted. Every
time is a median of CUDA-event timings after warm-up.

Reported per configuration: microseconds of the LSH step and of the dense
step; the fraction of the middle's keys sampled (mean over rows, from the
sample sizes); the bytes the LSH step must touch (the ids of the query's L
buckets, 4 bytes each, the sampled keys and values, the static part, the
planes once) and that rate against a device copy's; the output's relative
error against a float32 PyTorch reference of the same unbiased estimator on
the kernel's own sample (the exact u of every sampled key from the kernel),
and against dense exact attention (the estimator's own error).

Usage (on the GPU machine; needs only the driver and PyTorch):
    python3 benchmarks/gpu/bench_lsh.py --lib build-device/dist/libkvindex_gpu_capi.so \\
        [--tokens 32768,131072,1048576] [--heads 32/32,32/8] [--json out.json]
"""

import argparse
import ctypes
import json
import math
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_decode import (parse_heads, BF16, check, cur_stream, dense_step, device_info, kernel_profile,  # noqa: E402
                          load, print_profile, sdpa_timings, time_graph_us, time_us)

N_SINK, N_WINDOW = 4, 64


def load_lsh(lib_path):
    lib = load(lib_path)
    i64, i32, vp = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.kvgpu_lsh_workspace.restype = i64
    lib.kvgpu_lsh_workspace.argtypes = [i64, i32, i32, i32, i32, i64, i64, i32, i32, i32, i64, i64]
    lib.kvgpu_lsh_select_workspace.restype = i64
    lib.kvgpu_lsh_select_workspace.argtypes = lib.kvgpu_lsh_workspace.argtypes
    # keys, values, head_stride, n_tokens, n_heads, d, type, q, rows_per_head, n_sink,
    # n_window, K, L, min_hits, planes, planes_stride, mean, mean_stride, norms,
    # norms_stride, offsets, ids, n_indexed, recent_offsets, recent_ids, n_recent, tail_codes
    common = [vp, vp, i64, i64, i32, i32, i32, vp, i32, i64, i64, i32, i32, i32, vp, i64, vp, i64,
              vp, i64, vp, vp, i64, vp, vp, i64, vp]
    lib.kvgpu_lsh_attention.restype = i32
    lib.kvgpu_lsh_attention.argtypes = common + [vp, vp, vp, i64, vp]
    lib.kvgpu_lsh_select.restype = i32
    lib.kvgpu_lsh_select.argtypes = common + [vp, vp, vp, vp, i64, vp]
    return lib


def build_tables(keys, planes, K, L, chunk=1 << 17):
    """IndexLSHSample's tables of the middle of every head, on the device.

    keys [h, n, d] bf16; planes [K L, d] float32. Returns mean [h, d],
    norms [h, m], offsets [h, L, 2^K + 1] int32 (uint32 bits), ids [h, L, m]
    int32 (inner ids), m = n - sink - window."""
    h, n, d = keys.shape
    m = n - N_SINK - N_WINDOW
    B = 1 << K
    weights = (1 << torch.arange(K, device="cuda", dtype=torch.int32))
    mean = torch.empty(h, d, device="cuda")
    norms = torch.empty(h, m, device="cuda")
    offsets = torch.empty(h, L, B + 1, device="cuda", dtype=torch.int32)
    ids = torch.empty(h, L, m, device="cuda", dtype=torch.int32)
    bounds = torch.arange(B + 1, device="cuda", dtype=torch.int32).expand(L, B + 1).contiguous()
    for hh in range(h):
        mid = keys[hh, N_SINK:N_SINK + m]
        # the mean of the keys hashed (the whole middle, as one prompt)
        acc = torch.zeros(d, device="cuda", dtype=torch.float64)
        for c0 in range(0, m, chunk):
            acc += mid[c0:c0 + chunk].double().sum(0)
        mean[hh] = (acc / m).float()
        codes = torch.empty(L, m, device="cuda", dtype=torch.int32)
        for c0 in range(0, m, chunk):
            kc = mid[c0:c0 + chunk].float() - mean[hh]
            norms[hh, c0:c0 + kc.shape[0]] = kc.norm(dim=1)
            bits = (kc @ planes.t() > 0).view(-1, L, K).int()
            codes[:, c0:c0 + kc.shape[0]] = (bits * weights).sum(-1, dtype=torch.int32).t()
            del kc, bits
        # ids ascending within each bucket (a stable sort), bucket starts
        # = how many codes precede each bucket
        sorted_codes, order = torch.sort(codes, dim=1, stable=True)
        ids[hh] = order.int()
        offsets[hh] = torch.searchsorted(sorted_codes, bounds).int()
        del codes, sorted_codes, order
    return mean, norms, offsets, ids


def bucket_ids_walked(q, planes, offsets, K, L, g):
    """Ids the walk reads per row: the sizes of the query's L buckets."""
    h_kv = offsets.shape[0]
    weights = (1 << torch.arange(K, device="cuda", dtype=torch.int64))
    bits = (q.reshape(h_kv * g, -1) @ planes.t() > 0).view(h_kv * g, L, K).long()
    codes = (bits * weights).sum(-1)  # [rows, L]
    head = torch.arange(h_kv * g, device="cuda") // g
    off = offsets.long()[head]  # [rows, L, B + 1]
    start = off.gather(2, codes.unsqueeze(-1)).squeeze(-1)
    end = off.gather(2, (codes + 1).unsqueeze(-1)).squeeze(-1)
    return (end - start).sum(1)  # [rows]


def bench_config(lib, n, h_kv, h_q, d, K, L, min_hits, reps, copy_bps, seed, profile=False,
                 slices=()):
    g = h_q // h_kv
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    torch.manual_seed(n + h_kv)
    t0 = time.time()
    # keys around a common offset and queries on its far side (out of
    # distribution, as real decode queries are), values Gaussian
    keys = torch.empty(h_kv, n, d, device="cuda", dtype=torch.bfloat16)
    values = torch.empty_like(keys)
    for hh in range(h_kv):  # a head at a time: no float32 copy of the whole cache
        keys[hh] = (torch.randn(n, d, device="cuda") + 0.5).to(torch.bfloat16)
        values[hh] = torch.randn(n, d, device="cuda").to(torch.bfloat16)
    q = torch.randn(h_kv, g, d, device="cuda") * 1.5 - 0.5
    gen = torch.Generator(device="cuda").manual_seed(seed)
    planes = torch.randn(K * L, d, device="cuda", generator=gen)
    mean, norms, offsets, ids = build_tables(keys, planes, K, L)
    torch.cuda.synchronize()
    build_s = time.time() - t0
    m = n - N_SINK - N_WINDOW
    row = {"tokens": n, "kv_heads": h_kv, "q_heads": h_q, "d": d, "dtype": "bf16", "K": K, "L": L,
           "min_hits": min_hits, "n_sink": N_SINK, "n_window": N_WINDOW, "table_build_s": build_s}

    # dense (GpuIndexKVFlat's kernel) on the same tensors
    dense, dout, dlse = dense_step(lib, keys, values, q)

    # the tables' arguments, shared by attention and select
    tables = [K, L, min_hits, planes.data_ptr(), 0, mean.data_ptr(), d, norms.data_ptr(), m,
              offsets.data_ptr(), ids.data_ptr(), m, None, None, 0, None]
    head = [keys.data_ptr(), values.data_ptr(), n, n, h_kv, d, BF16, q.data_ptr(), g, N_SINK,
            N_WINDOW]
    ws_bytes = lib.kvgpu_lsh_workspace(n, h_kv, d, BF16, g, N_SINK, N_WINDOW, K, L, min_hits, m, 0)
    check(lib, 0 if ws_bytes >= 0 else -1, "lsh workspace")
    ws = torch.empty(max(ws_bytes, 1), dtype=torch.uint8, device="cuda")
    out = torch.empty(h_kv, g, d, device="cuda")
    lse = torch.empty(h_kv, g, device="cuda")

    def lsh():
        check(lib, lib.kvgpu_lsh_attention(*head, *tables, out.data_ptr(), lse.data_ptr(),
                                           ws.data_ptr(), ws_bytes, cur_stream()), "lsh")

    n_rows = h_kv * g
    sws_bytes = lib.kvgpu_lsh_select_workspace(n, h_kv, d, BF16, g, N_SINK, N_WINDOW, K, L,
                                               min_hits, m, 0)
    check(lib, 0 if sws_bytes >= 0 else -1, "select workspace")
    sws = torch.empty(max(sws_bytes, 1), dtype=torch.uint8, device="cuda")
    s_ids = torch.empty(n_rows, m, dtype=torch.int32, device="cuda")
    s_lens = torch.empty(n_rows, dtype=torch.int32, device="cuda")
    s_u = torch.empty(n_rows, m, device="cuda")

    def select(with_u):
        check(lib, lib.kvgpu_lsh_select(*head, *tables, s_ids.data_ptr(), s_lens.data_ptr(),
                                        s_u.data_ptr() if with_u else None, sws.data_ptr(),
                                        sws_bytes, cur_stream()), "lsh select")

    row["dense_us"] = time_us(dense, reps)[0]
    # PyTorch SDPA on the same tensors (query in bf16), its fastest backend
    q4 = q.reshape(1, h_q, 1, d).to(torch.bfloat16)
    sd = sdpa_timings(q4, keys.unsqueeze(0), values.unsqueeze(0), g > 1, reps)
    row["sdpa_us"] = sd
    row["sdpa_best_us"] = min(v for v in sd.values() if isinstance(v, float))
    row["lsh_us"] = time_us(lsh, reps)[0]
    # the same steps replayed from CUDA graphs: GPU time without launch gaps
    row["dense_graph_us"] = time_graph_us(dense, reps)[0]
    row["lsh_graph_us"] = time_graph_us(lsh, reps)[0]
    row["sample_graph_us"] = time_graph_us(lambda: select(False), reps)[0]
    row["graph_speedup_vs_dense_graph"] = row["dense_graph_us"] / row["lsh_graph_us"]
    if profile:
        row["lsh_kernels"] = kernel_profile(lsh)
        print_profile(f"LSH step at n={n}, heads {h_q}/{h_kv}", row["lsh_kernels"])
        sweep = {}
        for v in slices:
            check(lib, lib.kvgpu_set_slices_per_sm(v), "slices")
            sweep[v] = time_graph_us(lsh, reps)[0]
        check(lib, lib.kvgpu_set_slices_per_sm(8), "slices")
        if sweep:
            row["lsh_graph_us_by_slices_per_sm"] = sweep
            print("  lsh graph us by blocks per SM: " +
                  ", ".join(f"{v}: {t:.1f}" for v, t in sweep.items()), flush=True)
    row["sample_us"] = time_us(lambda: select(False), reps)[0]  # hash + walk, no attention
    row["speedup_vs_dense"] = row["dense_us"] / row["lsh_us"]
    row["speedup_vs_sdpa"] = row["sdpa_best_us"] / row["lsh_us"]
    # the outputs and the sample checked below: one more call each (a
    # sample's order follows the atomics, so its ids and u come from one call)
    dout.fill_(float("nan"))
    out.fill_(float("nan"))
    dense()
    lsh()
    select(True)
    torch.cuda.synchronize()
    assert torch.isfinite(dout).all(), "dense output not fully written"
    assert torch.isfinite(out).all(), "lsh output not fully written"

    # what the step touches: bucket ids walked, sampled keys and values, the
    # static part (read once per head), the planes (once)
    lens = s_lens.long()
    walked = bucket_ids_walked(q, planes, offsets, K, L, g)
    row["sampled_fraction"] = (lens.double() / m).mean().item()
    row["sample_mean"] = lens.double().mean().item()
    row["bucket_ids_walked_mean"] = walked.double().mean().item()
    touched = (4 * walked.sum().item() + lens.sum().item() * 2 * d * 2 +
               h_kv * (N_SINK + N_WINDOW) * 2 * d * 2 + K * L * d * 4)
    row["lsh_bytes"] = touched
    row["lsh_bps"] = touched / (row["lsh_us"] * 1e-6)
    row["lsh_of_copy"] = row["lsh_bps"] / copy_bps
    row["lsh_graph_of_copy"] = touched / (row["lsh_graph_us"] * 1e-6) / copy_bps
    row["dense_bytes"] = 2 * h_kv * n * d * 2
    row["dense_of_copy"] = row["dense_bytes"] / (row["dense_us"] * 1e-6) / copy_bps
    row["table_bytes"] = offsets.numel() * 4 + ids.numel() * 4
    row["kv_bytes"] = row["dense_bytes"]

    # float32 reference of the same estimator on the kernel's own sample:
    # softmax over the static part (u = 1) and the sample (s - log u)
    static = torch.cat([torch.arange(0, N_SINK), torch.arange(n - N_WINDOW, n)]).cuda()
    ref_out = torch.empty_like(out)
    ref_lse = torch.empty_like(lse)
    scale = 1.0 / math.sqrt(d)
    for r in range(n_rows):
        hh, gg = divmod(r, g)
        ln = int(s_lens[r].item())
        sid = torch.cat([static, s_ids[r, :ln].long()])
        logu = torch.cat([torch.zeros(static.numel(), device="cuda"), s_u[r, :ln].log()])
        kk = keys[hh, sid].float()
        vv = values[hh, sid].float()
        s = kk @ q[hh, gg] * scale - logu
        ref_lse[hh, gg] = torch.logsumexp(s, 0)
        ref_out[hh, gg] = torch.softmax(s, 0) @ vv
    row["err_vs_estimator_fp32"] = ((out - ref_out).norm() / ref_out.norm()).item()
    row["lse_err_vs_estimator_fp32"] = (lse - ref_lse).abs().max().item()
    row["err_vs_dense"] = ((out - dout).norm() / dout.norm()).item()
    row["lse_err_vs_dense_mean"] = (lse - dlse).abs().mean().item()
    del keys, values, ids, offsets, ws, dense, sws, s_ids, s_u
    torch.cuda.empty_cache()
    return row


def needed_bytes(n, h_kv, h_q, d, K, L):
    """Device bytes a configuration holds at its peak (tensors, tables, the
    sort of one head's codes, lists and sample arrays), plus a margin."""
    m = n
    kv = 2 * h_kv * n * d * 2
    tables = h_kv * L * (m + (1 << K) + 1) * 4
    sort = L * m * (4 + 4 + 8 + 4) + (1 << 17) * K * L * 4
    lists = 3 * h_q * m * 4 * 2
    return kv + tables + sort + lists + (2 << 30)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--tokens", default="32768,131072,1048576")
    ap.add_argument("--heads", default="32/32,32/8", help="q_heads/kv_heads configurations")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--K", type=int, default=10)
    ap.add_argument("--L", type=int, default=150)
    ap.add_argument("--min-hits", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--budget-s", type=float, default=80.0,
                    help="skip the configurations left once the run has taken this long")
    ap.add_argument("--slices", default="",
                    help="comma list of blocks per multiprocessor: the graph-replayed step at "
                         "the --profile length for each (a sweep of the slicing)")
    ap.add_argument("--profile", type=int, default=131072,
                    help="print the kernels of one step at this many tokens (0: never)")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # the codes from a plain fp32 product

    start = time.time()
    lib = load_lsh(args.lib)
    info = device_info()
    copy_bps = info["copy_bps"]
    print(f"# LSH K x L = {args.K} x {args.L}, min_hits {args.min_hits}, Sink{N_SINK},Window{N_WINDOW}")
    rows, skipped = [], []
    for heads in args.heads.split(","):
        h_q, h_kv = parse_heads(heads)
        for n in (int(t) for t in args.tokens.split(",")):
            what = f"n={n} heads {h_q}/{h_kv}"
            torch.cuda.empty_cache()
            free = torch.cuda.mem_get_info()[0] + (torch.cuda.memory_reserved() -
                                                   torch.cuda.memory_allocated())
            need = needed_bytes(n, h_kv, h_q, args.d, args.K, args.L)
            if need > free:
                skipped.append(f"{what}: needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} free")
                print(f"skipped {skipped[-1]}", flush=True)
                continue
            if time.time() - start > args.budget_s:
                skipped.append(f"{what}: the run passed its {args.budget_s:.0f} s budget")
                print(f"skipped {skipped[-1]}", flush=True)
                continue
            row = bench_config(lib, n, h_kv, h_q, args.d, args.K, args.L, args.min_hits,
                               args.reps, copy_bps, args.seed, profile=n == args.profile,
                               slices=[int(v) for v in args.slices.split(",") if v])
            rows.append(row)
            print(f"{what}: lsh {row['lsh_us']:9.1f} us (sampling {row['sample_us']:8.1f}) | "
                  f"dense {row['dense_us']:9.1f} us ({100 * row['dense_of_copy']:.0f}% of copy) | "
                  f"{row['speedup_vs_dense']:.2f}x | sampled {100 * row['sampled_fraction']:.2f}% | "
                  f"{row['lsh_bytes'] / 1e6:.1f} MB touched, {row['lsh_bps'] / 1e12:.2f} TB/s "
                  f"({100 * row['lsh_of_copy']:.0f}% of copy) | err vs fp32 estimator "
                  f"{row['err_vs_estimator_fp32']:.1e}, vs dense {row['err_vs_dense']:.3f} | "
                  f"tables {row['table_bytes'] / 2**30:.2f} GiB vs KV {row['kv_bytes'] / 2**30:.2f} GiB "
                  f"(built in {row['table_build_s']:.1f} s)", flush=True)
            print(f"    graph replay: lsh {row['lsh_graph_us']:.1f} us (sampling "
                  f"{row['sample_graph_us']:.1f}), dense {row['dense_graph_us']:.1f} us: "
                  f"{row['graph_speedup_vs_dense_graph']:.2f}x, "
                  f"{100 * row['lsh_graph_of_copy']:.0f}% of copy", flush=True)
    print(f"# total {time.time() - start:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "rows": rows, "skipped": skipped}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
