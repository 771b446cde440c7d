#!/usr/bin/env python3
"""GpuIndexIVFAsym's decode step (SAAP's GPU kernel) beside our dense kernel
and PyTorch's SDPA, on the same tensors in one run.

One decode step = 1 query per query head against n tokens per KV head
(bf16, d = 128), SAAP's setting: C = 1024 buckets, the nprobe = 32 best
buckets read, sink 1 + window 2047 exact (saap.txt, Appendix F). The keys
of each head are bucketed by nearest centroid (centroids: C keys of the
head) and sorted by bucket, as GpuIndexIVFAsym lays them out; the routing
model is random (its weights do not change the work): the Q-model (d ->
256 -> C, one per head) or the centroid probe (C x d per head). Times are
medians of CUDA-event timings after warm-up; the share of keys read and
the bytes come from the probe's own buckets.

Usage (on the GPU machine; needs only the driver and PyTorch):
    python3 benchmarks/gpu/bench_ivf.py --lib build-device/dist/libkvindex_gpu_capi.so \
        [--tokens 32768,131072,1048576] [--json out.json]
"""

import argparse
import ctypes
import json
import math
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_decode import (parse_heads, BF16, check, copy_bandwidth, cur_stream, dense_step, kernel_profile,  # noqa: E402
                          load, print_profile, sdpa_timings, time_graph_us, time_us)

QMODEL, CENTROID = 0, 1  # gpu::IVFProbeKind


def load_ivf(lib_path):
    lib = load(lib_path)
    i64, i32, vp, dbl, flt = (ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_double,
                              ctypes.c_float)
    lib.kvgpu_ivf_workspace.restype = i64
    lib.kvgpu_ivf_workspace.argtypes = [i64, i32, i32, i32, i32, i64, i64, i32, i32, i32, i32,
                                        i32, i64]
    model = [i32, i32, i32, vp, vp, vp, vp, vp, vp, vp, i32, dbl, i32, flt]
    lib.kvgpu_ivf_attention.restype = i32
    lib.kvgpu_ivf_attention.argtypes = ([vp, vp, i64, i64, i32, i32, i32, vp, i32, i64, i64] +
                                        model + [vp, vp, vp, i64, i64, i64, i32, i32, i64, i64,
                                                 vp, vp, vp, i64, vp])
    lib.kvgpu_ivf_probe.restype = i32
    lib.kvgpu_ivf_probe.argtypes = ([i64, i32, i32, i32, vp, i32] + model +
                                    [i32, i32, i64, vp, vp, i64, vp])
    return lib


def bucketize(keys, values, n_sink, n_window, C, gen):
    """Keys of each head sorted by nearest centroid (L2), as the index lays
    them out: [sink][bucket 0 .. C-1][window]. Returns the sorted tensors,
    begin / end [h][C + 1] (bucket C, the unassigned run, empty) and the
    centroids [h][C][d]."""
    h, n, d = keys.shape
    mid0, mid1 = n_sink, n - n_window
    sorted_k = torch.empty_like(keys)
    sorted_v = torch.empty_like(values)
    begin = torch.empty(h, C + 1, dtype=torch.int32, device="cuda")
    end = torch.empty_like(begin)
    cents = torch.empty(h, C, d, device="cuda")
    for hh in range(h):
        mid = keys[hh, mid0:mid1].float()
        pick = torch.randperm(mid.shape[0], generator=gen, device="cpu")[:C].cuda()
        c = mid[pick]
        cents[hh] = c
        assign = torch.empty(mid.shape[0], dtype=torch.int64, device="cuda")
        c2 = (c * c).sum(1)
        for i0 in range(0, mid.shape[0], 1 << 18):
            blk = mid[i0:i0 + (1 << 18)]
            assign[i0:i0 + blk.shape[0]] = (2 * blk @ c.T - c2).argmax(1)
        order = torch.argsort(assign, stable=True) + mid0
        sorted_k[hh, :mid0] = keys[hh, :mid0]
        sorted_v[hh, :mid0] = values[hh, :mid0]
        sorted_k[hh, mid0:mid1] = keys[hh, order]
        sorted_v[hh, mid0:mid1] = values[hh, order]
        sorted_k[hh, mid1:] = keys[hh, mid1:]
        sorted_v[hh, mid1:] = values[hh, mid1:]
        counts = torch.bincount(assign, minlength=C)
        e = torch.cumsum(counts, 0) + mid0
        begin[hh, :C] = (e - counts).int()
        end[hh, :C] = e.int()
        begin[hh, C] = mid1
        end[hh, C] = mid1
        del mid, assign, order
    return sorted_k, sorted_v, begin, end, cents


def bench_config(lib, n, h_kv, h_q, d, reps, copy_bps, C, nprobe, hidden, n_sink, n_window,
                 check_ref, profile=False, slices=()):
    g = h_q // h_kv
    torch.manual_seed(n + h_kv)
    gen = torch.Generator().manual_seed(n)
    keys = (torch.randn(h_kv, n, d, device="cuda") + 0.5).to(torch.bfloat16)
    values = torch.randn(h_kv, n, d, device="cuda").to(torch.bfloat16)
    keys, values, begin, end, cents = bucketize(keys, values, n_sink, n_window, C, gen)
    torch.cuda.empty_cache()
    q = torch.randn(h_kv, g, d, device="cuda") * 1.5 - 0.5
    out = torch.empty(h_kv, g, d, device="cuda")
    lse = torch.empty(h_kv, g, device="cuda")
    row = {"tokens": n, "kv_heads": h_kv, "q_heads": h_q, "d": d, "dtype": "bf16",
           "n_centroids": C, "nprobe": nprobe, "hidden": hidden, "n_sink": n_sink,
           "n_window": n_window}
    kv_bytes = 2 * h_kv * n * d * 2

    # dense on the same tensors (GpuIndexKVFlat's kernel)
    dense = dense_step(lib, keys, values, q)[0]

    t_dense, _ = time_us(dense, reps)
    row["dense_us"] = t_dense
    row["dense_graph_us"] = time_graph_us(dense, reps)[0]
    row["dense_bps"] = kv_bytes / (t_dense * 1e-6)
    q4 = q.reshape(1, h_q, 1, d).to(torch.bfloat16)
    sd = sdpa_timings(q4, keys.unsqueeze(0), values.unsqueeze(0), g > 1, reps)
    row["sdpa_us"] = sd
    row["sdpa_best_us"] = min(v for v in sd.values() if isinstance(v, float))

    # the routing models, one per head
    w1 = torch.randn(h_kv, hidden, d, device="cuda") / math.sqrt(d)
    bn_scale = torch.ones(h_kv, hidden, device="cuda")
    bn_shift = torch.zeros(h_kv, hidden, device="cuda")
    w2 = torch.randn(h_kv, C, hidden, device="cuda") / math.sqrt(hidden)
    b2 = torch.zeros(h_kv, C, device="cuda")
    sizes = (end - begin)[:, :C].long()
    max_list = int(torch.topk(sizes, nprobe, dim=1).values.sum(1).max().item())
    for label, kind in [("ivf_qmodel", QMODEL), ("ivf_centroid", CENTROID)]:
        model = [kind, C, hidden, w1.data_ptr(), bn_scale.data_ptr(), bn_shift.data_ptr(),
                 w2.data_ptr(), b2.data_ptr(), cents.data_ptr(), None, 1, 10000.0, 1, 0.0]
        ws = lib.kvgpu_ivf_workspace(n, h_kv, d, BF16, g, n_sink, n_window, kind, C, hidden,
                                     nprobe, 1, max_list)
        check(lib, 0 if ws >= 0 else -1, label + " workspace")
        wsb = torch.empty(max(ws, 1), dtype=torch.uint8, device="cuda")
        iout = torch.empty_like(out)
        ilse = torch.empty_like(lse)

        def ivf():
            check(lib, lib.kvgpu_ivf_attention(
                keys.data_ptr(), values.data_ptr(), n, n, h_kv, d, BF16, q.data_ptr(), g, n_sink,
                n_window, *model, begin.data_ptr(), end.data_ptr(), None, 0, n - n_window,
                n - n_window, nprobe, 1, n - 1, max_list, iout.data_ptr(), ilse.data_ptr(),
                wsb.data_ptr(), ws, cur_stream()), label)

        iout.fill_(float("nan"))
        ivf()
        torch.cuda.synchronize()
        assert torch.isfinite(iout).all(), label + " output not fully written"
        t, _ = time_us(ivf, reps)
        t_graph, _ = time_graph_us(ivf, reps)
        probed = torch.empty(h_kv, nprobe, dtype=torch.int32, device="cuda")

        def probe():
            check(lib, lib.kvgpu_ivf_probe(n, h_kv, d, BF16, q.data_ptr(), g, *model, nprobe, 1,
                                           n - 1, probed.data_ptr(), wsb.data_ptr(), ws,
                                           cur_stream()), label + " probe")

        t_probe, _ = time_us(probe, reps)
        t_probe_graph, _ = time_graph_us(probe, reps)
        if profile:
            row[label + "_kernels"] = kernel_profile(ivf)
            print_profile(f"{label} step at n={n}, heads {h_q}/{h_kv}", row[label + "_kernels"])
            sweep = {}
            for v in slices:
                check(lib, lib.kvgpu_set_slices_per_sm(v), "slices")
                sweep[v] = time_graph_us(ivf, reps)[0]
            check(lib, lib.kvgpu_set_slices_per_sm(8), "slices")
            if sweep:
                row[label + "_graph_us_by_slices_per_sm"] = sweep
                print(f"  {label} graph us by blocks per SM: " +
                      ", ".join(f"{v}: {t:.1f}" for v, t in sweep.items()), flush=True)
        read = torch.gather(sizes, 1, probed.long()).sum(1).float()  # bucket keys per head
        frac = ((read + n_sink + n_window) / n).mean().item()
        model_bytes = (h_kv * (hidden * d + C * hidden + 2 * hidden + C) * 4 if kind == QMODEL
                       else h_kv * C * d * 4)
        touched = int(((read + n_sink + n_window) * 2 * d * 2).sum().item()) + model_bytes + \
            int(read.sum().item()) * 4
        row[label + "_us"] = t
        row[label + "_graph_us"] = t_graph
        row[label + "_probe_us"] = t_probe
        row[label + "_probe_graph_us"] = t_probe_graph
        row[label + "_graph_bps"] = touched / (t_graph * 1e-6)
        row[label + "_graph_of_copy"] = row[label + "_graph_bps"] / copy_bps
        row[label + "_graph_speedup_vs_dense_graph"] = row["dense_graph_us"] / t_graph
        row[label + "_fraction"] = frac
        row[label + "_bytes"] = touched
        row[label + "_model_bytes"] = model_bytes
        row[label + "_bps"] = touched / (t * 1e-6)
        row[label + "_of_copy"] = row[label + "_bps"] / copy_bps
        row[label + "_speedup_vs_dense"] = t_dense / t
        row[label + "_speedup_vs_sdpa"] = row["sdpa_best_us"] / t
        if check_ref:
            # float32 reference of the same step: exact softmax over the
            # probed buckets' keys and the static part, per head
            errs = []
            for hh in range(h_kv):
                idx = [torch.arange(0, n_sink, device="cuda"),
                       torch.arange(n - n_window, n, device="cuda")]
                for b in probed[hh].tolist():
                    idx.append(torch.arange(int(begin[hh, b]), int(end[hh, b]), device="cuda"))
                idx = torch.cat(idx)
                kf, vf = keys[hh, idx].float(), values[hh, idx].float()
                s = q[hh] @ kf.T / math.sqrt(d)
                ref = torch.softmax(s, -1) @ vf
                errs.append(((iout[hh] - ref).norm() / ref.norm()).item())
            row[label + "_err_vs_fp32"] = max(errs)
        del wsb
    del keys, values, dense
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--tokens", default="32768,131072,1048576")
    ap.add_argument("--heads", default="32/32", help="q_heads/kv_heads configurations")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--centroids", type=int, default=1024)
    ap.add_argument("--nprobe", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--sink", type=int, default=1)
    ap.add_argument("--window", type=int, default=2047)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--slices", default="",
                    help="comma list of blocks per multiprocessor: the graph-replayed step at "
                         "the --profile length for each (a sweep of the slicing)")
    ap.add_argument("--profile", type=int, default=131072,
                    help="print the kernels of one step at this many tokens (0: never)")
    ap.add_argument("--json")
    args = ap.parse_args()
    lib = load_ivf(args.lib)
    props = torch.cuda.get_device_properties(0)
    copy_bps = copy_bandwidth()
    info = {"device": props.name, "multiprocessors": props.multi_processor_count,
            "torch": torch.__version__, "copy_bps": copy_bps}
    print(f"# {props.name}; device-to-device copy {copy_bps / 1e12:.3f} TB/s (read + written)")
    rows = []
    for heads in args.heads.split(","):
        h_q, h_kv = parse_heads(heads)
        for n in (int(t) for t in args.tokens.split(",")):
            r = bench_config(lib, n, h_kv, h_q, args.d, args.reps, copy_bps, args.centroids,
                             args.nprobe, args.hidden, args.sink, args.window,
                             check_ref=n <= 131072, profile=n == args.profile,
                             slices=[int(v) for v in args.slices.split(",") if v])
            rows.append(r)
            print(f"n={n:>8} heads {h_q}/{h_kv}: dense {r['dense_us']:8.1f} us "
                  f"(graph {r['dense_graph_us']:.1f}), SDPA {r['sdpa_best_us']:8.1f}", flush=True)
            for lab, name in [("ivf_qmodel", "Q-model"), ("ivf_centroid", "centroid")]:
                err = r.get(lab + "_err_vs_fp32")
                err_text = f"{err:.1e}" if err is not None else "not checked above 128k"
                print(f"    IVFAsym {name:8s} {r[lab + '_us']:7.1f} us (graph {r[lab + '_graph_us']:6.1f}"
                      f", probe {r[lab + '_probe_us']:5.1f} / graph {r[lab + '_probe_graph_us']:5.1f})"
                      f" | {r[lab + '_speedup_vs_dense']:.2f}x dense, graph "
                      f"{r[lab + '_graph_speedup_vs_dense_graph']:.2f}x | "
                      f"{100 * r[lab + '_fraction']:.1f}% read | graph at "
                      f"{100 * r[lab + '_graph_of_copy']:.0f}% of copy | err {err_text}",
                      flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
