"""Fixtures and helpers shared by the kvindex tests.

Every RNG is seeded; queries never equal the keys. References are float64
numpy (kvref.py). Sizes are small: the whole suite runs in well under a
minute on 2 cores.
"""
import os
import sys
from dataclasses import dataclass

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

import kvindex  # noqa: E402

D = 64          # head dimension of the shared data sets
N = 2000        # prompt tokens
NQ = 16         # evaluation queries

# One small factory string per registered index type. A type added to the
# registry without an entry here fails test_every_registry_type_is_covered,
# so it cannot be skipped silently.
FACTORY_BY_TYPE = {
    "IndexKVFlat": "Flat",
    "IndexTopK": "TopK(Flat)",
    "IndexSinkWindow": "Sink4,Window64,Flat",
    "IndexProxyEvict": "ProxyEvict20",
    "IndexLSHSample": "LSHSample6x40",
    "IndexRoarGraph": "RoarGraph8",
    "IndexIVFAsym": "IVFAsym8",
    "IndexHybrid": "Hybrid(TopK(Flat),Uniform)",
    "IndexUniformSample": "Uniform",
    "IndexWeightedSample": "Weighted",
    "IndexChoose": "Choose(TopK(Flat);LSHSample6x40)",
    "IndexKVShards": "Shards256(Flat)",
}

# More chains, for the properties that hold for any index (select/attend
# consistency, io round trips): retrievers, wrappers over samplers, storage
# types.
EXTRA_FACTORIES = [
    "TopK(IVF16,Flat)",
    "TopK(HNSW16)",
    "Sink4,Window64,LSHSample6x40",
    "ProxyEvict30_H2O,TopK(Flat)",
    "ProxyEvict20,Sink4,Window64,LSHSample6x40",
    "BF16,Flat",
    "FP16,Sink4,Window64,TopK(Flat)",
    "BF16,Sink2,Window8,LSHSample6x40",
    "Sink4,Window16,RoarGraph8",
    "Sink1,Window16,IVFAsym8_Centroid",
    "Shards512(Sink4,Window64,LSHSample6x40)",
]


def row_field(row, name, pos):
    """A field of a kvindex.index_types() row: attribute, key or position."""
    if hasattr(row, name):
        return getattr(row, name)
    if isinstance(row, dict):
        return row[name]
    return row[pos]


def registry_names():
    return [row_field(r, "name", 0) for r in kvindex.index_types()]


def attr(obj, name):
    """obj.name, called if it is a method (type_name is spelled both ways)."""
    v = getattr(obj, name)
    return v() if callable(v) else v


@dataclass
class Data:
    name: str
    keys: np.ndarray            # (N, D) float32
    values: np.ndarray          # (N, D) float32
    queries: np.ndarray         # (NQ, D) float32, evaluation queries
    prompt_queries: np.ndarray  # (N, D) float32, one per prompt position


def make_data(kind, seed=1234, n=N, d=D, nq=NQ, dv=None):
    rng = np.random.default_rng(seed)
    dv = d if dv is None else dv
    if kind == "random":
        keys = rng.standard_normal((n, d))
        queries = rng.standard_normal((nq, d))
        prompt = rng.standard_normal((n, d))
    elif kind == "ood":
        # LLM geometry: keys share a large offset, queries sit elsewhere
        # (larger spread, their own offset): out of the keys' distribution.
        mu_k = 2.0 * rng.standard_normal(d)
        mu_q = rng.standard_normal(d)
        keys = rng.standard_normal((n, d)) + mu_k
        queries = 2.0 * rng.standard_normal((nq, d)) + mu_q
        prompt = 2.0 * rng.standard_normal((n, d)) + mu_q
    else:
        raise ValueError(kind)
    values = rng.standard_normal((n, dv))
    f = lambda x: np.ascontiguousarray(x, dtype=np.float32)  # noqa: E731
    return Data(kind, f(keys), f(values), f(queries), f(prompt))


@pytest.fixture(scope="session", params=["random", "ood"])
def data(request):
    return make_data(request.param)


@pytest.fixture(scope="session")
def rdata():
    return make_data("random")


@pytest.fixture(scope="session")
def small():
    """A small data set: 256 tokens, d = 32, for fast loops."""
    return make_data("random", seed=7, n=256, d=32, nq=8)


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster of 2 CPUs (real worker processes) for every test
    that spreads a cache over actors: a start costs ~6 s. Required, not
    skipped, under KVINDEX_REQUIRE_RAY (the test command)."""
    if os.environ.get("KVINDEX_REQUIRE_RAY"):
        import ray
    else:
        ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.fixture
def rng():
    return np.random.default_rng(99)


def build(factory, dat, d_value=None, with_queries=True, n=None):
    """index_factory + prefill with the prompt (and its queries)."""
    assert factory is not None, "index type without a factory string in FACTORY_BY_TYPE"
    n = dat.keys.shape[0] if n is None else n
    index = kvindex.index_factory(dat.keys.shape[1], factory, d_value=d_value)
    q = dat.prompt_queries[:n] if with_queries else None
    index.prefill(dat.keys[:n], dat.values[:n], queries=q)
    return index


def selection_arrays(sel):
    ids = np.asarray(sel.ids)
    inc = np.asarray(sel.inclusion)
    return ids, inc


def stored(index, ids):
    """Keys and values of tokens `ids` as the index stores them."""
    keys = np.stack([index.reconstruct(int(i)) for i in ids]) if len(ids) else \
        np.zeros((0, index.d), np.float32)
    vals = np.stack([index.reconstruct_value(int(i)) for i in ids]) if len(ids) else \
        np.zeros((0, index.d_value), np.float32)
    return keys, vals


def registry_factories():
    """One pytest param per registered type (iterating kvindex.index_types()),
    its factory string from FACTORY_BY_TYPE; a type without one gets None,
    which fails in build() with a message naming it."""
    return [pytest.param(FACTORY_BY_TYPE.get(n), id=n) for n in registry_names()]


def registry_and_extra_factories():
    return registry_factories() + [pytest.param(s, id=s) for s in EXTRA_FACTORIES]
