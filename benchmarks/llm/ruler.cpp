#include "ruler.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <random>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "model_path.h"

namespace kvllm {

const std::vector<std::string>& ruler_task_names() {
    static const std::vector<std::string> names{"niah_single", "niah_multikey", "niah_multivalue",
                                                "vt",          "cwe",           "passkey"};
    return names;
}

bool ruler_task_needs_haystack(const std::string& task) {
    return task != "cwe" && task != "passkey";
}

// Concrete, common words that a 135M model spells in one or two tokens. No
// word is inside another, so finding one in an answer never finds a second
// (a test checks it).
const std::vector<std::string>& ruler_nouns() {
    static const std::vector<std::string> words{
        "apple", "badge", "bakery", "balloon", "bamboo", "banana", "banjo", "barrel", "basket", "beach",
        "beaver", "bedroom", "beetle", "bicycle", "blanket", "blossom", "bonnet", "bottle", "boulder",
        "bracelet", "bridge", "broom", "bucket", "buffalo", "bugle", "butter", "button", "cabbage", "cabin",
        "cactus", "camel", "camera", "candle", "canoe", "canyon", "carrot", "castle", "cattle", "cellar",
        "cherry", "chimney", "chisel", "circus", "closet", "clover", "cobweb", "coconut", "collar", "comet",
        "compass", "cookie", "copper", "cotton", "cousin", "coyote", "crayon", "cricket", "crystal",
        "cucumber", "curtain", "cushion", "dagger", "daisy", "desert", "diamond", "dolphin", "donkey",
        "dragon", "drawer", "eagle", "elbow", "engine", "falcon", "feather", "fiddle", "finger", "flannel",
        "flute", "forest", "fossil", "fountain", "fox", "garden", "garlic", "giraffe", "glacier", "glove",
        "goblet", "goose", "gravel", "guitar", "hammer", "harbor", "harp", "helmet", "hermit", "honey",
        "hornet", "island", "jacket", "jaguar", "jelly", "jewel", "jungle", "kettle", "kitten", "ladder",
        "lagoon", "lantern", "lemon", "leopard", "library", "lily", "lizard", "lobster", "locket", "magnet",
        "mango", "maple", "marble", "meadow", "melon", "mirror", "monkey", "moose", "mountain", "muffin",
        "mushroom", "napkin", "needle", "nest", "noodle", "oasis", "ocean", "olive", "onion", "orchard",
        "orchid", "otter", "oyster", "paddle", "palace", "panda", "parrot", "peach", "peanut", "pebble",
        "pelican", "pepper", "piano", "pickle", "pillow", "pine", "pirate", "pizza", "planet", "plum",
        "pocket", "pony", "potato", "pretzel", "puddle", "pumpkin", "puppet", "quilt", "rabbit", "raccoon",
        "radish", "raft", "raven", "ribbon", "river", "robin", "rocket", "saddle", "salmon", "sandal",
        "satchel", "scarf", "scissors", "seashell", "shovel", "shrimp", "silver", "skillet", "sled", "slipper",
        "snail", "sparrow", "spider", "spinach", "sponge", "squirrel", "statue", "stove", "strawberry",
        "sugar", "sunflower", "swan", "sweater", "table", "teapot", "thimble", "thunder", "tiger", "timber",
        "toast", "tomato", "tractor", "trumpet", "tulip", "tunnel", "turkey", "turnip", "turtle", "umbrella",
        "valley", "velvet", "violin", "volcano", "wagon", "walnut", "walrus", "whistle", "willow", "window",
        "wizard", "wolf", "yacht", "zebra", "acorn", "anchor", "antler", "apron", "attic", "avocado", "axle",
        "bagel", "bandana", "barley", "beacon", "biscuit", "blender", "bobcat", "bouquet", "brook", "buckle",
        "bunny", "canary", "candy", "caramel", "cargo", "cashew", "cathedral", "cedar", "cereal", "chalk",
        "chariot", "cheetah", "chestnut", "chipmunk", "cider", "cinnamon", "clam", "cliff", "cloak", "clock",
        "cobbler", "cocoa", "coral", "cork", "cottage", "crab", "crane", "crocodile", "crow", "crumb",
        "cupcake", "dandelion", "denim", "dew", "dinosaur", "dove", "dumpling", "eel", "elephant", "emerald",
        "envelope", "fern", "ferry", "fig", "flamingo", "flask", "fleece", "fork", "freckle", "frog", "frost",
        "gadget", "galaxy", "gazelle", "gecko", "gem", "ginger", "gnome", "gopher", "gourd", "granite",
        "grape", "griddle", "gull", "hamster", "hazel", "hedge", "heron", "hippo", "hive", "holly", "hood",
        "horse", "husky", "iceberg", "igloo", "iguana", "ink", "iris", "ivory", "ivy", "jar", "jasmine",
        "kayak", "kernel", "kiwi", "koala", "lamb", "lava", "leaf", "leek", "lemur", "lettuce", "lime",
        "llama", "loaf", "lotus", "lynx", "mallet", "mammoth", "mantle", "marsh", "mast", "meteor", "mint",
        "mitten", "mule", "nectar", "nickel", "nutmeg", "oatmeal", "octopus", "orange", "ostrich", "owl",
        "paprika", "parcel", "parsley", "pasta", "peacock", "pear", "pigeon", "pistachio", "plank", "poppy",
        "porridge", "possum", "prairie", "prism", "pudding", "puffin", "quail", "quartz", "radio", "raisin",
        "reef", "rhubarb", "rose", "ruby", "saffron", "sage", "sapphire", "sardine", "scooter", "seal",
        "shark", "sheep", "shelf", "skunk", "sloth", "snowflake", "sofa", "spoon", "squash", "stork",
        "sundial", "swamp", "syrup", "tambourine", "tangerine", "tapestry", "thistle", "tortoise", "toucan",
        "towel", "trout", "tuba", "tundra", "vanilla", "vase", "vest", "vulture", "waffle", "wasp", "whale",
        "wheat", "wren", "yarn", "yogurt", "zucchini", "asteroid", "bison", "blueberry", "bramble", "cauldron",
        "clarinet", "cobalt", "compost", "cranberry", "dune", "falafel", "glider", "harmonica", "hyena",
        "jigsaw", "kangaroo", "kiln", "lilac", "macaroni", "meringue", "mosaic", "mustard", "nugget", "oboe",
        "omelet", "orbit", "paintbrush", "parachute", "pendulum", "pewter", "plywood", "puzzle", "quiche",
        "rattle", "sandpaper", "saxophone", "scallop", "sequin", "sherbet", "slingshot", "snorkel", "spatula",
        "spool", "tadpole", "tinsel", "toboggan", "trolley", "tuxedo", "ukulele", "vineyard", "wardrobe",
        "weasel", "wicker", "windmill", "xylophone"};
    return words;
}

const std::vector<std::string>& ruler_adjectives() {
    static const std::vector<std::string> words{
        "ancient", "bitter", "bold", "brave", "bright", "brisk", "calm", "careful", "cheerful", "clever",
        "cold", "cosmic", "crisp", "curious", "daring", "dusty", "eager", "early", "elegant", "empty", "fancy",
        "fierce", "flat", "fluffy", "foggy", "fragile", "frozen", "gentle", "giant", "glossy", "golden",
        "grumpy", "happy", "heavy", "hidden", "hollow", "humble", "jolly", "keen", "lazy", "little", "lively",
        "lonely", "loud", "lucky", "magic", "merry", "misty", "modest", "narrow", "neat", "noble", "odd",
        "plain", "polite", "proud", "purple", "quick", "quiet", "rapid", "rare", "rigid", "rosy", "rough",
        "royal", "rusty", "salty", "scarlet", "secret", "shiny", "silent", "silly", "simple", "sleepy", "slow",
        "smooth", "snowy", "soft", "solid", "sour", "spicy", "steady", "sticky", "stormy", "strange", "sturdy",
        "sunny", "swift", "tall", "tame", "tender", "thin", "tidy", "tiny", "tough", "tranquil", "vast",
        "violet", "vivid", "warm", "wild", "windy", "wise", "witty", "wooden", "young", "zealous"};
    return words;
}

namespace {

bool is_space(char c) {
    return c == ' ' || c == '\n' || c == '\t' || c == '\r' || c == '\f' || c == '\v';
}

} // namespace

std::vector<std::string> haystack_units(const std::string& text) {
    // code blocks have no sentence ends: past this many characters a unit
    // also ends at a line break
    constexpr size_t kLongUnit = 300;
    size_t end = text.size();
    while (end > 0 && is_space(text[end - 1])) end--;
    std::vector<std::string> units;
    auto add = [&](size_t from, size_t to) {
        // every unit starts with whitespace (PromptPieces), the first too
        units.push_back((is_space(text[from]) ? "" : "\n") + text.substr(from, to - from));
    };
    size_t start = 0;
    for (size_t i = 1; i < end; i++) {
        const char prev = text[i - 1];
        // a boundary is whitespace after an ASCII non-space character, where
        // the pre-tokenizer splits whatever follows (a byte of a multi-byte
        // character, e.g. of a no-break space, might not be such a place)
        if (!is_space(text[i]) || is_space(prev) || (unsigned char)prev >= 0x80) continue;
        const bool sentence = prev == '.' || prev == '?' || prev == '!';
        const bool paragraph = text.compare(i, 2, "\n\n") == 0;
        const bool long_unit = text[i] == '\n' && i - start >= kLongUnit;
        if (sentence || paragraph || long_unit) {
            add(start, i);
            start = i;
        }
    }
    if (start < end) add(start, end);
    return units;
}

std::vector<std::string> default_haystack_files() {
    std::vector<std::string> files = find_installed("data/train/*.txt");
    if (files.empty()) {
        throw std::runtime_error(
                "no haystack text: data/train/*.txt not found (make it with .venv/bin/python "
                "benchmarks/scripts/python_doc_text.py --out data/train; python3-doc comes with "
                "scripts/setup.sh) or pass --haystack-file");
    }
    return files;
}

namespace {

/// 32-bit FNV-1a: a task name's share of its samples' seed, the same on
/// every platform (std::hash is not).
uint32_t fnv1a(const std::string& s) {
    uint32_t h = 2166136261u;
    for (unsigned char c : s) {
        h = (h ^ c) * 16777619u;
    }
    return h;
}

/** The generator of one sample: seeded by everything that names it, so a
 * sample is the same whatever other tasks, contexts or counts a run has. */
std::mt19937_64 sample_rng(const std::string& task, int64_t target_tokens, uint64_t seed, int64_t index) {
    std::seed_seq seq{uint32_t(seed), uint32_t(seed >> 32), fnv1a(task), uint32_t(target_tokens),
                      uint32_t(index)};
    return std::mt19937_64(seq);
}

/// n distinct values of draw().
template <class Draw>
std::vector<std::string> distinct(int n, Draw&& draw) {
    std::vector<std::string> out;
    while (int(out.size()) < n) {
        std::string v = draw();
        if (std::find(out.begin(), out.end(), v) == out.end()) out.push_back(std::move(v));
    }
    return out;
}

std::string magic_number(std::mt19937_64& rng) {
    return std::to_string(std::uniform_int_distribution<int64_t>(1000000, 9999999)(rng));
}

/// An adjective-noun key, e.g. "gentle-harbor" (RULER's keys are such pairs).
std::string magic_key(std::mt19937_64& rng) {
    const std::vector<std::string>& a = ruler_adjectives();
    const std::vector<std::string>& n = ruler_nouns();
    return a[std::uniform_int_distribution<size_t>(0, a.size() - 1)(rng)] + "-" +
           n[std::uniform_int_distribution<size_t>(0, n.size() - 1)(rng)];
}

/// A variable name of vt: 5 upper-case letters (RULER's).
std::string variable_name(std::mt19937_64& rng) {
    std::uniform_int_distribution<int> letter('A', 'Z');
    std::string s;
    for (int i = 0; i < 5; i++) s += char(letter(rng));
    return s;
}

std::invalid_argument unknown_task(const std::string& task) {
    std::string known;
    for (const std::string& t : ruler_task_names()) known += (known.empty() ? "" : ", ") + t;
    return std::invalid_argument("unknown ruler task '" + task + "' (tasks: " + known + ")");
}

std::invalid_argument too_small(const std::string& task, int64_t target_tokens, int64_t needed) {
    return std::invalid_argument("context " + std::to_string(target_tokens) + " is too small for task " +
                                 task + ": it needs at least " + std::to_string(needed) + " tokens");
}

/** intro, then consecutive haystack units from a random offset (wrapping
 * around) with the inserts among them, then the question: as many units
 * as keep the whole within target_tokens. The inserts go where a sentence
 * ends (as RULER's needles), not inside a code block: before unit k where
 * unit k - 1 ends in . ? or !, at the start or at the end.
 * place(points, n_units) picks their places among those points (sorted;
 * the unit count = at the end), in the inserts' order. */
template <class Place>
PromptPieces haystack_prompt(
        const std::string& task,
        int64_t target_tokens,
        const std::string& intro,
        const std::vector<std::string>& inserts,
        const std::string& question,
        const std::vector<std::string>& haystack,
        const TokenCounter& count,
        std::mt19937_64& rng,
        Place&& place) {
    if (haystack.empty()) {
        throw std::invalid_argument("task " + task + " needs haystack text (--haystack-file)");
    }
    // below this the "haystack" would be a sentence or two
    constexpr int64_t kMinHaystack = 64;
    int64_t fixed = count(intro) + count(question);
    for (const std::string& s : inserts) fixed += count(s);
    const int64_t budget = target_tokens - fixed;
    if (budget < kMinHaystack) {
        throw too_small(task, target_tokens, fixed + kMinHaystack);
    }
    std::vector<std::string> units;
    int64_t used = 0;
    size_t u = std::uniform_int_distribution<size_t>(0, haystack.size() - 1)(rng);
    for (size_t taken = 0; taken < haystack.size(); taken++, u = (u + 1) % haystack.size()) {
        const int64_t c = count(haystack[u]);
        if (used + c > budget) break;
        units.push_back(haystack[u]);
        used += c;
    }
    std::vector<int64_t> points{0};
    for (size_t k = 1; k <= units.size(); k++) {
        const char last = units[k - 1].back();
        if (k == units.size() || last == '.' || last == '?' || last == '!') points.push_back(int64_t(k));
    }
    const std::vector<int64_t> at = place(points, int64_t(units.size()));
    PromptPieces p;
    p.add(intro, count);
    size_t next = 0;
    for (int64_t i = 0; i <= int64_t(units.size()); i++) {
        for (; next < at.size() && at[next] == i; next++) p.add(inserts[next], count, true);
        if (i < int64_t(units.size())) p.add(units[i], count);
    }
    p.add(question, count);
    return p;
}

/// n of the points, uniformly (with replacement), sorted.
std::vector<int64_t> random_points(std::mt19937_64& rng, int n, const std::vector<int64_t>& points) {
    std::uniform_int_distribution<size_t> pick(0, points.size() - 1);
    std::vector<int64_t> at(n);
    for (int64_t& a : at) a = points[pick(rng)];
    std::sort(at.begin(), at.end());
    return at;
}

/// Where the needle (marked[0]) stands, as a fraction of the tokens before
/// the question: the placement rounds the drawn depth to a sentence end.
double needle_depth(const PromptPieces& prompt) {
    return double(prompt.token_of(prompt.marked[0])) / double(prompt.question_start());
}

/// The point nearest to depth * n_units (the first of two as near).
int64_t point_at_depth(double depth, const std::vector<int64_t>& points, int64_t n_units) {
    const double want = depth * double(n_units);
    return *std::min_element(points.begin(), points.end(), [&](int64_t a, int64_t b) {
        return std::fabs(double(a) - want) < std::fabs(double(b) - want);
    });
}

const char* kNiahIntro =
        "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the numbers afterwards.";

std::string niah_needle(const std::string& key, const std::string& value) {
    return " One of the special magic numbers for " + key + " is: " + value + ".";
}

/// niah_single, niah_multikey, niah_multivalue: 1 or 4 needles; the asked key's values are expected.
RulerSample niah_sample(const std::string& task, int64_t target_tokens, const std::vector<std::string>& haystack,
                        const TokenCounter& count, std::mt19937_64& rng) {
    RulerSample s;
    const int n_needles = task == "niah_single" ? 1 : 4;
    const bool multivalue = task == "niah_multivalue";
    const std::vector<std::string> keys = distinct(multivalue ? 1 : n_needles, [&] { return magic_key(rng); });
    const std::vector<std::string> values = distinct(n_needles, [&] { return magic_number(rng); });
    std::vector<std::string> needles;
    for (int i = 0; i < n_needles; i++) needles.push_back(niah_needle(keys[multivalue ? 0 : i], values[i]));
    std::string question;
    if (multivalue) {
        question = "\nWhat are all the special magic numbers for " + keys[0] +
                   " mentioned in the provided text? The special magic numbers for " + keys[0] +
                   " mentioned in the provided text are";
        s.expected = values;
        // four 7-digit values are 32 tokens (a token a digit, and the
        // space), 42 as the bullet list the model tends to write
        s.max_new = 64;
    } else {
        const size_t asked = std::uniform_int_distribution<size_t>(0, keys.size() - 1)(rng);
        question = "\nWhat is the special magic number for " + keys[asked] +
                   " mentioned in the provided text? The special magic number for " + keys[asked] +
                   " mentioned in the provided text is";
        s.expected = {values[asked]};
        s.max_new = 12;
    }
    // niah_single draws a depth (reported; the needle goes to the sentence
    // end nearest to it); the others draw places, and the needles go in in
    // the order of their sorted places
    double depth = std::uniform_real_distribution<double>(0, 1)(rng);
    auto place = [&](const std::vector<int64_t>& points, int64_t n_units) {
        if (n_needles == 1) return std::vector<int64_t>{point_at_depth(depth, points, n_units)};
        return random_points(rng, n_needles, points);
    };
    s.prompt = haystack_prompt(task, target_tokens, kNiahIntro, needles, question, haystack, count, rng, place);
    if (n_needles == 1) {
        s.depth_drawn = depth;
        s.depth = needle_depth(s.prompt);
    }
    return s;
}

/// vt: a chain of kHops assignments from one value and a distractor chain
/// from another, interleaved at random positions (each chain in order).
RulerSample vt_sample(int64_t target_tokens, const std::vector<std::string>& haystack, const TokenCounter& count,
                      std::mt19937_64& rng) {
    constexpr int kHops = 4;
    constexpr int kVars = kHops + 1;
    const std::vector<std::string> names = distinct(2 * kVars, [&] { return variable_name(rng); });
    const std::vector<std::string> values =
            distinct(2, [&] { return std::to_string(std::uniform_int_distribution<int>(10000, 99999)(rng)); });
    std::vector<std::vector<std::string>> chains(2);
    for (int c = 0; c < 2; c++) {
        const std::string* v = &names[c * kVars];
        chains[c].push_back(" VAR " + v[0] + " = " + values[c] + ".");
        for (int h = 1; h < kVars; h++) chains[c].push_back(" VAR " + v[h] + " = VAR " + v[h - 1] + ".");
    }
    std::vector<int> order(2 * kVars);
    for (int i = 0; i < 2 * kVars; i++) order[i] = i < kVars ? 0 : 1;
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<std::string> statements;
    size_t next[2] = {0, 0};
    for (int c : order) statements.push_back(chains[c][next[c]++]);
    RulerSample s;
    s.expected.assign(names.begin(), names.begin() + kVars);
    s.max_new = 64; // the reference answer alone is 32-36 tokens
    const std::string question = "\nFind all variables that are assigned the value " + values[0] +
                                 " in the text above. Answer: According to the chain(s) of variable assignment "
                                 "in the text above, " + std::to_string(kVars) +
                                 " variables are assigned the value " + values[0] + ", they are:";
    s.prompt = haystack_prompt(
            "vt", target_tokens, "Memorize and track the chain(s) of variable assignment hidden in the following text.",
            statements, question, haystack, count, rng,
            [&](const std::vector<int64_t>& points, int64_t) { return random_points(rng, 2 * kVars, points); });
    return s;
}

/** cwe: kCommon words kFreq times at most, and as many others as fit a
 * third as often (at most 3 times), shuffled into a numbered list. The
 * common words' frequency is the largest (<= 30, RULER's) whose entries
 * fill at most half the list's tokens, at least 2 (the uncommon words then
 * appear once). */
RulerSample cwe_sample(int64_t target_tokens, const TokenCounter& count, std::mt19937_64& rng) {
    constexpr int kCommon = 10, kMaxFreq = 30;
    const std::string intro =
            "Below is a numbered list of words. In these words, some appear more often than others. "
            "Memorize the ones that appear most often.";
    const std::string question = "\nWhat are the " + std::to_string(kCommon) +
                                 " most common words in the above list? Answer: The top " +
                                 std::to_string(kCommon) + " words that appear most often in the list are:";
    std::vector<std::string> words = ruler_nouns();
    std::shuffle(words.begin(), words.end(), rng);
    const int64_t fixed = count(intro) + count(question);
    const int64_t budget = target_tokens - fixed;
    // entry i is the pieces "\n<i>." and " <word>"
    std::vector<int64_t> numbering{0}; // numbering[n]: tokens of the numbers of n entries
    auto numbers = [&](int64_t n) {
        while (int64_t(numbering.size()) <= n) {
            numbering.push_back(numbering.back() + count("\n" + std::to_string(numbering.size()) + "."));
        }
        return numbering[n];
    };
    std::vector<int64_t> word_tokens(words.size());
    int64_t common_tokens = 0;
    for (int i = 0; i < kCommon; i++) common_tokens += word_tokens[i] = count(" " + words[i]);
    int freq = kMaxFreq;
    while (freq >= 2 && numbers(kCommon * freq) + freq * common_tokens > budget / 2) freq--;
    if (freq < 2) {
        throw too_small("cwe", target_tokens, fixed + 2 * (numbers(2 * kCommon) + 2 * common_tokens));
    }
    const int rare = std::clamp(freq / 3, 1, 3);
    int64_t n = kCommon * freq, used = numbers(n) + freq * common_tokens;
    size_t n_words = kCommon;
    // when the word list runs out first, the list stays shorter than the context
    for (; n_words < words.size(); n_words++) {
        const int64_t more = numbers(n + rare) - numbers(n) + rare * count(" " + words[n_words]);
        if (used + more > budget) break;
        used += more;
        n += rare;
    }
    std::vector<std::string> entries;
    for (size_t w = 0; w < n_words; w++) entries.insert(entries.end(), w < kCommon ? freq : rare, words[w]);
    std::shuffle(entries.begin(), entries.end(), rng);
    RulerSample s;
    s.prompt.add(intro, count);
    for (size_t i = 0; i < entries.size(); i++) {
        s.prompt.add("\n" + std::to_string(i + 1) + ".", count);
        s.prompt.add(" " + entries[i], count);
    }
    s.prompt.add(question, count);
    s.expected.assign(words.begin(), words.begin() + kCommon);
    s.max_new = 50;
    return s;
}

/// " a, b, c.": items as an answer lists them, each after `prefix`; the
/// offset of each item's first character in `starts`.
std::string listed(const std::vector<std::string>& items, const std::string& prefix, std::vector<size_t>& starts) {
    std::string out;
    starts.clear();
    for (size_t i = 0; i < items.size(); i++) {
        out += (i ? ", " : " ") + prefix;
        starts.push_back(out.size());
        out += items[i];
    }
    return out + ".";
}

} // namespace

RulerSample make_ruler_sample(
        const std::string& task,
        int64_t target_tokens,
        uint64_t seed,
        int64_t index,
        const std::vector<std::string>& haystack,
        const TokenCounter& count) {
    std::mt19937_64 rng = sample_rng(task, target_tokens, seed, index);
    RulerSample s;
    if (task == "niah_single" || task == "niah_multikey" || task == "niah_multivalue") {
        s = niah_sample(task, target_tokens, haystack, count, rng);
    } else if (task == "vt") {
        s = vt_sample(target_tokens, haystack, count, rng);
    } else if (task == "cwe") {
        s = cwe_sample(target_tokens, count, rng);
    } else if (task == "passkey") {
        const std::string key = std::to_string(std::uniform_int_distribution<int>(10000, 99999)(rng));
        s.depth_drawn = std::uniform_real_distribution<double>(0, 1)(rng);
        s.prompt = needle_prompt(count, target_tokens, s.depth_drawn, key);
        s.depth = needle_depth(s.prompt);
        s.expected = {key};
        s.max_new = 12;
        if (s.prompt.n_tokens() > target_tokens) { // needle_prompt keeps one filler at least
            throw too_small(task, target_tokens, s.prompt.n_tokens());
        }
    } else {
        throw unknown_task(task);
    }
    s.task = task;
    // vt's names stand as "VAR ABCDE" in the text
    s.reference = listed(s.expected, task == "vt" ? "VAR " : "", s.reference_items);
    return s;
}

std::vector<int64_t> tokens_at(const BpeTokenizer& tok, const std::vector<int>& ids, const std::vector<size_t>& offsets) {
    std::vector<int64_t> at;
    size_t end = 0; // end of the text of tokens [0, t]
    int64_t t = -1;
    for (size_t off : offsets) {
        while (end <= off) {
            if (++t == int64_t(ids.size())) {
                throw std::invalid_argument("tokens_at: offset " + std::to_string(off) + " past the " +
                                            std::to_string(end) + " characters of the tokens");
            }
            end += tok.decode({ids[t]}).size();
        }
        at.push_back(t);
    }
    return at;
}

double ruler_score(const std::string& answer, const std::vector<std::string>& expected) {
    if (expected.empty()) {
        throw std::invalid_argument("ruler_score: nothing expected");
    }
    auto lower = [](std::string s) {
        for (char& c : s) c = char(std::tolower((unsigned char)c));
        return s;
    };
    // an expected string counts where it stands alone: "8394764" not in
    // "83947640", "pear" not in "appear" (RULER's own check, a substring,
    // takes both)
    auto joins = [](char a, char b) {
        auto digit = [](char c) { return c >= '0' && c <= '9'; };
        auto letter = [](char c) { return std::isalpha((unsigned char)c) != 0; };
        return (digit(a) && digit(b)) || (letter(a) && letter(b));
    };
    const std::string a = lower(answer);
    int found = 0;
    for (const std::string& raw : expected) {
        const std::string e = lower(raw);
        bool alone = false;
        for (size_t at = a.find(e); !alone && at != std::string::npos; at = a.find(e, at + 1)) {
            alone = !(at > 0 && !e.empty() && joins(a[at - 1], e.front())) &&
                    !(at + e.size() < a.size() && !e.empty() && joins(e.back(), a[at + e.size()]));
        }
        found += alone;
    }
    return double(found) / double(expected.size());
}

void check_ruler_prompts(
        const std::vector<std::string>& tasks,
        const std::vector<int64_t>& contexts,
        int samples,
        int64_t max_context,
        const std::string& why) {
    if (samples < 1) {
        throw std::invalid_argument("--samples " + std::to_string(samples) + ": need at least 1");
    }
    if (tasks.empty() || contexts.empty()) {
        throw std::invalid_argument("ruler needs a task and a context at least");
    }
    const std::vector<std::string>& known = ruler_task_names();
    for (const std::string& t : tasks) {
        if (std::find(known.begin(), known.end(), t) == known.end()) {
            throw unknown_task(t);
        }
    }
    for (int64_t c : contexts) {
        if (c < 1 || c > max_context) {
            throw std::invalid_argument("context " + std::to_string(c) + " outside [1, " +
                                        std::to_string(max_context) + "] (" + why + ")");
        }
    }
}

void check_ruler_config(const RulerConfig& cfg, int64_t n_ctx_train) {
    if (cfg.max_new < 0) {
        throw std::invalid_argument("--max-new " + std::to_string(cfg.max_new) + " must be >= 0");
    }
    if (cfg.indexes.empty()) {
        throw std::invalid_argument("ruler needs an index at least");
    }
    // --likelihood reads the reference after the prompt, in the same context
    const int64_t room = cfg.likelihood ? kReferenceRoom : 0;
    check_ruler_prompts(cfg.tasks, cfg.contexts, cfg.samples, n_ctx_train - room,
                        "the model's training context" +
                                (room ? " less " + std::to_string(room) + " tokens for --likelihood's reference answer"
                                      : std::string()));
}

void run_ruler(
        const LlamaModel& llm,
        const BpeTokenizer& tok,
        const std::vector<std::string>& haystack,
        const RulerConfig& cfg,
        std::ostream& out) {
    check_ruler_config(cfg, llm.cfg.n_ctx_train);
    const IndexSet set(cfg);
    set.check(llm, cfg.contexts);
    const std::vector<kvindex::IndexSpec>& specs = set.specs;
    const TokenCounter count = token_counter(tok);
    // a context too small for a task fails now, not hours into the run
    for (int64_t c : cfg.contexts) {
        for (const std::string& t : cfg.tasks) make_ruler_sample(t, c, cfg.seed, 0, haystack, count);
    }
    const size_t NC = cfg.contexts.size(), NT = cfg.tasks.size(), NX = specs.size();
    // sums over the samples of one (context, task)
    struct IndexTally {
        double score = 0, agree = 0;
        // --likelihood: the difference of the reference's log p to dense's
        // (and its square), KL, top-1 agreement, token and item accuracy
        double ref_delta = 0, ref_delta_sq = 0, ref_kl = 0, ref_top1 = 0, ref_accuracy = 0, ref_items = 0;
        IndexTally& operator+=(const IndexTally& o) {
            score += o.score, agree += o.agree, ref_delta += o.ref_delta;
            ref_delta_sq += o.ref_delta_sq, ref_kl += o.ref_kl, ref_top1 += o.ref_top1;
            ref_accuracy += o.ref_accuracy, ref_items += o.ref_items;
            return *this;
        }
        IndexTally& operator/=(double n) {
            score /= n, agree /= n, ref_delta /= n, ref_delta_sq /= n, ref_kl /= n, ref_top1 /= n;
            ref_accuracy /= n, ref_items /= n;
            return *this;
        }
    };
    struct Tally {
        double dense = 0, ref_dense = 0; ///< dense's score and log p of the reference
        double ref_tokens = 0;           ///< tokens of the reference
        /// dense's token and item accuracy on the reference
        double ref_accuracy_dense = 0, ref_items_dense = 0;
        std::vector<IndexTally> x;       ///< per index
    };
    const Tally zero{0, 0, 0, 0, 0, std::vector<IndexTally>(NX)};
    std::vector<std::vector<Tally>> tally(NC, std::vector<Tally>(NT, zero));
    nlohmann::json cases = nlohmann::json::array();
    char line[1024];
    for (size_t ci = 0; ci < NC; ci++) {
        for (size_t ti = 0; ti < NT; ti++) {
            for (int si = 0; si < cfg.samples; si++) {
                const RulerSample s = make_ruler_sample(cfg.tasks[ti], cfg.contexts[ci], cfg.seed, si, haystack, count);
                const std::vector<int> prompt = encode_pieces(tok, s.prompt);
                const int64_t q0 = s.prompt.question_start();
                const std::vector<int> reference = cfg.likelihood ? tok.encode(s.reference, false) : std::vector<int>();
                // the reference's token where each expected string begins
                const std::vector<int64_t> items =
                        cfg.likelihood ? tokens_at(tok, reference, s.reference_items) : std::vector<int64_t>();
                // item accuracy: the share of the expected strings whose first
                // token the model predicts, teacher-forced (the answer so far
                // given, the next item retrieved from the prompt)
                auto item_accuracy = [&](const ReferenceFit& f) {
                    double hit = 0;
                    for (int64_t t : items) hit += f.correct.at(size_t(t));
                    return hit / double(items.size());
                };
                const PromptAnswers a = answer_prompt(llm, tok, prompt, q0, cfg.max_new > 0 ? cfg.max_new : s.max_new,
                                                      set, true, reference);
                const double dense_score = ruler_score(a.dense.text, s.expected);
                Tally& t = tally[ci][ti];
                t.dense += dense_score;
                std::vector<int64_t> marked;
                for (size_t m : s.prompt.marked) marked.push_back(s.prompt.token_of(m));
                nlohmann::json c = {{"task", s.task}, {"context", cfg.contexts[ci]}, {"sample", si},
                                    {"tokens", prompt.size()}, {"question_token", q0},
                                    {"needle_tokens", marked}, {"expected", s.expected},
                                    {"prefill_s", a.prefill_s},
                                    {"dense", {{"answer", a.dense.text}, {"score", dense_score}}}};
                c["depth"] = s.depth >= 0 ? nlohmann::json(s.depth) : nlohmann::json(nullptr);
                if (cfg.likelihood) {
                    c["reference"] = {{"text", s.reference}, {"tokens", reference.size()}};
                    c["dense"]["reference_log_prob"] = a.dense.reference.log_prob;
                    c["dense"]["reference_accuracy"] = a.dense.reference.accuracy;
                    const double dense_items = item_accuracy(a.dense.reference);
                    c["dense"]["reference_item_accuracy"] = dense_items;
                    t.ref_dense += a.dense.reference.log_prob;
                    t.ref_accuracy_dense += a.dense.reference.accuracy;
                    t.ref_items_dense += dense_items;
                    t.ref_tokens += double(reference.size());
                }
                auto print = [&](const std::string& label, double score, const char* agree, const std::string& text) {
                    std::snprintf(line, sizeof(line), "  %-15s ctx %5zu #%-3d %-44s %5.2f %-4s %s\n",
                                  s.task.c_str(), prompt.size(), si, label.c_str(), score, agree,
                                  nlohmann::json(text).dump().c_str());
                    out << line;
                };
                print("dense", dense_score, "", a.dense.text);
                nlohmann::json results = nlohmann::json::array();
                for (size_t xi = 0; xi < NX; xi++) {
                    const Answer& r = a.indexes[xi];
                    const double score = ruler_score(r.text, s.expected);
                    const bool agree = same_answer(r.tokens, a.dense.tokens, tok);
                    t.x[xi].score += score;
                    t.x[xi].agree += agree;
                    results.push_back({{"index", specs[xi].str()}, {"params", r.params}, {"answer", r.text},
                                       {"score", score}, {"agree", agree}});
                    if (cfg.likelihood) {
                        const ReferenceFit& f = r.reference;
                        const double delta = f.log_prob - a.dense.reference.log_prob, f_items = item_accuracy(f);
                        t.x[xi].ref_delta += delta;
                        t.x[xi].ref_delta_sq += delta * delta;
                        t.x[xi].ref_kl += f.kl_mean;
                        t.x[xi].ref_top1 += f.top1;
                        t.x[xi].ref_accuracy += f.accuracy;
                        t.x[xi].ref_items += f_items;
                        results.back()["reference_log_prob"] = f.log_prob;
                        results.back()["reference_kl"] = f.kl_mean;
                        results.back()["reference_top1"] = f.top1;
                        results.back()["reference_accuracy"] = f.accuracy;
                        results.back()["reference_item_accuracy"] = f_items;
                    }
                    print(specs[xi].str(), score, agree ? "same" : "diff", r.text);
                }
                out << std::flush;
                c["indexes"] = results;
                cases.push_back(c);
            }
        }
    }

    std::snprintf(line, sizeof(line),
                  "\nruler (%d samples per task and context): score = mean fraction of the expected strings "
                  "in the answer;\nrel = index score / dense score; agree = share of answers that are dense's "
                  "(same_answer: the shorter generation starts the longer); task \"all\" = mean of the "
                  "tasks\n",
                  cfg.samples);
    out << line;
    std::snprintf(line, sizeof(line), "%-16s %7s %6s  %-44s %6s %6s %6s\n", "task", "context", "dense", "index",
                  "score", "rel", "agree");
    out << line;
    // the means over the samples of (context, task), and of task "all" (ti
    // == NT): the tasks' means averaged (every task has cfg.samples samples:
    // the mean of all)
    auto mean_of = [&](size_t ci, size_t ti) {
        const size_t t0 = ti < NT ? ti : 0, t1 = ti < NT ? ti + 1 : NT;
        Tally m = zero;
        for (size_t t = t0; t < t1; t++) {
            const Tally& x = tally[ci][t];
            m.dense += x.dense;
            m.ref_dense += x.ref_dense;
            m.ref_tokens += x.ref_tokens;
            m.ref_accuracy_dense += x.ref_accuracy_dense;
            m.ref_items_dense += x.ref_items_dense;
            for (size_t xi = 0; xi < NX; xi++) m.x[xi] += x.x[xi];
        }
        const double n = double(cfg.samples) * double(t1 - t0);
        m.dense /= n;
        m.ref_dense /= n;
        m.ref_tokens /= n;
        m.ref_accuracy_dense /= n;
        m.ref_items_dense /= n;
        for (IndexTally& x : m.x) x /= n;
        return m;
    };
    auto task_name = [&](size_t ti) { return ti < NT ? cfg.tasks[ti] : std::string("all"); };
    nlohmann::json summary = nlohmann::json::array();
    for (size_t ci = 0; ci < NC; ci++) {
        for (size_t ti = 0; ti <= NT; ti++) {
            const Tally m = mean_of(ci, ti);
            for (size_t xi = 0; xi < NX; xi++) {
                const IndexTally& x = m.x[xi];
                // no ratio where dense scored 0
                const nlohmann::json rel = m.dense > 0 ? nlohmann::json(x.score / m.dense) : nlohmann::json();
                char rel_s[32] = "-";
                if (!rel.is_null()) std::snprintf(rel_s, sizeof(rel_s), "%.3f", rel.get<double>());
                std::snprintf(line, sizeof(line), "%-16s %7lld %6.3f  %-44s %6.3f %6s %6.3f\n", task_name(ti).c_str(),
                              (long long)cfg.contexts[ci], m.dense, specs[xi].str().c_str(), x.score, rel_s,
                              x.agree);
                out << line;
                summary.push_back({{"task", task_name(ti)}, {"context", cfg.contexts[ci]}, {"samples", cfg.samples},
                                   {"dense", m.dense}, {"index", specs[xi].str()}, {"score", x.score},
                                   {"relative", rel}, {"agreement", x.agree}});
            }
        }
    }
    if (cfg.likelihood) {
        out << "\nreference answers read teacher-forced: log p of the whole reference (nats) under dense and the "
               "index;\ndelta = index - dense (mean over the samples, +- its standard error); rel = exp(delta), the "
               "index's\nlikelihood of the right answer relative to dense's (geometric mean); rel/tok = exp(delta / "
               "tokens),\nthe same per token of the answer; KL(dense || index) and top-1 agreement: means over the "
               "reference positions;\nacc_d, acc = dense's and the index's token accuracy (the share of the "
               "reference's tokens each\npredicts as most likely, teacher-forced), acc/d = acc / acc_d; item_d, "
               "item, item/d the same over\nthe first token of each expected string (the answer so far given, "
               "the next item retrieved)\n";
        std::snprintf(line, sizeof(line), "%-16s %7s %8s  %-44s %8s %8s %7s %6s %7s %9s %6s %6s %6s %6s %6s %6s %6s\n",
                      "task", "context", "dense_lp", "index", "index_lp", "delta", "+-se", "rel", "rel/tok", "KL",
                      "top1", "acc_d", "acc", "acc/d", "item_d", "item", "item/d");
        out << line;
        size_t row = 0;
        for (size_t ci = 0; ci < NC; ci++) {
            for (size_t ti = 0; ti <= NT; ti++) {
                const Tally m = mean_of(ci, ti);
                const double n = double(cfg.samples) * double(ti < NT ? 1 : NT);
                for (size_t xi = 0; xi < NX; xi++, row++) {
                    const IndexTally& x = m.x[xi];
                    // standard error of the mean delta over the n samples
                    const double var = std::max(0.0, x.ref_delta_sq - x.ref_delta * x.ref_delta);
                    const double se = n > 1 ? std::sqrt(var / (n - 1)) : 0.0;
                    const double index_lp = m.ref_dense + x.ref_delta;
                    const double rel = std::exp(x.ref_delta), rel_token = std::exp(x.ref_delta / m.ref_tokens);
                    // no ratio where dense predicted none of them
                    auto ratio = [](double index, double dense) {
                        return dense > 0 ? nlohmann::json(index / dense) : nlohmann::json();
                    };
                    auto ratio_text = [](const nlohmann::json& r) {
                        char text[32] = "-";
                        if (!r.is_null()) std::snprintf(text, sizeof(text), "%.3f", r.get<double>());
                        return std::string(text);
                    };
                    const nlohmann::json acc_rel = ratio(x.ref_accuracy, m.ref_accuracy_dense);
                    const nlohmann::json item_rel = ratio(x.ref_items, m.ref_items_dense);
                    std::snprintf(line, sizeof(line),
                                  "%-16s %7lld %8.3f  %-44s %8.3f %+8.3f %7.3f %6.3f %7.4f %9.2e %6.3f %6.3f %6.3f %6s "
                                  "%6.3f %6.3f %6s\n",
                                  task_name(ti).c_str(), (long long)cfg.contexts[ci], m.ref_dense,
                                  specs[xi].str().c_str(), index_lp, x.ref_delta, se, rel, rel_token, x.ref_kl,
                                  x.ref_top1, m.ref_accuracy_dense, x.ref_accuracy, ratio_text(acc_rel).c_str(),
                                  m.ref_items_dense, x.ref_items, ratio_text(item_rel).c_str());
                    out << line;
                    summary[row]["reference"] = {{"log_prob_dense", m.ref_dense}, {"log_prob", index_lp},
                                                 {"delta", x.ref_delta}, {"delta_se", se}, {"relative", rel},
                                                 {"tokens", m.ref_tokens}, {"relative_per_token", rel_token},
                                                 {"kl", x.ref_kl}, {"top1", x.ref_top1},
                                                 {"accuracy_dense", m.ref_accuracy_dense},
                                                 {"accuracy", x.ref_accuracy}, {"accuracy_relative", acc_rel},
                                                 {"item_accuracy_dense", m.ref_items_dense},
                                                 {"item_accuracy", x.ref_items}, {"item_accuracy_relative", item_rel}};
                }
            }
        }
    }
    if (!cfg.json_out.empty()) {
        nlohmann::json config = {{"contexts", cfg.contexts}, {"samples", cfg.samples}, {"tasks", cfg.tasks},
                                 {"seed", cfg.seed}, {"max_new", cfg.max_new}, {"indexes", cfg.indexes},
                                 {"dense_index", cfg.dense_index}, {"dense_layers", cfg.dense_layers},
                                 {"trained", cfg.trained}, {"haystack_files", cfg.haystack_files},
                                 {"likelihood", cfg.likelihood}};
        write_json(cfg.json_out, {{"summary", summary}, {"cases", cases}, {"config", config}});
    }
}

} // namespace kvllm
