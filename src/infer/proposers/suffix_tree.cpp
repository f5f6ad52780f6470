// A suffix tree of bounded depth over many token sequences (SuffixDecoding, Oliaro et al. 2024-25): every substring
// of up to `max_depth` tokens of every sequence is a path from the root, each node counting the suffixes that pass
// through or end at it. Sequences grow token by token (a request's prompt, then its output) and are removed whole
// (eviction). `speculate` tries every suffix of a context that is a path, following the most frequent child while
// its share of its parent's count stays high, and keeps the draft with the most expected accepted tokens.
//
// Nodes live in one vector (a free list reuses removed ones); edges in one hash map keyed by (parent, token); a
// node's children are also linked (first_child / next_sibling). Appending token t to a sequence extends each of its
// open suffixes (the nodes of its last max_depth - 1 suffixes) by t: max_depth hash operations a token, no path
// walked twice. Each node keeps its most frequent child (`best`, the first to reach the highest count): counts only
// grow while sequences grow, so one comparison a count keeps it; removal re-scans a parent whose best child lost
// count. A draft then follows `best` links: no scan of a common token's thousands of children per draft token.
// A stored sequence's open suffixes are also its context's matches (`speculate_stored`): a running request's
// lookup walks no path from the root. `lookup_rows` does a round's lookups for a whole batch in one call: the
// per-row Python (two trees, a call each, their answers compared) cost ~50 us a row, 3.5% of an 8-row step.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <queue>
#include <stdexcept>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

// (parent, token) -> child: open addressing with linear probing, erased by backward shift (no tombstones), at most
// half full. An edge lookup is one probe into one array, where std::unordered_map's chained buckets cost two or three
// cache misses: appending a token does max_depth lookups in each tree, every step, for every running request.
class EdgeMap {
  public:
    EdgeMap() { rehash(1024); }

    int32_t find(uint64_t key) const {
        for (size_t i = home(key);; i = (i + 1) & mask_) {
            if (keys_[i] == key) return vals_[i];
            if (keys_[i] == kEmpty) return -1;
        }
    }

    void insert(uint64_t key, int32_t val) {  // key must be absent
        if (2 * (size_ + 1) > keys_.size()) rehash(2 * keys_.size());
        size_t i = home(key);
        while (keys_[i] != kEmpty) i = (i + 1) & mask_;
        keys_[i] = key;
        vals_[i] = val;
        ++size_;
    }

    void erase(uint64_t key) {
        size_t i = home(key);
        while (keys_[i] != key) {
            if (keys_[i] == kEmpty) return;
            i = (i + 1) & mask_;
        }
        // backward shift: each later entry of the run moves into the hole if its home is not between the hole and it
        for (size_t j = (i + 1) & mask_; keys_[j] != kEmpty; j = (j + 1) & mask_) {
            const size_t h = home(keys_[j]);
            if (((j - h) & mask_) >= ((j - i) & mask_)) {
                keys_[i] = keys_[j];
                vals_[i] = vals_[j];
                i = j;
            }
        }
        keys_[i] = kEmpty;
        --size_;
    }

    size_t size() const { return size_; }

  private:
    static constexpr uint64_t kEmpty = ~0ull;  // no key: parents and tokens are >= 0

    size_t home(uint64_t key) const {
        key ^= key >> 32;  // Fibonacci hashing of parent ^ token: the product's top bits
        return static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> shift_);
    }

    void rehash(size_t capacity) {
        std::vector<uint64_t> keys(capacity, kEmpty);
        std::vector<int32_t> vals(capacity, -1);
        keys.swap(keys_);
        vals.swap(vals_);
        mask_ = capacity - 1;
        shift_ = 64 - __builtin_ctzll(capacity);
        size_ = 0;
        for (size_t i = 0; i < keys.size(); ++i)
            if (keys[i] != kEmpty) insert(keys[i], vals[i]);
    }

    std::vector<uint64_t> keys_;
    std::vector<int32_t> vals_;
    size_t mask_ = 0, size_ = 0;
    int shift_ = 64;
};

struct Node {
    int32_t token = -1, parent = -1, depth = 0, first_child = -1, next_sibling = -1;
    int32_t best = -1;  // the child of highest count, the first to reach it (not kept for the root: no draft starts there)
    int64_t count = 0;
};

struct Sequence {
    std::vector<int32_t> tokens;
    std::vector<int32_t> open;  // nodes of the suffixes ending at the last token, shallower than max_depth
};

class SuffixTree {
  public:
    explicit SuffixTree(int max_depth) : max_depth_(max_depth) {
        if (max_depth < 2) throw std::invalid_argument("max_depth must be >= 2");
        nodes_.push_back(Node{});  // the root
        nodes_[0].depth = 0;
    }

    void extend(int64_t seq, const std::vector<int32_t>& tokens) {
        Sequence& s = seqs_[seq];
        std::vector<int32_t> next;
        next.reserve(max_depth_);
        for (int32_t t : tokens) {
            next.clear();
            nodes_[0].count += 1;  // every suffix passes through the root
            int32_t c = child_or_new(0, t);
            nodes_[c].count += 1;  // the root keeps no best child
            if (nodes_[c].depth < max_depth_) next.push_back(c);
            for (int32_t u : s.open) {
                int32_t v = child_or_new(u, t);
                Node& nv = nodes_[v];
                nv.count += 1;
                int32_t& b = nodes_[u].best;
                if (b < 0 || nv.count > nodes_[b].count) b = v;
                if (nv.depth < max_depth_) next.push_back(v);
            }
            s.open.swap(next);
            s.tokens.push_back(t);
            num_tokens_ += 1;
        }
    }

    void remove(int64_t seq) {
        auto it = seqs_.find(seq);
        if (it == seqs_.end()) return;
        const std::vector<int32_t>& toks = it->second.tokens;
        const int64_t n = static_cast<int64_t>(toks.size());
        std::vector<int32_t> path;
        for (int64_t start = 0; start < n; ++start) {  // the path of every suffix start, deepest node first
            path.clear();
            int32_t u = 0;
            for (int64_t i = start; i < std::min<int64_t>(n, start + max_depth_); ++i) {
                u = edge(u, toks[i]);
                if (u < 0) break;  // cannot happen while counts are consistent
                path.push_back(u);
            }
            nodes_[0].count -= 1;
            for (auto p = path.rbegin(); p != path.rend(); ++p) {
                const int32_t parent = nodes_[*p].parent;
                const bool was_best = nodes_[parent].best == *p;
                if (--nodes_[*p].count == 0) unlink(*p);
                if (was_best && parent != 0) rescan(parent);  // a sibling may count more now
            }
        }
        num_tokens_ -= n;
        seqs_.erase(it);
    }

    using Draft = std::tuple<std::vector<int32_t>, int, double, std::vector<double>>;

    // (drafts, match length, probability of the drafts under the counts, the probability of each prefix of the
    // drafts, one a draft: the proposer's confidence in each draft): of every suffix of the context that is a
    // path (a match of m tokens), the one whose draft scores highest, the score being the draft's expected number of
    // accepted tokens under the counts (the sum of its prefixes' probabilities; SuffixDecoding's, arctic-inference's
    // rule). A draft follows the most frequent child while the probability stays >= min_prob, up to max_spec tokens
    // and, with length_factor > 0, up to max(1, length_factor x m): a long match may draft long, a short one only
    // briefly. Ties go to the longer match (the more specific one). A context's own latest suffix, when the
    // context is a stored sequence, is a path with no continuation: it drafts nothing, and a shorter match, an
    // earlier occurrence, takes over.
    // With `stored`, the context is itself a stored sequence's end: its own suffix ends at the matched node, and is
    // left out of that node's count (the share of a continuation is among the other occurrences).
    Draft speculate(const std::vector<int32_t>& context, int max_spec, double min_prob, int min_match, bool stored,
                    double length_factor) const {
        const int L = static_cast<int>(context.size());
        Best best;
        for (int m = std::min(L, max_depth_ - 1); m >= std::max(1, min_match); --m) {
            int32_t u = 0;
            for (int i = L - m; i < L && u >= 0; ++i) u = edge(u, context[i]);
            if (u < 0) continue;  // this suffix never occurred: try a shorter one
            draft_from(u, m, max_spec, min_prob, stored, length_factor, best);
        }
        return best.result();
    }

    // speculate(the stored sequence's last max_depth - 1 tokens, stored=true), from the sequence's open suffixes:
    // open[i] is the node of its last i + 1 tokens, so every match is at hand without a walk from the root.
    Draft speculate_stored(int64_t seq, int max_spec, double min_prob, int min_match, double length_factor) const {
        Best best;
        auto it = seqs_.find(seq);
        if (it == seqs_.end()) return best.result();
        const std::vector<int32_t>& open = it->second.open;
        for (int m = static_cast<int>(open.size()); m >= std::max(1, min_match); --m)
            draft_from(open[m - 1], m, max_spec, min_prob, true, length_factor, best);
        return best.result();
    }

    using TreeDraft = std::tuple<std::vector<int32_t>, std::vector<int32_t>, std::vector<double>>;

    // A token tree where the chain has one path (SpecInfer-style trees of deterministic drafts): from the match the
    // chain would start at (speculate_stored's), nodes grown best first by their path's probability under the counts
    // (each a node's share of its parent's), each node's `width` most frequent children, while a path's probability
    // stays >= min_prob, no deeper than the chain's cap (max_spec, length_factor x the match), at most max_nodes.
    // -> (tokens, parents: the index in this output of each node's parent, -1 below the root, and path
    // probabilities). Best first: a parent precedes its children, and scores at least as much.
    TreeDraft speculate_tree_stored(int64_t seq, int max_spec, int width, int max_nodes, double min_prob,
                                    int min_match, double length_factor) const {
        TreeDraft out;
        auto it = seqs_.find(seq);
        if (it == seqs_.end() || width < 1 || max_nodes < 1) return out;
        const std::vector<int32_t>& open = it->second.open;
        Best best;
        for (int m = static_cast<int>(open.size()); m >= std::max(1, min_match); --m)
            draft_from(open[m - 1], m, max_spec, min_prob, true, length_factor, best);
        if (best.drafts.empty()) return out;
        int cap = max_spec;
        if (length_factor > 0.0) cap = std::min(cap, std::max(1, static_cast<int>(std::floor(length_factor * best.m))));
        struct Item {
            double p;
            int32_t node, parent, depth;
            int64_t order;  // at equal probability the node pushed first pops first: the same tree every time
            bool operator<(const Item& o) const { return p < o.p || (p == o.p && order > o.order); }
        };
        std::priority_queue<Item> heap;  // a max-heap on the path's probability
        std::vector<int32_t> top;
        int64_t pushed = 0;
        auto push_children = [&](int32_t u, double p_u, int32_t at, int32_t depth, int64_t own) {
            if (depth >= cap || nodes_[u].depth >= max_depth_) return;
            top.clear();  // u's `width` most frequent children, its best (the chain's) first
            const size_t fixed = nodes_[u].best >= 0 ? 1 : 0;
            if (fixed) top.push_back(nodes_[u].best);
            for (int32_t c = nodes_[u].first_child; c >= 0; c = nodes_[c].next_sibling) {
                if (c == nodes_[u].best) continue;
                if (static_cast<int>(top.size()) < width) {
                    top.push_back(c);
                } else if (nodes_[c].count > nodes_[top.back()].count) {
                    top.back() = c;
                } else {
                    continue;
                }
                for (size_t i = top.size() - 1; i > fixed && nodes_[top[i]].count > nodes_[top[i - 1]].count; --i)
                    std::swap(top[i], top[i - 1]);  // sorted by count after the best
            }
            const double total = static_cast<double>(nodes_[u].count - own);
            for (int32_t c : top) {
                const double p = p_u * static_cast<double>(nodes_[c].count) / total;
                if (p >= min_prob) heap.push({p, c, at, depth + 1, pushed++});
            }
        };
        push_children(best.start, 1.0, -1, 0, 1);  // the context's own suffix ends at the match: left out of its count
        auto& [tokens, parents, probs] = out;
        while (!heap.empty() && static_cast<int>(tokens.size()) < max_nodes) {
            const Item item = heap.top();
            heap.pop();
            tokens.push_back(nodes_[item.node].token);
            parents.push_back(item.parent);
            probs.push_back(item.p);
            push_children(item.node, item.p, static_cast<int32_t>(tokens.size()) - 1, item.depth, 0);
        }
        return out;
    }

    int64_t num_tokens() const { return num_tokens_; }
    int64_t num_nodes() const { return static_cast<int64_t>(nodes_.size() - free_.size()) - 1; }
    int64_t num_sequences() const { return static_cast<int64_t>(seqs_.size()); }
    bool has(int64_t seq) const { return seqs_.count(seq) > 0; }

    // every count equals the number of stored suffixes through the node (tests)
    bool check() const {
        std::unordered_map<int32_t, int64_t> want;
        int64_t root = 0;
        for (const auto& kv : seqs_) {
            const auto& toks = kv.second.tokens;
            const int64_t n = static_cast<int64_t>(toks.size());
            for (int64_t start = 0; start < n; ++start) {
                root += 1;
                int32_t u = 0;
                for (int64_t i = start; i < std::min<int64_t>(n, start + max_depth_); ++i) {
                    u = edge(u, toks[i]);
                    if (u < 0) return false;
                    want[u] += 1;
                }
            }
        }
        if (root != nodes_[0].count || static_cast<int64_t>(want.size()) != num_nodes()) return false;
        for (const auto& kv : want) {
            const Node& n = nodes_[kv.first];
            if (n.count != kv.second) return false;
            int64_t most = 0;  // and its best child is one of the most frequent
            for (int32_t c = n.first_child; c >= 0; c = nodes_[c].next_sibling) most = std::max(most, nodes_[c].count);
            if ((n.best < 0) != (most == 0) || (n.best >= 0 && (nodes_[n.best].parent != kv.first ||
                                                                nodes_[n.best].count != most)))
                return false;
        }
        return true;
    }

  private:
    struct Best {  // the best draft so far, and the scratch a candidate is built in
        std::vector<int32_t> drafts, cand;
        std::vector<double> probs, cand_probs;
        int m = 0;
        int32_t start = -1;  // the matched node the best draft starts from
        double prob = 0.0, score = 0.0;
        Draft result() { return {drafts, m, prob, probs}; }
    };

    // the draft from node u (a match of m tokens), kept in `best` if it scores higher (see speculate)
    void draft_from(int32_t u, int m, int max_spec, double min_prob, bool stored, double length_factor,
                    Best& best) const {
        int cap = max_spec;
        if (length_factor > 0.0) cap = std::min(cap, std::max(1, static_cast<int>(std::floor(length_factor * m))));
        best.cand.clear();
        best.cand_probs.clear();
        const int32_t start = u;
        double prob = 1.0, score = 0.0;
        int64_t own = stored ? 1 : 0;  // the context's own suffix, counted at the matched node only
        while (static_cast<int>(best.cand.size()) < cap && nodes_[u].depth < max_depth_) {
            const int32_t c = nodes_[u].best;
            if (c < 0) break;
            const double p = prob * static_cast<double>(nodes_[c].count) / static_cast<double>(nodes_[u].count - own);
            own = 0;
            if (p < min_prob) break;
            prob = p;
            score += p;
            best.cand.push_back(nodes_[c].token);
            best.cand_probs.push_back(p);
            u = c;
        }
        if (score > best.score) {
            best.drafts.swap(best.cand);
            best.probs.swap(best.cand_probs);
            best.m = m;
            best.start = start;
            best.prob = prob;
            best.score = score;
        }
    }

    void rescan(int32_t u) {  // u's most frequent child, the first in its list at a tie
        int32_t b = -1;
        for (int32_t c = nodes_[u].first_child; c >= 0; c = nodes_[c].next_sibling)
            if (b < 0 || nodes_[c].count > nodes_[b].count) b = c;
        nodes_[u].best = b;
    }

    static uint64_t key(int32_t parent, int32_t token) {
        return (static_cast<uint64_t>(static_cast<uint32_t>(parent)) << 32) | static_cast<uint32_t>(token);
    }

    int32_t edge(int32_t parent, int32_t token) const { return edges_.find(key(parent, token)); }

    int32_t child_or_new(int32_t parent, int32_t token) {
        const int32_t found = edges_.find(key(parent, token));
        if (found >= 0) return found;
        int32_t id;
        if (!free_.empty()) {
            id = free_.back();
            free_.pop_back();
        } else {
            id = static_cast<int32_t>(nodes_.size());
            nodes_.emplace_back();
        }
        Node& n = nodes_[id];
        n = Node{};
        n.token = token;
        n.parent = parent;
        n.depth = nodes_[parent].depth + 1;
        n.next_sibling = nodes_[parent].first_child;
        nodes_[parent].first_child = id;
        edges_.insert(key(parent, token), id);
        return id;
    }

    void unlink(int32_t id) {  // a node whose count reached 0 (its children's did first)
        Node& n = nodes_[id];
        int32_t* link = &nodes_[n.parent].first_child;
        while (*link != id) link = &nodes_[*link].next_sibling;
        *link = n.next_sibling;
        if (nodes_[n.parent].best == id) nodes_[n.parent].best = -1;
        edges_.erase(key(n.parent, n.token));
        free_.push_back(id);
    }

    int max_depth_;
    int64_t num_tokens_ = 0;
    std::vector<Node> nodes_;
    std::vector<int32_t> free_;
    EdgeMap edges_;
    std::unordered_map<int64_t, Sequence> seqs_;
};

using Lookup = std::tuple<std::vector<int32_t>, std::vector<double>, int>;

// A round's lookups for a batch (SuffixProposer._lookup_rows). Row b: sequence seqs[b] of `shared` gains feeds[b],
// its own tree owns[b] (None: none) gains own_feeds[b] (as sequence 0); each is looked up (speculate_stored, up to
// ks[b] drafts; the own tree with own_length_factor) and the draft that expects more accepted tokens (the sum of
// its prefixes' probabilities) wins, the shared tree's at a tie.
// -> per row (drafts, each draft's probability given the drafts before it, group): group = min(match, groups) - 1,
// plus `groups` where the own tree drafted.
std::vector<Lookup> lookup_rows(SuffixTree& shared, const std::vector<int64_t>& seqs,
                                const std::vector<std::vector<int32_t>>& feeds, const py::list& owns,
                                const std::vector<std::vector<int32_t>>& own_feeds, const std::vector<int>& ks,
                                double min_prob, int min_match, double length_factor, double own_length_factor,
                                int groups) {
    const size_t B = seqs.size();
    if (feeds.size() != B || owns.size() != B || own_feeds.size() != B || ks.size() != B)
        throw std::invalid_argument("lookup_rows: seqs, feeds, owns, own_feeds and ks must have one entry a row");
    std::vector<Lookup> out(B);
    for (size_t b = 0; b < B; ++b) {
        shared.extend(seqs[b], feeds[b]);
        auto [drafts, m, prob, probs] = shared.speculate_stored(seqs[b], ks[b], min_prob, min_match, length_factor);
        double score = 0.0;
        for (double p : probs) score += p;
        int group = std::max(0, std::min(m, groups) - 1);
        if (!owns[b].is_none()) {
            SuffixTree& own = owns[b].cast<SuffixTree&>();
            own.extend(0, own_feeds[b]);
            auto [d, om, oprob, p] = own.speculate_stored(0, ks[b], min_prob, min_match, own_length_factor);
            double own_score = 0.0;
            for (double x : p) own_score += x;
            if (own_score > score) {
                drafts.swap(d);
                probs.swap(p);
                group = groups + std::max(0, std::min(om, groups) - 1);
            }
        }
        // the tree gives each prefix's probability; draft j's, given the drafts before it, is the ratio of two
        std::vector<double> cond(probs.size());
        for (size_t j = 0; j < probs.size(); ++j) cond[j] = probs[j] / (j ? probs[j - 1] : 1.0);
        out[b] = Lookup{std::move(drafts), std::move(cond), group};
    }
    return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    py::class_<SuffixTree>(m, "SuffixTree")
        .def(py::init<int>(), py::arg("max_depth"))
        .def("extend", &SuffixTree::extend, py::arg("seq"), py::arg("tokens"))
        .def("remove", &SuffixTree::remove, py::arg("seq"))
        .def("speculate", &SuffixTree::speculate, py::arg("context"), py::arg("max_spec"), py::arg("min_prob"),
             py::arg("min_match") = 1, py::arg("stored") = false, py::arg("length_factor") = 0.0)
        .def("speculate_stored", &SuffixTree::speculate_stored, py::arg("seq"), py::arg("max_spec"),
             py::arg("min_prob"), py::arg("min_match") = 1, py::arg("length_factor") = 0.0)
        .def("speculate_tree_stored", &SuffixTree::speculate_tree_stored, py::arg("seq"), py::arg("max_spec"),
             py::arg("width"), py::arg("max_nodes"), py::arg("min_prob"), py::arg("min_match") = 1,
             py::arg("length_factor") = 0.0)
        .def("num_tokens", &SuffixTree::num_tokens)
        .def("num_nodes", &SuffixTree::num_nodes)
        .def("num_sequences", &SuffixTree::num_sequences)
        .def("has", &SuffixTree::has)
        .def("check", &SuffixTree::check);
    m.def("lookup_rows", &lookup_rows, py::arg("shared"), py::arg("seqs"), py::arg("feeds"), py::arg("owns"),
          py::arg("own_feeds"), py::arg("ks"), py::arg("min_prob"), py::arg("min_match"), py::arg("length_factor"),
          py::arg("own_length_factor"), py::arg("groups"));
}
