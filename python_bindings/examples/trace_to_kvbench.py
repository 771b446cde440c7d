"""Capture attention inputs in Python, write them as a kvindex trace, and
replay that trace with kvbench: the round trip a user takes with their own
model (here the "model" is random keys and queries, rotated by RoPE).

    python trace_to_kvbench.py OUT_DIR [--tokens 1024 --n-ctx 960]

then:  ./build/benchmarks/kvbench run --trace OUT_DIR --index Flat --index "TopK(Flat)"
"""

import argparse

import numpy as np

import kvindex


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--n-ctx", type=int, default=960)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    n, d, kv_heads, q_heads = args.tokens, 64, 2, 4
    positions = np.arange(n)
    layers = []
    for _ in range(args.layers):
        def heads(h, scale):
            x = (rng.standard_normal((h, n, d)) * scale).astype(np.float32)
            # post-RoPE, as a model hands them over
            return np.stack([kvindex.apply_rope(x[i], positions, theta=10000.0, style="half") for i in range(h)])
        layers.append({"keys": heads(kv_heads, 1.0), "values": heads(kv_heads, 1.0),
                       "queries": heads(q_heads, 2.0)})
    meta = {"n_ctx": args.n_ctx, "rope_theta": 10000.0, "rope_style": "half", "source": "python example"}
    kvindex.write_trace(args.out, meta, layers)
    meta_back, layers_back = kvindex.read_trace(args.out)
    assert np.array_equal(layers_back[0]["keys"], layers[0]["keys"])
    print(f"wrote {args.out}: {meta_back['n_layers']} layers, {meta_back['n_q_heads']} q heads / "
          f"{meta_back['n_kv_heads']} kv heads, d={meta_back['head_dim']}, {meta_back['n_tokens']} tokens, "
          f"n_ctx={meta_back['n_ctx']}")


if __name__ == "__main__":
    main()
