"""Independent float64 numpy references for the kvindex tests.

Nothing here calls kvindex: every function recomputes what the library
should return from the raw arrays, in double precision.
"""
import numpy as np

F32_LOWEST = float(np.finfo(np.float32).min)


def scores(q, keys):
    """Attention scores s = <q, k> / sqrt(d), float64, shape (nq, n)."""
    q = np.asarray(q, dtype=np.float64)
    keys = np.asarray(keys, dtype=np.float64)
    return q @ keys.T / np.sqrt(keys.shape[1])


def estimate(s, values, log_u=None):
    """softmax(s - log u) . values over one set; returns (out, lse).

    lse = log sum_i exp(s_i) / u_i (the log partition estimate). An empty
    set gives out = 0 and lse = -inf, as the library does.
    """
    s = np.asarray(s, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    if s.size == 0:
        return np.zeros(values.shape[1]), -np.inf
    w = s - (0.0 if log_u is None else np.asarray(log_u, dtype=np.float64))
    m = w.max()
    e = np.exp(w - m)
    z = e.sum()
    return (e @ values) / z, m + np.log(z)


def attend(q, keys, values, ids=None, inclusion=None):
    """Attention of every query over keys[ids] (all when ids is None).

    ids / inclusion may be one array for all queries or a list per query.
    Returns (out (nq, dv), lse (nq,)) in float64.
    """
    q = np.atleast_2d(np.asarray(q, dtype=np.float64))
    keys = np.asarray(keys, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    nq = q.shape[0]
    out = np.zeros((nq, values.shape[1]))
    lse = np.zeros(nq)
    for i in range(nq):
        sel = np.arange(keys.shape[0]) if ids is None else (
            ids[i] if isinstance(ids, (list, tuple)) else ids)
        sel = np.asarray(sel, dtype=np.int64)
        log_u = None
        if inclusion is not None:
            u = inclusion[i] if isinstance(inclusion, (list, tuple)) else inclusion
            log_u = np.log(np.asarray(u, dtype=np.float64))
        s = scores(q[i:i + 1], keys[sel])[0]
        out[i], lse[i] = estimate(s, values[sel], log_u)
    return out, lse


def topk(q, keys, k):
    """Exact top-k by unscaled inner product: (D (nq, k), I (nq, k)),
    padded with (lowest float32, -1) when k > n."""
    ip = np.asarray(q, dtype=np.float64) @ np.asarray(keys, dtype=np.float64).T
    nq, n = ip.shape
    D = np.full((nq, k), F32_LOWEST)
    I = np.full((nq, k), -1, dtype=np.int64)
    kk = min(k, n)
    order = np.argsort(-ip, axis=1, kind="stable")[:, :kk]
    I[:, :kk] = order
    D[:, :kk] = np.take_along_axis(ip, order, axis=1)
    return D, I


def topk_attend(q, keys, values, k):
    """TopK attention: exact softmax over the exact top-k keys of each query."""
    _, I = topk(q, keys, k)
    ids = [row[row >= 0] for row in I]
    return attend(q, keys, values, ids=ids)


def rel_err(out, ref):
    """Relative L2 error per row, ||out - ref|| / ||ref||."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    return np.linalg.norm(out - ref, axis=-1) / np.maximum(np.linalg.norm(ref, axis=-1), 1e-30)


def round_bf16(x):
    """float32 -> bfloat16 -> float32, round to nearest, ties to even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def round_fp16(x):
    return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)


def rope(x, positions, theta=10000.0, style="half"):
    """RoPE in float64: pair j turns by pos * theta^(-2j/d); "half" pairs
    (j, j + d/2), "interleaved" pairs (2j, 2j + 1)."""
    x = np.asarray(x, dtype=np.float64)
    d = x.shape[1]
    j = np.arange(d // 2)
    ang = np.asarray(positions, dtype=np.float64)[:, None] * theta ** (-2.0 * j / d)[None, :]
    c, s = np.cos(ang), np.sin(ang)
    if style == "half":
        a, b = np.arange(d // 2), np.arange(d // 2) + d // 2
    else:
        a, b = 2 * j, 2 * j + 1
    out = x.copy()
    out[:, a] = x[:, a] * c - x[:, b] * s
    out[:, b] = x[:, a] * s + x[:, b] * c
    return out
