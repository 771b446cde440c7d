// kvindex in a few lines: one attention head's KV cache as an index.
// Built against an installed kvindex by examples/cpp/CMakeLists.txt (the
// test command does it: scripts/run_tests.sh, phase "consumer").
//
// Prints the relative error of a sparse index's attention output against
// exact attention, and the tokens it read; exits 1 if the sparse index
// drifts from exact attention by more than it should on this easy head.

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include <kvindex/index_factory.h>
#include <kvindex/KVIndex.h>

int main() {
    const int d = 64;        // head dimension
    const int n = 4096;      // prompt tokens
    std::mt19937 rng(1);
    std::normal_distribution<float> normal;

    // A head whose query looks for one token: keys at random, the query
    // close to key 1234 (scores s_i = <q, k_i> / sqrt(d)).
    std::vector<float> keys(size_t(n) * d), values(size_t(n) * d), query(d);
    for (float& x : keys) x = normal(rng);
    for (float& x : values) x = normal(rng);
    for (int j = 0; j < d; j++) query[j] = 3.0f * keys[size_t(1234) * d + j] + normal(rng);

    // The exact baseline and a sparse index: the first 4 and last 64
    // tokens exact, the rest by exact top-k retrieval (k = 64).
    auto exact = kvindex::index_factory(d, "Flat");
    auto sparse = kvindex::index_factory(d, "Sink4,Window64,TopK(Flat)|k=64");

    // prefill: keys, values (and queries, for indexes that learn from them)
    kvindex::PrefillInput prompt;
    prompt.n_tokens = n;
    prompt.keys = keys.data();
    prompt.values = values.data();
    exact->prefill(prompt);
    sparse->prefill(prompt);

    // a decode step: attention output and log-sum-exp of one query
    std::vector<float> out_exact(d), out_sparse(d);
    float lse_exact, lse_sparse;
    exact->attend(1, query.data(), out_exact.data(), &lse_exact);
    sparse->attend(1, query.data(), out_sparse.data(), &lse_sparse);

    double err = 0, norm = 0;
    for (int j = 0; j < d; j++) {
        err += std::pow(out_sparse[j] - out_exact[j], 2);
        norm += std::pow(out_exact[j], 2);
    }
    const double rel_err = std::sqrt(err / norm);

    kvindex::Selection sel;
    sparse->select(1, query.data(), &sel);
    std::printf("%s: relative error %.2e reading %zu of %d tokens (lse %.4f, exact %.4f)\n",
                kvindex::index_factory_string(sparse.get()).c_str(), rel_err, sel.size(), n,
                lse_sparse, lse_exact);
    return rel_err < 1e-2 ? 0 : 1;
}
